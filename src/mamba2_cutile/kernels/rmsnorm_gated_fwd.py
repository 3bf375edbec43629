"""Gated RMSNorm, forward: one program per (block of BLOCK_M rows, channel group).

For each row and group g of S = group_size channels (x, z of one row; w, b the group's weight
and bias), in float32:

    u      = x * silu(z)               if HAS_Z and not NORM_BEFORE_GATE, else x
    rstd   = 1 / sqrt(sum_j u_j^2 / S + eps)
    y      = u * rstd * w (+ b)
    out    = y * silu(z)               if HAS_Z and NORM_BEFORE_GATE, else y

with silu(z) = z * sigmoid(z). rstd (one float32 per row and group) is saved for the backward.

Layout: x, z and out are (M, G, S) views of (M, hidden) rows (any row stride, unit channel
stride), weight and bias (G, S), rstd (G, M). A tile is (BLOCK_M, 1, BLOCK_G) with BLOCK_G the
power of two >= S; the channels past S and the rows past M load as zeros, so they add nothing
to the sum of squares, and their part of the store is dropped.
APPROX: the sigmoid's approximate form (`_common.sigmoid`; for 16-bit z and x).
TMA=False makes every load and store plain (no shared-memory staging, and no TMA producer warps:
a CTA is its worker warps alone, so twice as many fit on an SM).
Grid: (cdiv(M, BLOCK_M), G).
"""

import cuda.tile as ct

from ._common import int64_variant, sigmoid


def rmsnorm_gated_fwd_fn(
    x,           # (M, G, S) fp16/bf16/fp32
    z,           # (M, G, S) any float dtype (ignored unless HAS_Z)
    weight,      # (G, S)
    bias,        # (G, S) (ignored unless HAS_BIAS)
    out,         # (M, G, S) out, x's dtype
    rstd,        # (G, M) float32 out
    eps: float,
    BLOCK_M: ct.Constant[int],
    BLOCK_G: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_BIAS: ct.Constant[bool],
    NORM_BEFORE_GATE: ct.Constant[bool],
    TMA: ct.Constant[bool],
    APPROX: ct.Constant[bool],
):
    row_blk, group = ct.bid(0), ct.bid(1)
    size = x.shape[2]
    zero = ct.PaddingMode.ZERO
    tile3, tile2 = (BLOCK_M, 1, BLOCK_G), (BLOCK_M, BLOCK_G)
    u = ct.load(x, index=(row_blk, group, 0), shape=tile3, padding_mode=zero,
                allow_tma=TMA).reshape(tile2).astype(ct.float32)
    gate = u                        # replaced below when HAS_Z (read only then)
    if HAS_Z:
        zt = ct.load(z, index=(row_blk, group, 0), shape=tile3, padding_mode=zero,
                     allow_tma=TMA).reshape(tile2).astype(ct.float32)
        gate = zt * sigmoid(zt, APPROX)
        if not NORM_BEFORE_GATE:
            u = u * gate
    mean_sq = ct.sum(u * u, axis=1, keepdims=True) / size
    r = 1.0 / ct.sqrt(mean_sq + eps)                                    # (BLOCK_M, 1)
    w = ct.load(weight, index=(group, 0), shape=(1, BLOCK_G), padding_mode=zero,
                allow_tma=TMA).astype(ct.float32)
    y = u * r * w
    if HAS_BIAS:
        y = y + ct.load(bias, index=(group, 0), shape=(1, BLOCK_G), padding_mode=zero,
                        allow_tma=TMA).astype(ct.float32)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y = y * gate
    ct.store(out, index=(row_blk, group, 0), tile=y.reshape(tile3).astype(out.dtype),
             allow_tma=TMA)
    ct.store(rstd, index=(group, row_blk), tile=r.reshape((1, BLOCK_M)), allow_tma=TMA)


rmsnorm_gated_fwd = ct.kernel(rmsnorm_gated_fwd_fn)
rmsnorm_gated_fwd_i64 = ct.kernel(int64_variant(rmsnorm_gated_fwd_fn,
                                                ["x", "z", "weight", "bias", "out", "rstd"]))
