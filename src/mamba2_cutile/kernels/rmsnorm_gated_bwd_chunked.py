"""Gated RMSNorm, backward, for a group width S = NCHUNK * CHUNK (chosen for widths that are
not powers of two): `rmsnorm_gated_bwd`'s math and grid with the group read as NCHUNK column
chunks of CHUNK channels (CHUNK a power of two dividing S), so no lane holds padding.

Program (p, g) walks the row blocks p, p + P, p + 2P, ... of group g (P = the grid's first size)
and writes its partial sums of dweight and dbias to row p of a (P, G, S) buffer, summed over p
afterwards in a fixed order (deterministic). Per row, with gate = silu(z),
gate' = sigmoid(z) (1 + z (1 - sigmoid(z))), in float32:

    u      = x * gate  if HAS_Z and not NORM_BEFORE_GATE, else x
    xhat   = u * rstd                       (rstd saved by the forward)
    if HAS_Z and NORM_BEFORE_GATE:
        dz   = dout * (xhat w (+ b)) * gate',   dy = dout * gate
    else:
        dy   = dout
    dw    += dy * xhat,  db += dy
    c      = sum_j xhat_j w_j dy_j / S      (the sum over the NCHUNK chunks)
    du     = (w dy - xhat c) * rstd
    dx     = du * gate, dz = du * x * gate'   if HAS_Z and not NORM_BEFORE_GATE, else dx = du

Per row block the chunks are two unrolled (compile-time) passes: the first loads every chunk,
writes dz where it needs no c (norm before gate), adds to the chunk's dw / db accumulators and
to the row dot product c, keeping xhat and w dy of each chunk in registers (gate first also
gate and x gate'); the second writes dx (and dz, gate first). The accumulators are NCHUNK
(1, CHUNK) tiles carried by the row-block loop. Weight and bias chunks are re-read per row
block (L1/L2 hits) rather than held.

Layout as `rmsnorm_gated_bwd`'s: x, z, dout, dx, dz (M, G, S); weight, bias (G, S); rstd (G, M);
dw_part, db_part (P, G, S) float32. Rows past M load as zeros (x, dout and rstd alike), so they
add nothing to dw and db. TMA: 1 row loads and stores through TMA; 2 TMA loads, plain stores
(no shared-memory staging, fence and bulk store per tile); 0 every load and store plain (no TMA
producer warps).
APPROX: the sigmoid's approximate form (`_common.sigmoid`; for 16-bit z and x).
REGATE (gate first): pass 2 reloads x and z and recomputes the gate and x gate' instead of
holding them per chunk (two fewer register tiles per chunk, two more L2 reads per element).
LATENCY: the first pass's row loads' latency hint (1-10; 0: none), which sets how far ahead
the compiler issues them across row blocks (REGATE's reloads take none).
Grid: (P, G).
"""

import cuda.tile as ct

from ._common import int64_variant, sigmoid


