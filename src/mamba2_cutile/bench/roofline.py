"""Roofline floors of the SSD forward and backward: minimal HBM bytes and tensor-core FLOPs.

The floor of a kernel is max(bytes / HBM bandwidth, FLOPs / tensor-core throughput), with
the constants measured on the H200 of this project (the datasheet says 4.8 TB/s and
989 TFLOP/s dense bf16). Byte counts are what any implementation must move at least: every
input read once, every output written once (no intermediate round trips). FLOP counts are the
tensor-core products of the chunked (SSD) algorithm at the given chunk size; elementwise work
(exponentials, masks, row sums) is not counted.

Notation: b batch, l seqlen, h heads, g groups, p headdim, n dstate, Q chunk size,
e bytes per element of x/B/C/z/out (2 for bf16/fp16, 4 for fp32); dt is float32.
"""

HBM_BYTES_PER_S = 4.3e12
TC_FLOPS_PER_S = 790e12
CONSTANTS = "4.3 TB/s HBM, 790 TFLOP/s bf16 (measured on H200)"


def forward_bytes(b, l, h, g, p, n, elem=2, has_z=False, states=False, seq_idx=False):
    """Read x, B, C, dt (and z), write out: the minimum any forward must move.

    `states`: also read the initial state and write the final state (float32, b*h*p*n each).
    `seq_idx`: also read seq_idx (int32, b*l).
    """
    io = b * l * h * p * elem * (2 + has_z)
    io += 2 * b * l * g * n * elem
    io += b * l * h * 4
    if states:
        io += 2 * b * h * p * n * 4
    if seq_idx:
        io += b * l * 4
    return io


def forward_flops(b, l, h, g, p, n, chunk):
    """Tensor-core FLOPs of the chunked algorithm: C B^T (per group), the masked (CB) X, the
    chunk states X^T B and the carried-state term C h (per head)."""
    cb = 2 * b * l * chunk * n * g
    per_head = 2 * b * l * h * (chunk * p + 2 * p * n)
    return cb + per_head


def backward_bytes(b, l, h, g, p, n, elem=2, has_z=False, states=False, seq_idx=False):
    """Read x, B, C, dt, dout (and z), write dx, dB, dC, ddt (and dz).

    `states`: also read dfinal_states and the initial state, write dinitial_states
    (float32, b*h*p*n each). `seq_idx`: also read seq_idx. The per-head dA, dD, ddt_bias are
    negligible and not counted.
    """
    io = b * l * h * p * elem * (3 + 2 * has_z)      # x, dout, dx (+ z, dz)
    io += 4 * b * l * g * n * elem                     # B, C, dB, dC
    io += 2 * b * l * h * 4                            # dt, ddt
    if states:
        io += 3 * b * h * p * n * 4
    if seq_idx:
        io += b * l * 4
    return io


def backward_flops(b, l, h, g, p, n, chunk):
    """Tensor-core FLOPs of the gradients of the chunked algorithm, per chunk of Q tokens:

    per head:  dX += (L o CB)^T dY          2 Q^2 p
               dCB = (dY X^T) o L           2 Q^2 p
               dh  = C^T dY (state grads)   2 Q p n
               dC += dY h^T                 2 Q p n
               dX += B dh^T                 2 Q p n
               dB += X dh                   2 Q p n
    per group: dC += dCB B, dB += dCB^T C   4 Q^2 n   (dCB summed over the group's heads)

    i.e. 4Qp + 8pn per head-token and 4Qn per group-token. Recomputing C B^T or the chunk
    states from the forward is not counted (a floor, not a model of any implementation).
    """
    per_group = 4 * b * l * chunk * n * g
    per_head = b * l * h * (4 * chunk * p + 8 * p * n)
    return per_group + per_head


def floor_ms(bytes_, flops):
    return max(bytes_ / HBM_BYTES_PER_S, flops / TC_FLOPS_PER_S) * 1e3


def bound(bytes_, flops):
    """'memory' or 'compute': which side of the roofline sets the floor."""
    return "memory" if bytes_ / HBM_BYTES_PER_S >= flops / TC_FLOPS_PER_S else "compute"


def problem_floor(b, l, h, g, p, n, chunk, mode="fwd", elem=2, has_z=False, states=True,
                  seq_idx=False):
    """Floor of one benchmark case: (floor_ms, bytes, flops, bound) for mode fwd, bwd or
    fwdbwd (the sum of the two)."""
    kw = dict(elem=elem, has_z=has_z, states=states, seq_idx=seq_idx)
    fb, ff = forward_bytes(b, l, h, g, p, n, **kw), forward_flops(b, l, h, g, p, n, chunk)
    bb, bf = backward_bytes(b, l, h, g, p, n, **kw), backward_flops(b, l, h, g, p, n, chunk)
    if mode == "fwd":
        by, fl = fb, ff
    elif mode == "bwd":
        by, fl = bb, bf
    elif mode == "fwdbwd":
        by, fl = fb + bb, ff + bf
    else:
        raise ValueError(f"mode must be fwd, bwd or fwdbwd, got {mode!r}")
    return floor_ms(by, fl), by, fl, bound(by, fl)
