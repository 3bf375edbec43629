"""Gated RMSNorm, backward: program (p, g) walks the row blocks p, p + P, p + 2P, ... of channel
group g (P = the grid's first size), recomputing the normalised value from x and the saved
rstd, and writes its partial sums of dweight and dbias to row p of a (P, G, S) buffer, summed
over p afterwards in a fixed order (deterministic: no atomics).

Per row, with gate = silu(z) = z sigmoid(z), gate' = sigmoid(z) (1 + z (1 - sigmoid(z))) and
S = group_size, in float32:

    u      = x * gate  if HAS_Z and not NORM_BEFORE_GATE, else x
    xhat   = u * rstd
    if HAS_Z and NORM_BEFORE_GATE:
        dz   = dout * (xhat w (+ b)) * gate'
        dy   = dout * gate
    else:
        dy   = dout
    dw    += dy * xhat,  db += dy
    c      = sum_j xhat_j w_j dy_j / S
    du     = (w dy - xhat c) * rstd
    dx     = du * gate, dz = du * x * gate'   if HAS_Z and not NORM_BEFORE_GATE, else dx = du

Rows past M load as zeros (x, dout and rstd alike), so they add nothing to dw and db; channels
past S have w = 0 and x = 0, so they add nothing to c. Layout as the forward kernel's: x, z,
dout, dx, dz (M, G, S); weight, bias (G, S); rstd (G, M); dw_part, db_part (P, G, S) float32.
TMA=False: every load and store plain (no TMA producer warps), as in the forward kernel.
APPROX: the sigmoid's approximate form (`_common.sigmoid`; for 16-bit z and x).
LATENCY: the row loads' latency hint (1-10; 0: none), which sets how far ahead the compiler
issues them across row blocks.
Grid: (P, G).
"""

import cuda.tile as ct

from ._common import int64_variant, sigmoid


def rmsnorm_gated_bwd_fn(
    x,           # (M, G, S)
    z,           # (M, G, S) (ignored unless HAS_Z)
    weight,      # (G, S)
    bias,        # (G, S) (ignored unless HAS_BIAS and HAS_Z and NORM_BEFORE_GATE)
    rstd,        # (G, M) float32
    dout,        # (M, G, S)
    dx,          # (M, G, S) out, x's dtype
    dz,          # (M, G, S) out, z's dtype (ignored unless HAS_Z)
    dw_part,     # (P, G, S) float32 out
    db_part,     # (P, G, S) float32 out (ignored unless HAS_BIAS)
    BLOCK_M: ct.Constant[int],
    BLOCK_G: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_BIAS: ct.Constant[bool],
    NORM_BEFORE_GATE: ct.Constant[bool],
    TMA: ct.Constant[bool],
    APPROX: ct.Constant[bool],
    LATENCY: ct.Constant[int],
):
    LAT = LATENCY if LATENCY else None          # 0: the compiler's choice
    prog, group = ct.bid(0), ct.bid(1)
    nprogs = ct.num_blocks(0)
    size = x.shape[2]
    row_blocks = ct.cdiv(x.shape[0], BLOCK_M)
    zero = ct.PaddingMode.ZERO
    tile3 = (BLOCK_M, 1, BLOCK_G)
    tile2 = (BLOCK_M, BLOCK_G)
    w = ct.load(weight, index=(group, 0), shape=(1, BLOCK_G), padding_mode=zero,
                allow_tma=TMA).astype(ct.float32)
    b = w                           # replaced below when the bias enters y (read only then)
    if HAS_BIAS:
        b = ct.load(bias, index=(group, 0), shape=(1, BLOCK_G), padding_mode=zero,
                    allow_tma=TMA).astype(ct.float32)
    dw_acc = ct.full((1, BLOCK_G), 0.0, dtype=ct.float32)
    db_acc = ct.full((1, BLOCK_G), 0.0, dtype=ct.float32)
    for row_blk in range(prog, row_blocks, nprogs):
        xt = ct.load(x, index=(row_blk, group, 0), shape=tile3, padding_mode=zero,
                     allow_tma=TMA, latency=LAT).reshape(tile2).astype(ct.float32)
        dy = ct.load(dout, index=(row_blk, group, 0), shape=tile3, padding_mode=zero,
                     allow_tma=TMA, latency=LAT).reshape(tile2).astype(ct.float32)
        r = ct.load(rstd, index=(group, row_blk), shape=(1, BLOCK_M), padding_mode=zero,
                    allow_tma=TMA, latency=LAT).reshape((BLOCK_M, 1))
        u = xt
        gate = xt                   # replaced below when HAS_Z (read only then)
        dgate = xt
        if HAS_Z:
            zt = ct.load(z, index=(row_blk, group, 0), shape=tile3, padding_mode=zero,
                         allow_tma=TMA, latency=LAT).reshape(tile2).astype(ct.float32)
            sg = sigmoid(zt, APPROX)
            gate = zt * sg
            dgate = sg * (1.0 + zt * (1.0 - sg))
            if not NORM_BEFORE_GATE:
                u = xt * gate
        xhat = u * r
        if HAS_Z:
            if NORM_BEFORE_GATE:
                y = xhat * w
                if HAS_BIAS:
                    y = y + b
                ct.store(dz, index=(row_blk, group, 0),
                         tile=(dy * y * dgate).reshape(tile3).astype(dz.dtype),
                         allow_tma=TMA)
                dy = dy * gate
        dw_acc = dw_acc + ct.sum(dy * xhat, axis=0, keepdims=True)
        if HAS_BIAS:
            db_acc = db_acc + ct.sum(dy, axis=0, keepdims=True)
        wdy = w * dy
        c = ct.sum(xhat * wdy, axis=1, keepdims=True) / size
        du = (wdy - xhat * c) * r
        if HAS_Z:
            if not NORM_BEFORE_GATE:
                ct.store(dz, index=(row_blk, group, 0),
                         tile=(du * xt * dgate).reshape(tile3).astype(dz.dtype),
                         allow_tma=TMA)
                du = du * gate
        ct.store(dx, index=(row_blk, group, 0), tile=du.reshape(tile3).astype(dx.dtype),
                 allow_tma=TMA)
    ct.store(dw_part, index=(prog, group, 0), tile=dw_acc.reshape((1, 1, BLOCK_G)),
             allow_tma=TMA)
    if HAS_BIAS:
        ct.store(db_part, index=(prog, group, 0), tile=db_acc.reshape((1, 1, BLOCK_G)),
                 allow_tma=TMA)


rmsnorm_gated_bwd = ct.kernel(rmsnorm_gated_bwd_fn)
rmsnorm_gated_bwd_i64 = ct.kernel(int64_variant(
    rmsnorm_gated_bwd_fn,
    ["x", "z", "weight", "bias", "rstd", "dout", "dx", "dz", "dw_part", "db_part"]))
