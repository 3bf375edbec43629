"""Backward kernel 4: decay gradients to dt' and A, then through the dt preprocessing.

Per chunk (Q tokens) x head tile (BLOCK_H heads), in the [batch, head, token] layout:

    da    = sum over the valid slots of da_part (p-tiles x row blocks, fixed order);
            DA_MODE 1: their suffix sum over the chunk; DA_MODE 2: the suffix sum of all
            slots plus the chunk's sum of v_part (see bwd_chunk_dx); DA_MODE 3: the same
            with v_part one number per dx program (the chunk's programs added)
    ddt'  = A * da + sum_{p-tiles} ddt_part                         (stage 5)
    dA    += sum_tokens dt' * da           -> dA_part[b * nc + c, h]
    v     = dt + dt_bias;  w = softplus(v) (SOFTPLUS) or v          (stage 6)
    ddt   = ddt' * [lo <= w <= hi] * (1 if v > 20 else sigmoid(v) with SOFTPLUS)
    ddt_bias partial = sum_tokens ddt      -> dbias_part[b * nc + c, h]

Slots of da_part (DA_MODE 0, 1): slot pt * NBPC + k holds the terms of token block first + k
of the chunk (bwd_chunk_dx); slots of blocks past the last token were never written and are
skipped. DA_MODE 2 reads every slot (n_pt from bwd_chunk_dx, then n_nt from
bwd_chunk_dbc_fused); entries of tokens past L, written or not, are masked out. Tokens past L
are masked to 0 before any sum. w is recomputed with decay_cumsum's formula, so
the clamp mask sees the same values the forward clamped (torch.clamp's convention: the
boundary passes the gradient; the default limit (0, inf) clamps too).

Tiles: da/ddt partials, dt', (BLOCK_H, Q); dt and ddt (Q, BLOCK_H) from/to [batch, token, head].
Grid: (B * num_chunks, cdiv(H, BLOCK_H)).
"""

import cuda.tile as ct

from ._common import int64_variant