def rmsnorm_gated_bwd_chunked_fn(
    x,           # (M, G, S), S = NCHUNK * CHUNK
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
    CHUNK: ct.Constant[int],
    NCHUNK: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_BIAS: ct.Constant[bool],
    NORM_BEFORE_GATE: ct.Constant[bool],
    TMA: ct.Constant[int],
    APPROX: ct.Constant[bool],
    REGATE: ct.Constant[bool],
    LATENCY: ct.Constant[int],
):
    LAT = LATENCY if LATENCY else None          # 0: the compiler's choice
    LOAD_TMA, STORE_TMA = TMA > 0, TMA == 1
    prog, group = ct.bid(0), ct.bid(1)
    nprogs = ct.num_blocks(0)
    row_blocks = ct.cdiv(x.shape[0], BLOCK_M)
    zero = ct.PaddingMode.ZERO
    tile3, tile2 = (BLOCK_M, 1, CHUNK), (BLOCK_M, CHUNK)
    dw_acc = ()
    db_acc = ()
    for c in ct.static_iter(range(NCHUNK)):
        dw_acc += (ct.full((1, CHUNK), 0.0, dtype=ct.float32),)
        if HAS_BIAS:
            db_acc += (ct.full((1, CHUNK), 0.0, dtype=ct.float32),)
    for row_blk in range(prog, row_blocks, nprogs):
        r = ct.load(rstd, index=(group, row_blk), shape=(1, BLOCK_M), padding_mode=zero,
                    allow_tma=LOAD_TMA, latency=LAT).reshape((BLOCK_M, 1))
        xhats = ()
        wdys = ()
        gates = ()
        x_dgates = ()
        new_dw = ()
        new_db = ()
        dot = ct.full((BLOCK_M, 1), 0.0, dtype=ct.float32)
        for c in ct.static_iter(range(NCHUNK)):
            xt = ct.load(x, index=(row_blk, group, c), shape=tile3, padding_mode=zero,
                         allow_tma=LOAD_TMA, latency=LAT).reshape(tile2).astype(ct.float32)
            dy = ct.load(dout, index=(row_blk, group, c), shape=tile3, padding_mode=zero,
                         allow_tma=LOAD_TMA, latency=LAT).reshape(tile2).astype(ct.float32)
            w = ct.load(weight, index=(group, c), shape=(1, CHUNK),
                        allow_tma=LOAD_TMA).astype(ct.float32)
            u = xt
            gate = xt                   # replaced below when HAS_Z (read only then)
            dgate = xt
            if HAS_Z:
                zt = ct.load(z, index=(row_blk, group, c), shape=tile3, padding_mode=zero,
                             allow_tma=LOAD_TMA, latency=LAT).reshape(tile2).astype(ct.float32)
                sg = sigmoid(zt, APPROX)
                gate = zt * sg
                dgate = sg * (1.0 + zt * (1.0 - sg))
                if not NORM_BEFORE_GATE:
                    u = xt * gate
                    if not REGATE:
                        gates += (gate,)
                        x_dgates += (xt * dgate,)
            xhat = u * r
            if HAS_Z:
                if NORM_BEFORE_GATE:
                    y = xhat * w
                    if HAS_BIAS:
                        y = y + ct.load(bias, index=(group, c), shape=(1, CHUNK),
                                        allow_tma=LOAD_TMA).astype(ct.float32)
                    ct.store(dz, index=(row_blk, group, c),
                             tile=(dy * y * dgate).reshape(tile3).astype(dz.dtype),
                             allow_tma=STORE_TMA)
                    dy = dy * gate
            new_dw += (dw_acc[c] + ct.sum(dy * xhat, axis=0, keepdims=True),)
            if HAS_BIAS:
                new_db += (db_acc[c] + ct.sum(dy, axis=0, keepdims=True),)
            wdy = w * dy
            dot = dot + ct.sum(xhat * wdy, axis=1, keepdims=True)
            xhats += (xhat,)
            wdys += (wdy,)
        dw_acc = new_dw
        db_acc = new_db
        mean_dot = dot / (NCHUNK * CHUNK)
        for c in ct.static_iter(range(NCHUNK)):
            du = (wdys[c] - xhats[c] * mean_dot) * r
            if HAS_Z:
                if not NORM_BEFORE_GATE:
                    if REGATE:
                        # x and z again (L2 hits: the row block was read in pass 1) in place
                        # of two held tiles per chunk
                        xt = ct.load(x, index=(row_blk, group, c), shape=tile3,
                                     padding_mode=zero,
                                     allow_tma=LOAD_TMA).reshape(tile2).astype(ct.float32)
                        zt = ct.load(z, index=(row_blk, group, c), shape=tile3,
                                     padding_mode=zero,
                                     allow_tma=LOAD_TMA).reshape(tile2).astype(ct.float32)
                        sg = sigmoid(zt, APPROX)
                        gate = zt * sg
                        x_dgate = xt * (sg * (1.0 + zt * (1.0 - sg)))
                    else:
                        gate = gates[c]
                        x_dgate = x_dgates[c]
                    ct.store(dz, index=(row_blk, group, c),
                             tile=(du * x_dgate).reshape(tile3).astype(dz.dtype),
                             allow_tma=STORE_TMA)
                    du = du * gate
            ct.store(dx, index=(row_blk, group, c), tile=du.reshape(tile3).astype(dx.dtype),
                     allow_tma=STORE_TMA)
    for c in ct.static_iter(range(NCHUNK)):
        ct.store(dw_part, index=(prog, group, c), tile=dw_acc[c].reshape((1, 1, CHUNK)),
                 allow_tma=STORE_TMA)
        if HAS_BIAS:
            ct.store(db_part, index=(prog, group, c), tile=db_acc[c].reshape((1, 1, CHUNK)),
                     allow_tma=STORE_TMA)


rmsnorm_gated_bwd_chunked = ct.kernel(rmsnorm_gated_bwd_chunked_fn)
rmsnorm_gated_bwd_chunked_i64 = ct.kernel(int64_variant(
    rmsnorm_gated_bwd_chunked_fn,
    ["x", "z", "weight", "bias", "rstd", "dout", "dx", "dz", "dw_part", "db_part"]))
