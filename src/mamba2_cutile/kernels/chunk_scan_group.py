"""Kernel 3 of the forward pass for several heads of a group at once (`ForwardConfig.scan_heads`
> 1): the plain output tile, C B^T formed once per query block and group.

chunk_scan forms, in every (head, p-tile) tile, the score blocks S = C B^T of its query block
against the keys of its chunk (N-deep MMAs: half of the tile's MMA work at N = 2P) although S
depends only on the group. Here a program owns query block i (BLOCK_Q tokens of chunk c) of
one group and p-tile, forms

    S_i = C_i B_c^T          (BLOCK_Q x Q: the block's queries against every key of the chunk)

once, keeps it (and, with one dstate tile, C_i as an MMA operand) in registers, and walks HEADS
of the group's heads. For each head h:

    Y_h = 2^{G_h,i} * (C_i @ h_{c,h}^T)                             carried-state term
        + (2^{G_h,i - G_h,j} * S_ij * M_ij * dt_h,j) @ X_h,c         intra-chunk term
        + D_h * X_h,i                                                skip
    Y_h <- Y_h * silu(Z_h,i)                                         gate, if z is given

with chunk_scan's causal (and, with seq_idx, same-sequence) mask M, applied to the exponent
before exp2, key block by key block in chunk_scan's order (the blocks after the query block,
read as the query block, add exact zeros on finite input: a fixed trip count), so that the
scan_causal fix-up, which recomputes a chunk with chunk_scan, leaves the rows before a bad
token bit-identical. The products and their order are chunk_scan's own (C B^T with
input-dtype operands and float32 accumulation, the weights rounded to the input dtype or tf32
for the X MMA): in the float64 emulation the outputs equal chunk_scan's exactly. The head loop
also gives the compiler a stream of loads (x, the entry state, the decay row) to overlap with
the MMAs of the head before.

With SEGS > 1 (`ForwardConfig.segment_fold`) the entry state of chunk c in segment s is
formed where it is loaded, l_c + f_c H_s, as chunk_scan forms it (`chunk_scan._entry_state`),
so a segmented state pass needs no launch rewriting every chunk state.

The plain tile only: scan_causal 0, 4 and 5 (4 and 5 run chunk_scan's fix-up launch after it,
over the chunks holding a non-finite input, whose masked keys this tile multiplies in).

sm_90 compiles (bf16, D per head): at the seed problem with 64-token blocks and 8 heads, 128
registers, 24 bytes of stack, 2 CTAs per SM (chunk_scan at the same tiles: 128, none, 2); with
128-token blocks 255 registers and 472 bytes of stack; at chunk 256 176-200 bytes of stack.

Tiles: C_i (BLOCK_Q, BLOCK_N) walking NP in BLOCK_N steps, B_k (BLOCK_Q, BLOCK_N); S_i as
Q / BLOCK_Q float32 (BLOCK_Q, BLOCK_Q) blocks; X_k, Y (BLOCK_Q, BLOCK_P); h (BLOCK_P,
BLOCK_N). Grid: (cdiv(L, BLOCK_Q) * B * G * (H / G / HEADS), cdiv(P, BLOCK_P)), query blocks
fastest.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand
from .chunk_scan import _carried, _entry_state, _gate, _mma_x, _skip


def chunk_scan_group_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N)
    c,           # (B, L, G, N)
    z,           # (B, L, H, P) (ignored unless HAS_Z)
    D,           # (H,) or (H, P) float32 per D_MODE
    dt,          # (B, H, Lp) float32
    cum,         # (B, H, Lp) float32
    seq_start,   # (B, Lp) int32 (decay_cumsum; ignored unless HAS_SEQ)
    states,      # (B, H, C, P, N) entry state of each chunk (SEGS > 1: the segment's local one)
    seg_entry,   # (B, H, SEGS, P, N) float32: the state entering each segment (read if SEGS > 1)
    chunk_factor,  # (B, H, C) float32: f_c of the segmented state pass (read if SEGS > 1)
    out,         # (B, L, H, P)
    Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int],    # query rows a program owns (divides Q)
    BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    HEADS: ct.Constant[int],      # heads one program walks (divides HEADS_PER_GROUP)
    D_MODE: ct.Constant[int],     # 0: no D, 1: per head, 2: per (head, channel)
    HAS_Z: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOAD_LATENCY: ct.Constant[int],
    LOWP: ct.Constant[bool],      # the (C B^T) X MMA in the input dtype instead of tf32
    BLOCK_N: ct.Constant[int],    # dstate tile (divides NP)
    SEGS: ct.Constant[int],       # > 1: segments of the state pass whose entering states are
                                  # added here, l_c + f_c H_s (ForwardConfig.segment_fold)
):
    ZERO = ct.PaddingMode.ZERO
    LAT = None if LOAD_LATENCY == 0 else LOAD_LATENCY
    ngroups = b.shape[2]
    n_q = ct.cdiv(x.shape[1], BLOCK_Q)
    slices = HEADS_PER_GROUP // HEADS
    t = ct.bid(0)
    qblk = t % n_q
    rest = t // n_q
    head0 = (rest % slices) * HEADS
    bg = rest // slices
    batch = bg // ngroups
    group = bg % ngroups
    p_tile = ct.bid(1)
    chunk = qblk // (Q // BLOCK_Q)
    n_tiles = ct.cdiv(c.shape[3], BLOCK_N)
    ONE_TILE = BLOCK_N == NP

    row = qblk * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)      # query tokens
    start_q = row
    if HAS_SEQ:
        start_q = ct.load(seq_start, index=(batch, qblk), shape=(1, BLOCK_Q)).reshape((BLOCK_Q,))

    # S = C_q B_c^T (the query rows against every key of the chunk; the keys after the block
    # are masked below), once for the group's heads, as NBPC (BLOCK_Q, BLOCK_Q) blocks formed
    # as chunk_scan forms them (with one dstate tile, C stays an MMA operand)
    NBPC = Q // BLOCK_Q
    if ONE_TILE:
        c_op = mma_operand(ct.load(c, index=(batch, qblk, group, 0),
                                   shape=(1, BLOCK_Q, 1, BLOCK_N),
                                   padding_mode=ZERO).reshape((BLOCK_Q, BLOCK_N)), x.dtype)
    # key blocks after the query block are read as the query block itself (a block past the
    # last token would lie outside the arrays): their weights are masked to 0 anyway
    s = ()
    for k in ct.static_iter(range(NBPC)):
        kblk = ct.minimum(chunk * NBPC + k, qblk)
        if ONE_TILE:
            b_k = ct.load(b, index=(batch, kblk, group, 0), shape=(1, BLOCK_Q, 1, BLOCK_N),
                          padding_mode=ZERO).reshape((BLOCK_Q, BLOCK_N))
            s_k = ct.mma(c_op, mma_operand(b_k.transpose(), x.dtype),
                         ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32))
        else:
            s_k = ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32)
            for nt in range(n_tiles):
                c_t = ct.load(c, index=(batch, qblk, group, nt), shape=(1, BLOCK_Q, 1, BLOCK_N),
                              padding_mode=ZERO).reshape((BLOCK_Q, BLOCK_N))
                b_k = ct.load(b, index=(batch, kblk, group, nt),
                              shape=(1, BLOCK_Q, 1, BLOCK_N),
                              padding_mode=ZERO).reshape((BLOCK_Q, BLOCK_N))
                s_k = ct.mma(mma_operand(c_t, x.dtype), mma_operand(b_k.transpose(), x.dtype),
                             s_k)
        s += (s_k,)

    for j in range(HEADS):
        head = group * HEADS_PER_GROUP + head0 + j
        g_q = ct.load(cum, index=(batch, head, qblk), shape=(1, 1, BLOCK_Q),
                      latency=LAT).reshape((BLOCK_Q,))
        acc = ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32)
        if ONE_TILE:
            h = _entry_state(states, seg_entry, chunk_factor, batch, head, chunk, p_tile, 0,
                             BLOCK_P, BLOCK_N, SEGS, LAT)
            acc = ct.mma(c_op, mma_operand(h.transpose(), x.dtype), acc)
        else:
            for nt in range(n_tiles):
                c_t = ct.load(c, index=(batch, qblk, group, nt), shape=(1, BLOCK_Q, 1, BLOCK_N),
                              padding_mode=ZERO, latency=LAT).reshape((BLOCK_Q, BLOCK_N))
                h = _entry_state(states, seg_entry, chunk_factor, batch, head, chunk, p_tile, nt,
                                 BLOCK_P, BLOCK_N, SEGS, LAT)
                acc = ct.mma(mma_operand(c_t, x.dtype), mma_operand(h.transpose(), x.dtype),
                             acc)
        acc = _carried(acc, ct.exp2(g_q), start_q, HAS_SEQ)
        # key block by key block, in chunk_scan's order and with its products: the scan_causal
        # fix-up recomputes a bad chunk with chunk_scan, and its rows before the bad token
        # must equal these bit for bit (blocks after the query block add exact zeros on
        # finite input: their weights are masked to 0)
        for k in ct.static_iter(range(NBPC)):
            kblk = ct.minimum(chunk * NBPC + k, qblk)
            g_k = ct.load(cum, index=(batch, head, kblk), shape=(1, 1, BLOCK_Q),
                          latency=LAT).reshape((BLOCK_Q,))
            dt_k = ct.load(dt, index=(batch, head, kblk), shape=(1, 1, BLOCK_Q),
                           latency=LAT).reshape((BLOCK_Q,))
            col = (chunk * NBPC + k) * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
            keep = row[:, None] >= col[None, :]
            if HAS_SEQ:
                keep = keep & (col[None, :] >= start_q[:, None])
            w = s[k] * ct.exp2(ct.where(keep, g_q[:, None] - g_k[None, :], -float("inf")))
            w = w * dt_k[None, :]
            xk = ct.load(x, index=(batch, kblk, head, p_tile), shape=(1, BLOCK_Q, 1, BLOCK_P),
                         padding_mode=ZERO, latency=LAT).reshape((BLOCK_Q, BLOCK_P))
            acc = _mma_x(acc, w, xk, LOWP, x.dtype)
        if D_MODE != 0:
            xq = ct.load(x, index=(batch, qblk, head, p_tile), shape=(1, BLOCK_Q, 1, BLOCK_P),
                         padding_mode=ZERO, latency=LAT).reshape((BLOCK_Q, BLOCK_P)).astype(
                             ct.float32)
            acc = _skip(acc, xq, D, head, p_tile, BLOCK_P, D_MODE)
        if HAS_Z:
            acc = _gate(acc, z, batch, qblk, head, p_tile, BLOCK_Q, BLOCK_P, LAT)
        ct.store(out, index=(batch, qblk, head, p_tile),
                 tile=acc.reshape((1, BLOCK_Q, 1, BLOCK_P)).astype(out.dtype))


chunk_scan_group = ct.kernel(chunk_scan_group_fn)
chunk_scan_group_i64 = ct.kernel(int64_variant(
    chunk_scan_group_fn, ["x", "b", "c", "z", "D", "dt", "cum", "seq_start", "states",
                          "seg_entry", "chunk_factor", "out"]))