def bwd_dt_fn(
    dt,          # (B, L, H) any float dtype, any strides (the raw input)
    A,           # (H,) float32
    dt_bias,     # (H,) float32 (ignored unless HAS_BIAS)
    dt_lo: float,
    dt_hi: float,
    dtp,         # (B, H, Lp) float32 dt' (decay_cumsum)
    da_part,     # (n_pt * NBPC, B, H, Lp) float32 (bwd_chunk_dx); DA_MODE 2: (n_pt + n_nt, ...)
    ddt_part,    # (n_pt, B, H, Lp) float32 (bwd_chunk_dx)
    v_part,      # (n_pt, B, H, Lp) float32 (bwd_chunk_dx, DA_MODE 2); DA_MODE 3: one
                 # number per dx program, (n_pt, B, H, nc * NBPC)
    ddt,         # (B, L, H) out, dt's dtype
    dA_part,     # (B * nc, H) float32 out
    dbias_part,  # (B * nc, H) float32 out (written only if HAS_BIAS)
    Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int],   # bwd_chunk_dx's token block (slots per chunk: Q // BLOCK_Q)
    BLOCK_H: ct.Constant[int],
    HAS_BIAS: ct.Constant[bool],
    SOFTPLUS: ct.Constant[bool],
    DA_MODE: ct.Constant[int],   # 0: da_part holds da contributions per (p-tile, row block);
                                 # 1: per-token terms whose suffix sum is da; 2: the same in
                                 # every slot, plus v_part (summed over the chunk); 3: every
                                 # slot, plus v_part's chunk constants
):
    NBPC = Q // BLOCK_Q
    ZERO = ct.PaddingMode.ZERO
    num_chunks = dtp.shape[2] // Q
    batch, chunk = ct.bid(0) // num_chunks, ct.bid(0) % num_chunks
    head_tile = ct.bid(1)
    seqlen = dt.shape[1]
    n_q = ct.cdiv(seqlen, BLOCK_Q)
    n_pt = ddt_part.shape[0]
    n_blk = ct.minimum(NBPC, n_q - chunk * NBPC)     # row blocks of this chunk that ran

    da = ct.full((BLOCK_H, Q), 0.0, dtype=ct.float32)
    ddt_d = ct.full((BLOCK_H, Q), 0.0, dtype=ct.float32)
    vsum = ct.full((BLOCK_H, Q), 0.0, dtype=ct.float32)
    vconst = ct.full((BLOCK_H, 1), 0.0, dtype=ct.float32)
    if DA_MODE >= 2:
        for sl in range(da_part.shape[0]):
            part = ct.load(da_part, index=(sl, batch, head_tile, chunk),
                           shape=(1, 1, BLOCK_H, Q), padding_mode=ZERO)
            da = da + part.reshape((BLOCK_H, Q))
    ran = (ct.arange(NBPC, dtype=ct.int32) < n_blk)[None, :]
    for pt in range(n_pt):
        if DA_MODE == 2:
            part = ct.load(v_part, index=(pt, batch, head_tile, chunk),
                           shape=(1, 1, BLOCK_H, Q), padding_mode=ZERO)
            vsum = vsum + part.reshape((BLOCK_H, Q))
        elif DA_MODE == 3:
            part = ct.load(v_part, index=(pt, batch, head_tile, chunk),
                           shape=(1, 1, BLOCK_H, NBPC), padding_mode=ZERO)
            vconst = vconst + ct.sum(ct.where(ran, part.reshape((BLOCK_H, NBPC)), 0.0), axis=1,
                                     keepdims=True)
        else:
            for k in range(n_blk):
                part = ct.load(da_part, index=(pt * NBPC + k, batch, head_tile, chunk),
                               shape=(1, 1, BLOCK_H, Q), padding_mode=ZERO)
                da = da + part.reshape((BLOCK_H, Q))
        part = ct.load(ddt_part, index=(pt, batch, head_tile, chunk), shape=(1, 1, BLOCK_H, Q),
                       padding_mode=ZERO)
        ddt_d = ddt_d + part.reshape((BLOCK_H, Q))
    token = chunk * Q + ct.arange(Q, dtype=ct.int32)
    valid = (token < seqlen)[None, :]
    da = ct.where(valid, da, 0.0)
    if DA_MODE != 0:
        da = ct.cumsum(da, axis=1, reverse=True)
    if DA_MODE == 2:
        da = ct.where(valid, da + ct.sum(ct.where(valid, vsum, 0.0), axis=1, keepdims=True),
                      0.0)
    if DA_MODE == 3:
        da = ct.where(valid, da + vconst, 0.0)
    ddt_d = ct.where(valid, ddt_d, 0.0)
    d = ct.load(dtp, index=(batch, head_tile, chunk), shape=(1, BLOCK_H, Q),
                padding_mode=ZERO).reshape((BLOCK_H, Q))
    a = ct.load(A, index=(head_tile,), shape=(BLOCK_H,), padding_mode=ZERO).astype(ct.float32)
    ct.store(dA_part, index=(ct.bid(0), head_tile),
             tile=ct.sum(d * da, axis=1).reshape((1, BLOCK_H)))
    g = (a[:, None] * da + ddt_d).transpose()                       # (Q, BLOCK_H)

    v = ct.load(dt, index=(batch, chunk, head_tile), shape=(1, Q, BLOCK_H),
                padding_mode=ZERO).reshape((Q, BLOCK_H)).astype(ct.float32)
    if HAS_BIAS:
        bias = ct.load(dt_bias, index=(head_tile,), shape=(BLOCK_H,),
                       padding_mode=ZERO).astype(ct.float32)
        v = v + bias[None, :]
    w = v
    if SOFTPLUS:
        # decay_cumsum's softplus, bit for bit
        u = ct.exp(ct.minimum(v, 20.0))
        wp = 1.0 + u
        log1p_u = ct.where(wp == 1.0, u, ct.log(wp) * (u / (wp - 1.0)))
        w = ct.where(v > 20.0, v, log1p_u)
    g = ct.where((w >= dt_lo) & (w <= dt_hi), g, 0.0)
    if SOFTPLUS:
        g = g * ct.where(v > 20.0, 1.0, 1.0 / (1.0 + ct.exp(-v)))
    ct.store(ddt, index=(batch, chunk, head_tile),
             tile=g.reshape((1, Q, BLOCK_H)).astype(ddt.dtype))
    if HAS_BIAS:
        ct.store(dbias_part, index=(ct.bid(0), head_tile),
                 tile=ct.sum(g, axis=0).reshape((1, BLOCK_H)))


bwd_dt = ct.kernel(bwd_dt_fn)
bwd_dt_i64 = ct.kernel(int64_variant(
    bwd_dt_fn, ["dt", "A", "dt_bias", "dtp", "da_part", "ddt_part", "v_part", "ddt", "dA_part",
                "dbias_part"]))
