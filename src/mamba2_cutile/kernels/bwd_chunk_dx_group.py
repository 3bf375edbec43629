"""Backward kernel 2 for several heads of a group at once (`BackwardConfig.dx_heads` > 1):
dx and the partials of dD, ddt and da of bwd_chunk_dx's DA_MODE 3 without z.

bwd_chunk_dx forms, in every (head, p-tile) program, S^T = B_t C_q^T for the query blocks q
of its chunk, although S depends only on the group; its programs are short (one token block
of one head and p-tile), so latency, not the tensor cores or memory, sets their time. Here a
program owns token block t (BLOCK_Q tokens of chunk c) of one group and p-tile, forms

    S_t = B_t C_c^T          (BLOCK_Q x Q: the block's keys against every query of the chunk)

once, and walks HEADS of the group's heads. For each head, with bwd_chunk_dx's notation
(bwd_common; state_w, exit_w, carry_w, and L the masked intra-chunk decay):

    Ch  = C_t h_c^T,  Bds = B_t dS_c^T                              (BLOCK_Q x BLOCK_P)
    dXs = exit_w Bds + (S_t o L^T) dY_c      (dY_c: the chunk's dout rows; L^T zero on
                                              queries before the key and other sequences)
    dx  = dt' dXs + D dY_t,   ddt_direct = rowsum(X_t o dXs),   dD partial = colsum(dY_t o X_t)
    da terms: dGs - V of its rows added to slot p_tile (bwd_chunk_dcb wrote the W terms to
              the slots < W_SLOTS), sum_block V (+ carry_w <dS_c, h_c>_F on the chunk's first
              block) into v_part

which is bwd_chunk_dx's DA_MODE 3 program for that head, the query blocks of the chunk taken
as one (Q-wide) MMA: the columns of queries before the block are masked to 0. The products
are bwd_chunk_dx's (the same operand roundings, fp32 accumulation), so gradients move only
by the order of the sums. Without z only: with z, y (for dz) needs C_t B_k^T for the key
blocks k <= t as well. Under NaN/Inf the masked columns are zeros multiplied in, as in
bwd_chunk_dx's diagonal block, but over the whole chunk: a non-finite dout at token q
reaches dx of the chunk's rows after q (bwd_chunk_dx: of its 64-token block's), which do not
depend on it, a later packed sequence's rows among them.

sm_90 compiles (bf16, internal chunk 128, 64-token blocks, 32-channel p-tiles): 254
registers, no stack, 128 threads, 2 CTAs per SM at the seed problem (8 heads), 2.7B (16 of 80),
7B-class (16 of a group's 16) and headdim 128 (8), against bwd_chunk_dx's 128 registers and
256 threads; at dstate 256 whole-N tiles spill 448 bytes per thread, 128-wide dstate tiles
(BLOCK_N) under occupancy 2 none (244 registers, 128 threads, 2 CTAs per SM).

Tiles: B_t, C_t (BLOCK_Q, BLOCK_N), C_c (Q, BLOCK_N), walking NP in BLOCK_N steps (one step:
B_t and C_t held across the heads); S_t (BLOCK_Q, Q) float32, x, dout (BLOCK_Q, BLOCK_P),
dY_c (Q, BLOCK_P), h_c, dS_c (BLOCK_P, BLOCK_N). Grid: (cdiv(L, BLOCK_Q) * B * G *
(H / G / HEADS), cdiv(P, BLOCK_P)), token blocks fastest.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand
from .bwd_common import (
    block_decay,
    block_seq,
    carry_weight,
    chunk_last_decay,
    exit_weight,
    load_rows,
    load_state,
    seq_bounds,
    state_weight,
    wop,
)


def bwd_chunk_dx_group_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N)
    c,           # (B, L, G, N)
    dout,        # (B, L, H, P)
    D,           # (H,) or (H, P) float32 per D_MODE
    dt,          # (B, H, Lp) float32 dt'
    cum,         # (B, H, Lp) float32 G2
    seq_idx,     # (B, L) int32 (ignored unless HAS_SEQ)
    states,      # (B, H, C, P, N) entry states h_c
    dstates,     # (B, H, C, P, N) exit-state gradients dS_c
    dx,          # (B, L, H, P) out
    da_part,     # (max(W_SLOTS, n_pt), B, H, Lp) float32: slots < W_SLOTS read and written
    ddt_part,    # (n_pt, B, H, Lp) float32 out: ddt_direct per p-tile
    dD_part,     # float32 out (only if D_MODE): (cdiv(L, BQ), B, H, P); D_MODE 1 its sum over
                 # the p-tile, (cdiv(L, BQ), B, H, n_pt)
    v_part,      # (n_pt, B, H, nc * Q // BQ) float32 out: sum_block V (+ carry, first block)
    Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    HEADS: ct.Constant[int],      # heads one program walks (divides HEADS_PER_GROUP)
    D_MODE: ct.Constant[int],     # 0: no D, 1: per head, 2: per (head, channel)
    HAS_SEQ: ct.Constant[bool],
    LOWP: ct.Constant[bool],
    W_SLOTS: ct.Constant[int],    # the slots bwd_chunk_dcb wrote (Q // its BLOCK_Q)
    LAT: ct.Constant[int],        # load latency hint in the head loop (0: none)
    BLOCK_N: ct.Constant[int],    # dstate tile of the N-deep products (divides NP)
):
    ZERO = ct.PaddingMode.ZERO
    NBPC = Q // BLOCK_Q                  # token blocks per chunk
    seqlen = x.shape[1]
    ngroups = b.shape[2]
    n_q = ct.cdiv(seqlen, BLOCK_Q)
    slices = HEADS_PER_GROUP // HEADS
    t = ct.bid(0) % n_q
    rest = ct.bid(0) // n_q
    head0 = (rest % slices) * HEADS
    bg = rest // slices
    batch = bg // ngroups
    group = bg % ngroups
    p_tile = ct.bid(1)
    chunk = t // NBPC
    first = chunk * NBPC
    mm = x.dtype

    tok_t = t * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
    tok_c = chunk * Q + ct.arange(Q, dtype=ct.int32)
    s_t = block_seq(seq_idx, batch, t, BLOCK_Q, HAS_SEQ)
    s_c = block_seq(seq_idx, batch, chunk, Q, HAS_SEQ)
    before, last = seq_bounds(seq_idx, batch, chunk, seqlen, Q, HAS_SEQ)
    # L^T's support: query (column) at or after the key (row), in the same sequence
    keep = tok_c[None, :] >= tok_t[:, None]
    if HAS_SEQ:
        keep = keep & (s_c[None, :] == s_t[:, None])

    # per-program conditions as tiles, selected inside the head loop (a branch there on a
    # program id compiled for minutes)
    on_first = (ct.full((1,), 0, dtype=ct.int32) + t) == first      # carry once per chunk
    w_slot = (ct.full((1,), 0, dtype=ct.int32) + p_tile) < W_SLOTS  # a slot dcb wrote

    # with one dstate tile B_t and C_t stay MMA operands across the heads; with several
    # (dstate 256: the whole-N tiles spill) each product walks the n-tiles, reloading them
    ONE_TILE = BLOCK_N == NP
    # cdiv(N, BLOCK_N), not NP // BLOCK_N: a tile wholly past dstate would be an out-of-bounds
    # load (dstate 20 in 8-wide tiles: three, not the padded 32's four)
    n_tiles = ct.cdiv(b.shape[3], BLOCK_N)
    if ONE_TILE:
        ct_t = mma_operand(load_rows(c, batch, t, group, 0, BLOCK_Q, NP), mm)
        bt = mma_operand(load_rows(b, batch, t, group, 0, BLOCK_Q, NP), mm)
        cc = mma_operand(load_rows(c, batch, chunk, group, 0, Q, NP), mm)
        st = ct.mma(bt, cc.transpose(), ct.full((BLOCK_Q, Q), 0.0, dtype=ct.float32))
    else:
        st = ct.full((BLOCK_Q, Q), 0.0, dtype=ct.float32)
        for nt in range(n_tiles):
            b_n = mma_operand(load_rows(b, batch, t, group, nt, BLOCK_Q, BLOCK_N), mm)
            c_n = mma_operand(load_rows(c, batch, chunk, group, nt, Q, BLOCK_N), mm)
            st = ct.mma(b_n, c_n.transpose(), st)

    for j in range(HEADS):
        head = group * HEADS_PER_GROUP + head0 + j
        g_t = block_decay(cum, batch, head, t, BLOCK_Q, LAT)
        dt_t = block_decay(dt, batch, head, t, BLOCK_Q, LAT)
        g_c = block_decay(cum, batch, head, chunk, Q, LAT)
        g_last = chunk_last_decay(cum, batch, head, chunk, Q)
        state_w = state_weight(g_t, s_t, before, HAS_SEQ)
        exit_w = exit_weight(g_t, g_last, s_t, last, HAS_SEQ)

        xt = load_rows(x, batch, t, head, p_tile, BLOCK_Q, BLOCK_P, LAT).astype(ct.float32)
        dy = load_rows(dout, batch, t, head, p_tile, BLOCK_Q, BLOCK_P, LAT).astype(ct.float32)
        zero = ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32)
        if ONE_TILE:
            h = load_state(states, batch, head, chunk, p_tile, 0, BLOCK_P, NP, LAT)
            ds = load_state(dstates, batch, head, chunk, p_tile, 0, BLOCK_P, NP, LAT)
            dsh = ct.sum(ct.sum(ds * h, axis=1), axis=0, keepdims=True)
            ch = ct.mma(ct_t, mma_operand(h.transpose(), mm), zero)
            bds = ct.mma(bt, mma_operand(ds.transpose(), mm), zero)
        else:
            dsh = ct.full((1,), 0.0, dtype=ct.float32)
            ch = zero
            bds = zero
            for nt in range(n_tiles):
                h = load_state(states, batch, head, chunk, p_tile, nt, BLOCK_P, BLOCK_N, LAT)
                ds = load_state(dstates, batch, head, chunk, p_tile, nt, BLOCK_P, BLOCK_N, LAT)
                dsh = dsh + ct.sum(ct.sum(ds * h, axis=1), axis=0, keepdims=True)
                c_n = mma_operand(load_rows(c, batch, t, group, nt, BLOCK_Q, BLOCK_N, LAT), mm)
                b_n = mma_operand(load_rows(b, batch, t, group, nt, BLOCK_Q, BLOCK_N, LAT), mm)
                ch = ct.mma(c_n, mma_operand(h.transpose(), mm), ch)
                bds = ct.mma(b_n, mma_operand(ds.transpose(), mm), bds)
        carry = ct.where(on_first, carry_weight(g_last, before, last, HAS_SEQ) * dsh, 0.0)
        dgs = state_w * ct.sum(dy * ch, axis=1)                 # (BQ,) state term of dG
        v = exit_w * dt_t * ct.sum(xt * bds, axis=1)            # (BQ,) exit term V

        # da: slot p_tile of block t (bwd_chunk_dcb wrote its W terms there, p_tile < W_SLOTS)
        w_terms = ct.load(da_part, index=(p_tile, batch, head, t),
                          shape=(1, 1, 1, BLOCK_Q)).reshape((BLOCK_Q,))
        u = dgs - v + ct.where(w_slot, w_terms, 0.0)
        ct.store(da_part, index=(p_tile, batch, head, t), tile=u.reshape((1, 1, 1, BLOCK_Q)))
        ct.store(v_part, index=(p_tile, batch, head, t),
                 tile=(ct.sum(v, axis=0, keepdims=True) + carry).reshape((1, 1, 1, 1)))

        # dXs = exit_w Bds + (S_t o L^T) dY_c
        lt = ct.exp2(ct.where(keep, g_c[None, :] - g_t[:, None], -float("inf")))
        dyc = load_rows(dout, batch, chunk, head, p_tile, Q, BLOCK_P, LAT)
        acc = ct.mma(wop(st * lt, mm, LOWP), wop(dyc.astype(ct.float32), mm, LOWP),
                     bds * exit_w[:, None])

        dxt = acc * dt_t[:, None]
        if D_MODE == 1:
            dxt = dxt + ct.load(D, index=(head,), shape=(1,)).reshape((1, 1)) * dy
            ct.store(dD_part, index=(t, batch, head, p_tile),
                     tile=ct.sum(ct.sum(dy * xt, axis=1), axis=0, keepdims=True).reshape(
                         (1, 1, 1, 1)))
        if D_MODE == 2:
            dxt = dxt + ct.load(D, index=(head, p_tile), shape=(1, BLOCK_P),
                                padding_mode=ZERO) * dy
            ct.store(dD_part, index=(t, batch, head, p_tile),
                     tile=ct.sum(dy * xt, axis=0).reshape((1, 1, 1, BLOCK_P)))
        ct.store(dx, index=(batch, t, head, p_tile),
                 tile=dxt.reshape((1, BLOCK_Q, 1, BLOCK_P)).astype(dx.dtype))
        ct.store(ddt_part, index=(p_tile, batch, head, t),
                 tile=ct.sum(xt * acc, axis=1).reshape((1, 1, 1, BLOCK_Q)))


bwd_chunk_dx_group = ct.kernel(bwd_chunk_dx_group_fn)
bwd_chunk_dx_group_i64 = ct.kernel(int64_variant(
    bwd_chunk_dx_group_fn, ["x", "b", "c", "dout", "D", "dt", "cum", "seq_idx", "states",
                            "dstates", "dx", "da_part", "ddt_part", "dD_part", "v_part"]))
