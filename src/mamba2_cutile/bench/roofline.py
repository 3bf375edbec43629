"""Roofline floors of the SSD forward: minimal HBM bytes and tensor-core FLOPs.

Constants measured on the H200 of this project (the datasheet says 4.8 TB/s and 989 TFLOP/s).
"""

HBM_BYTES_PER_S = 4.3e12
TC_FLOPS_PER_S = 790e12
CONSTANTS = "4.3 TB/s HBM, 790 TFLOP/s bf16 (measured on H200)"


def forward_bytes(b, l, h, g, p, n, elem=2, has_z=False):
    """Read x, B, C, dt (and z), write out: the minimum any forward must move."""
    io = b * l * h * p * elem * (2 + has_z)
    io += 2 * b * l * g * n * elem
    io += b * l * h * 4
    return io


def forward_flops(b, l, h, g, p, n, chunk):
    """Tensor-core FLOPs of the chunked algorithm: C B^T (per group), the masked (CB) X, the
    chunk states X^T B and the carried-state term C h (per head)."""
    cb = 2 * b * l * chunk * n * g
    per_head = 2 * b * l * h * (chunk * p + 2 * p * n)
    return cb + per_head


def floor_ms(bytes_, flops):
    return max(bytes_ / HBM_BYTES_PER_S, flops / TC_FLOPS_PER_S) * 1e3
