"""Gated RMSNorm, forward, for a group width S = NCHUNK * CHUNK (chosen for widths that are not
powers of two): one program per (block of BLOCK_M rows, channel group), the group read as
NCHUNK column chunks of CHUNK channels (CHUNK a power of two dividing S), so no lane holds
padding.

The math is `rmsnorm_gated_fwd`'s: per row and group, in float32,

    u      = x * silu(z)               if HAS_Z and not NORM_BEFORE_GATE, else x
    rstd   = 1 / sqrt(sum_j u_j^2 / S + eps)     (the sum over the NCHUNK chunks)
    out    = u * rstd * w (+ b)  (* silu(z) if HAS_Z and NORM_BEFORE_GATE)

The chunks are an unrolled (compile-time) loop: the first pass loads every chunk of x (and z
when the gate comes first) and accumulates the sum of squares, keeping the chunks in
registers (x in its own dtype; u in float32 with the gate first); the second reads z (norm
before gate) and writes each normalised chunk. A padded (BLOCK_M, 1, next_pow2(S)) tile
would spend up to half its lanes and registers on zeros (a quarter at S = 1536 = 3 * 512,
three eighths at 2560 = 5 * 512).

Layout: x, z and out are (M, G, S) views of (M, hidden) rows (any row stride, unit channel
stride), weight and bias (G, S), rstd (G, M). Rows past M load as zeros and are not stored.
APPROX: the sigmoid's approximate form (`_common.sigmoid`; for 16-bit z and x).
TMA=False makes every load and store plain (no TMA producer warps).
Grid: (cdiv(M, BLOCK_M), G), one row block per program; PERSISTENT: (P, G) with P at most
cdiv(M, BLOCK_M), program p walking the row blocks p, p + P, p + 2P, ... (fewer, longer-lived
programs whose loop the compiler can pipeline).
"""

import cuda.tile as ct

from ._common import int64_variant, sigmoid


def _normalize_rows(x, z, weight, bias, out, rstd, eps, row_blk, group,
                    BLOCK_M: ct.Constant[int], CHUNK: ct.Constant[int],
                    NCHUNK: ct.Constant[int], HAS_Z: ct.Constant[bool],
                    HAS_BIAS: ct.Constant[bool], NORM_BEFORE_GATE: ct.Constant[bool],
                    TMA: ct.Constant[bool], APPROX: ct.Constant[bool]):
    """Row block `row_blk` of channel group `group`: out and rstd."""
    zero = ct.PaddingMode.ZERO
    tile3, tile2 = (BLOCK_M, 1, CHUNK), (BLOCK_M, CHUNK)
    # what pass 2 needs of each chunk: x as loaded (in its own dtype, half the registers of
    # float32 for bf16 / fp16) unless the gate comes first, then u = x silu(z) in float32;
    # with the norm before the gate, z is first read in pass 2
    held = ()
    sum_sq = ct.full((BLOCK_M, 1), 0.0, dtype=ct.float32)
    for c in ct.static_iter(range(NCHUNK)):
        xt = ct.load(x, index=(row_blk, group, c), shape=tile3, padding_mode=zero,
                     allow_tma=TMA).reshape(tile2)
        u = xt.astype(ct.float32)
        if HAS_Z and not NORM_BEFORE_GATE:
            zt = ct.load(z, index=(row_blk, group, c), shape=tile3, padding_mode=zero,
                         allow_tma=TMA).reshape(tile2).astype(ct.float32)
            u = u * (zt * sigmoid(zt, APPROX))
            held += (u,)
        else:
            held += (xt,)
        sum_sq = sum_sq + ct.sum(u * u, axis=1, keepdims=True)
    r = 1.0 / ct.sqrt(sum_sq / (NCHUNK * CHUNK) + eps)                   # (BLOCK_M, 1)
    for c in ct.static_iter(range(NCHUNK)):
        w = ct.load(weight, index=(group, c), shape=(1, CHUNK),
                    allow_tma=TMA).astype(ct.float32)
        y = held[c].astype(ct.float32) * r * w
        if HAS_BIAS:
            y = y + ct.load(bias, index=(group, c), shape=(1, CHUNK),
                            allow_tma=TMA).astype(ct.float32)
        if HAS_Z and NORM_BEFORE_GATE:
            zt = ct.load(z, index=(row_blk, group, c), shape=tile3, padding_mode=zero,
                         allow_tma=TMA).reshape(tile2).astype(ct.float32)
            y = y * (zt * sigmoid(zt, APPROX))
        ct.store(out, index=(row_blk, group, c), tile=y.reshape(tile3).astype(out.dtype),
                 allow_tma=TMA)
    ct.store(rstd, index=(group, row_blk), tile=r.reshape((1, BLOCK_M)), allow_tma=TMA)


def rmsnorm_gated_fwd_chunked_fn(
    x,           # (M, G, S) fp16/bf16/fp32, S = NCHUNK * CHUNK
    z,           # (M, G, S) any float dtype (ignored unless HAS_Z)
    weight,      # (G, S)
    bias,        # (G, S) (ignored unless HAS_BIAS)
    out,         # (M, G, S) out, x's dtype
    rstd,        # (G, M) float32 out
    eps: float,
    BLOCK_M: ct.Constant[int],
    CHUNK: ct.Constant[int],
    NCHUNK: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_BIAS: ct.Constant[bool],
    NORM_BEFORE_GATE: ct.Constant[bool],
    TMA: ct.Constant[bool],
    PERSISTENT: ct.Constant[bool],
    APPROX: ct.Constant[bool],
):
    prog, group = ct.bid(0), ct.bid(1)
    if PERSISTENT:
        for row_blk in range(prog, ct.cdiv(x.shape[0], BLOCK_M), ct.num_blocks(0)):
            _normalize_rows(x, z, weight, bias, out, rstd, eps, row_blk, group, BLOCK_M,
                            CHUNK, NCHUNK, HAS_Z, HAS_BIAS, NORM_BEFORE_GATE, TMA, APPROX)
    else:
        _normalize_rows(x, z, weight, bias, out, rstd, eps, prog, group, BLOCK_M, CHUNK,
                        NCHUNK, HAS_Z, HAS_BIAS, NORM_BEFORE_GATE, TMA, APPROX)


rmsnorm_gated_fwd_chunked = ct.kernel(rmsnorm_gated_fwd_chunked_fn)
rmsnorm_gated_fwd_chunked_i64 = ct.kernel(int64_variant(
    rmsnorm_gated_fwd_chunked_fn, ["x", "z", "weight", "bias", "out", "rstd"]))
