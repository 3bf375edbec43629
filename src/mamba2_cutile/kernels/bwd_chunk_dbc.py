"""Backward kernel 3 (parallel over chunks): dB and dC, summed over the heads of each group.

One program = token block t (BLOCK_Q tokens of chunk c) x one n-tile (BLOCK_N) of one group,
and grid axis 2 picks the output (0: dC, 1: dB). The heads of the group are summed inside the
program in a fixed order (deterministic; no atomics, no per-head buffer). With dY = dout *
silu(z), L the masked intra-chunk decay, h_c / dS_c the chunk's entry state / exit gradient
(chunked_backward.stage4_dC / stage4_dB):

  dC_t = sum_heads [ (state_w dY_t) @ h_c  +  sum_{k<=t} ((dY_t X_k^T) o L_tk o dt'_k) @ B_k ]
  dB_t = sum_heads [ (exit_w dt' X_t) @ dS_c + sum_{q>=t} ((dY_q X_t^T) o L_qt o dt'_t)^T @ C_q ]

dY X^T reduces over all of P: a loop over p-tiles of BLOCK_P accumulates it (BQ x BQ fp32).
Tiles: x, dout, z (BQ, BP); B, C (BQ, BN); h_c, dS_c (BP, BN); accumulator (BQ, BN) fp32.
Grid: (cdiv(L, BQ) * B * G, cdiv(N, BN), 2), token blocks fastest.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand
from .bwd_common import (
    block_decay,
    block_seq,
    chunk_last_decay,
    dy_op,
    exit_weight,
    intra_decay,
    load_dy,
    load_rows,
    load_state,
    seq_bounds,
    state_weight,
    wop,
)


def _dyx(x, dout, z, batch, row_blk, col_blk, head, n_pt, mm, BLOCK_Q: ct.Constant[int],
         BLOCK_P: ct.Constant[int], HAS_Z: ct.Constant[bool], LOWP: ct.Constant[bool]):
    """(BQ, BQ) dY_row X_col^T over all of P (loop over p-tiles)."""
    acc = ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32)
    for pt in range(n_pt):
        dy = load_dy(dout, z, batch, row_blk, head, pt, BLOCK_Q, BLOCK_P, HAS_Z)
        xc = load_rows(x, batch, col_blk, head, pt, BLOCK_Q, BLOCK_P)
        acc = ct.mma(dy_op(dy, mm, LOWP, HAS_Z), dy_op(xc.transpose(), mm, LOWP, HAS_Z), acc)
    return acc


def bwd_chunk_dbc_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N)
    c,           # (B, L, G, N)
    z,           # (B, L, H, P) (ignored unless HAS_Z)
    dout,        # (B, L, H, P)
    dt,          # (B, H, Lp) float32 dt'
    cum,         # (B, H, Lp) float32 G2
    seq_idx,     # (B, L) int32 (ignored unless HAS_SEQ)
    states,      # (B, H, C, P, N) entry states h_c
    dstates,     # (B, H, C, P, N) exit-state gradients dS_c
    db,          # (B, L, G, N) out
    dc,          # (B, L, G, N) out
    Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    BLOCK_N: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOWP: ct.Constant[bool],
):
    NBPC = Q // BLOCK_Q
    seqlen = x.shape[1]
    ngroups = b.shape[2]
    n_q = ct.cdiv(seqlen, BLOCK_Q)
    n_pt = ct.cdiv(x.shape[3], BLOCK_P)
    t = ct.bid(0) % n_q
    bg = ct.bid(0) // n_q
    n_tile = ct.bid(1)
    batch = bg // ngroups
    group = bg % ngroups
    chunk = t // NBPC
    first = chunk * NBPC
    end = ct.minimum(first + NBPC, n_q)
    mm = x.dtype

    tok_t = t * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
    s_t = block_seq(seq_idx, batch, t, BLOCK_Q, HAS_SEQ)
    before, last = seq_bounds(seq_idx, batch, chunk, seqlen, Q, HAS_SEQ)
    acc = ct.full((BLOCK_Q, BLOCK_N), 0.0, dtype=ct.float32)

    if ct.bid(2) == 0:
        # ---- dC: carried-state term, then key blocks k <= t
        for hh in range(HEADS_PER_GROUP):
            head = group * HEADS_PER_GROUP + hh
            g_t = block_decay(cum, batch, head, t, BLOCK_Q)
            state_w = state_weight(g_t, s_t, before, HAS_SEQ)
            for pt in range(n_pt):
                dy = load_dy(dout, z, batch, t, head, pt, BLOCK_Q, BLOCK_P, HAS_Z)
                h = load_state(states, batch, head, chunk, pt, n_tile, BLOCK_P, BLOCK_N)
                acc = ct.mma(mma_operand(dy * state_w[:, None], mm), mma_operand(h, mm), acc)
        for k in range(first, t + 1):
            tok_k = k * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
            s_k = block_seq(seq_idx, batch, k, BLOCK_Q, HAS_SEQ)
            bk = wop(load_rows(b, batch, k, group, n_tile, BLOCK_Q, BLOCK_N), mm, LOWP)
            for hh in range(HEADS_PER_GROUP):
                head = group * HEADS_PER_GROUP + hh
                g_t = block_decay(cum, batch, head, t, BLOCK_Q)
                g_k = block_decay(cum, batch, head, k, BLOCK_Q)
                dt_k = block_decay(dt, batch, head, k, BLOCK_Q)
                dyx = _dyx(x, dout, z, batch, t, k, head, n_pt, mm, BLOCK_Q, BLOCK_P, HAS_Z,
                           LOWP)
                pm = dyx * intra_decay(g_t, g_k, tok_t, tok_k, s_t, s_k, HAS_SEQ) * dt_k[None, :]
                acc = ct.mma(wop(pm, mm, LOWP), bk, acc)
        ct.store(dc, index=(batch, t, group, n_tile),
                 tile=acc.reshape((1, BLOCK_Q, 1, BLOCK_N)).astype(dc.dtype))
    else:
        # ---- dB: exit-state term, then query blocks q >= t
        for hh in range(HEADS_PER_GROUP):
            head = group * HEADS_PER_GROUP + hh
            g_t = block_decay(cum, batch, head, t, BLOCK_Q)
            dt_t = block_decay(dt, batch, head, t, BLOCK_Q)
            g_last = chunk_last_decay(cum, batch, head, chunk, Q)
            w = exit_weight(g_t, g_last, s_t, last, HAS_SEQ) * dt_t
            for pt in range(n_pt):
                xt = load_rows(x, batch, t, head, pt, BLOCK_Q, BLOCK_P).astype(ct.float32)
                ds = load_state(dstates, batch, head, chunk, pt, n_tile, BLOCK_P, BLOCK_N)
                acc = ct.mma(mma_operand(xt * w[:, None], mm), mma_operand(ds, mm), acc)
        for q in range(t, end):
            tok_q = q * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
            s_q = block_seq(seq_idx, batch, q, BLOCK_Q, HAS_SEQ)
            cq = wop(load_rows(c, batch, q, group, n_tile, BLOCK_Q, BLOCK_N), mm, LOWP)
            for hh in range(HEADS_PER_GROUP):
                head = group * HEADS_PER_GROUP + hh
                g_t = block_decay(cum, batch, head, t, BLOCK_Q)
                dt_t = block_decay(dt, batch, head, t, BLOCK_Q)
                g_q = block_decay(cum, batch, head, q, BLOCK_Q)
                dyx = _dyx(x, dout, z, batch, q, t, head, n_pt, mm, BLOCK_Q, BLOCK_P, HAS_Z,
                           LOWP)
                pm = dyx * intra_decay(g_q, g_t, tok_q, tok_t, s_q, s_t, HAS_SEQ) * dt_t[None, :]
                acc = ct.mma(wop(pm.transpose(), mm, LOWP), cq, acc)
        ct.store(db, index=(batch, t, group, n_tile),
                 tile=acc.reshape((1, BLOCK_Q, 1, BLOCK_N)).astype(db.dtype))


def bwd_chunk_dbc_fused_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N)
    c,           # (B, L, G, N)
    z,           # (B, L, H, P) (ignored unless HAS_Z)
    dout,        # (B, L, H, P)
    dt,          # (B, H, Lp) float32 dt'
    cum,         # (B, H, Lp) float32 G2
    seq_idx,     # (B, L) int32 (ignored unless HAS_SEQ)
    states,      # (B, H, C, P, N) entry states h_c
    dstates,     # (B, H, C, P, N) exit-state gradients dS_c
    db,          # (B, L, G, N) out; HEAD_SPLIT > 1: (HEAD_SPLIT, B, L, G, N) fp32 partials
    dc,          # the same for dC
    da_part,     # (n_pt + n_nt, B, H, Lp) float32 out (only with DA_W): slots n_pt + n_tile
    Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    BLOCK_N: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOWP: ct.Constant[bool],
    DA_W: ct.Constant[bool],
    LAT: ct.Constant[int],        # load latency hint in the head loop (0: none)
    HEAD_SPLIT: ct.Constant[int],  # programs per group on grid axis 2 (divides HEADS_PER_GROUP)
):
    """dB and dC of one whole chunk in one program (the same sums as bwd_chunk_dbc_fn).

    Both intra-chunk terms use one Q x Q matrix per head, M = (dY X^T) o L o dt'_col:
    dC += M @ B and dB += M^T @ C, so M (one dY X^T MMA and one exp2 per entry) is formed once
    per head instead of once per output and token block. One program = chunk c x one n-tile of
    one group; p-tiles are looped for dY X^T and the state terms.
    Grid: (nc * B * G, cdiv(N, BN), HEAD_SPLIT).

    HEAD_SPLIT = S > 1 (a grid of fewer programs than SMs: short sequences): program s of axis
    2 walks heads [s HPG / S, (s + 1) HPG / S) of the group and stores its fp32 partial sums
    at db[s], dc[s]; a `sum_partials` launch adds them in a fixed order (deterministic).

    With DA_W it also writes the W part of the decay gradient (bwd_chunk_dx's DA_MODE 2): with
    S_n = C_n B_n^T (this n-tile's share of C B^T, shared by the group's heads), W = M o S_n and
    per token r - c = rowsum(W) - colsum(W), into da_part slot n_pt + n_tile.
    """
    seqlen = x.shape[1]
    ngroups = b.shape[2]
    nc = ct.cdiv(seqlen, Q)
    n_pt = ct.cdiv(x.shape[3], BLOCK_P)
    chunk = ct.bid(0) % nc
    bg = ct.bid(0) // nc
    n_tile = ct.bid(1)
    batch = bg // ngroups
    group = bg % ngroups
    mm = x.dtype

    tok = chunk * Q + ct.arange(Q, dtype=ct.int32)
    s = block_seq(seq_idx, batch, chunk, Q, HAS_SEQ)
    before, last = seq_bounds(seq_idx, batch, chunk, seqlen, Q, HAS_SEQ)
    bn = wop(load_rows(b, batch, chunk, group, n_tile, Q, BLOCK_N), mm, LOWP)
    cn = wop(load_rows(c, batch, chunk, group, n_tile, Q, BLOCK_N), mm, LOWP)
    acc_c = ct.full((Q, BLOCK_N), 0.0, dtype=ct.float32)
    acc_b = ct.full((Q, BLOCK_N), 0.0, dtype=ct.float32)
    if DA_W:
        s_n = ct.mma(cn, bn.transpose(), ct.full((Q, Q), 0.0, dtype=ct.float32))
        slot = da_part.shape[0] - ct.num_blocks(1) + n_tile
    head0 = group * HEADS_PER_GROUP + ct.bid(2) * (HEADS_PER_GROUP // HEAD_SPLIT)
    for hh in range(HEADS_PER_GROUP // HEAD_SPLIT):
        head = head0 + hh
        g = block_decay(cum, batch, head, chunk, Q, LAT)
        dtv = block_decay(dt, batch, head, chunk, Q, LAT)
        g_last = chunk_last_decay(cum, batch, head, chunk, Q)
        state_w = state_weight(g, s, before, HAS_SEQ)
        x_w = exit_weight(g, g_last, s, last, HAS_SEQ) * dtv
        dyx = ct.full((Q, Q), 0.0, dtype=ct.float32)
        for pt in range(n_pt):
            dy = load_dy(dout, z, batch, chunk, head, pt, Q, BLOCK_P, HAS_Z, LAT)
            xt = load_rows(x, batch, chunk, head, pt, Q, BLOCK_P, LAT)
            h = load_state(states, batch, head, chunk, pt, n_tile, BLOCK_P, BLOCK_N, LAT)
            ds = load_state(dstates, batch, head, chunk, pt, n_tile, BLOCK_P, BLOCK_N, LAT)
            acc_c = ct.mma(mma_operand(dy * state_w[:, None], mm), mma_operand(h, mm), acc_c)
            acc_b = ct.mma(mma_operand(xt.astype(ct.float32) * x_w[:, None], mm),
                           mma_operand(ds, mm), acc_b)
            dyx = ct.mma(dy_op(dy, mm, LOWP, HAS_Z), dy_op(xt.transpose(), mm, LOWP, HAS_Z), dyx)
        m = dyx * intra_decay(g, g, tok, tok, s, s, HAS_SEQ) * dtv[None, :]
        if DA_W:
            w = m * s_n
            ct.store(da_part, index=(slot, batch, head, chunk),
                     tile=(ct.sum(w, axis=1) - ct.sum(w, axis=0)).reshape((1, 1, 1, Q)))
        acc_c = ct.mma(wop(m, mm, LOWP), bn, acc_c)
        acc_b = ct.mma(wop(m.transpose(), mm, LOWP), cn, acc_b)
    if HEAD_SPLIT == 1:
        ct.store(dc, index=(batch, chunk, group, n_tile),
                 tile=acc_c.reshape((1, Q, 1, BLOCK_N)).astype(dc.dtype))
        ct.store(db, index=(batch, chunk, group, n_tile),
                 tile=acc_b.reshape((1, Q, 1, BLOCK_N)).astype(db.dtype))
    else:
        ct.store(dc, index=(ct.bid(2), batch, chunk, group, n_tile),
                 tile=acc_c.reshape((1, 1, Q, 1, BLOCK_N)))
        ct.store(db, index=(ct.bid(2), batch, chunk, group, n_tile),
                 tile=acc_b.reshape((1, 1, Q, 1, BLOCK_N)))


bwd_chunk_dbc = ct.kernel(bwd_chunk_dbc_fn)
bwd_chunk_dbc_i64 = ct.kernel(int64_variant(
    bwd_chunk_dbc_fn, ["x", "b", "c", "z", "dout", "dt", "cum", "seq_idx", "states", "dstates",
                       "db", "dc"]))
bwd_chunk_dbc_fused = ct.kernel(bwd_chunk_dbc_fused_fn)
bwd_chunk_dbc_fused_i64 = ct.kernel(int64_variant(
    bwd_chunk_dbc_fused_fn, ["x", "b", "c", "z", "dout", "dt", "cum", "seq_idx", "states",
                             "dstates", "db", "dc", "da_part"]))
