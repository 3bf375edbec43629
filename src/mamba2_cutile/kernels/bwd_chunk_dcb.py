"""Backward kernels 3a and 3b (parallel over chunks): dB and dC through the gradient of the
group's C B^T.

Within a chunk, with S = C B^T (one Q x Q matrix per group, shared by its heads) and L_h the
masked decay of head h (bwd_common), the intra-chunk output is y_h = (L_h o S o dt'_h) X_h, so

  dS = sum_{h in group} (dY_h X_h^T) o L_h o dt'_h,col                        [3a: bwd_chunk_dcb]
  dC = sum_h (state_w_h dY_h) h_c,h  +  dS B
  dB = sum_h (exit_w_h dt'_h X_h) dS_c,h  +  dS^T C                        [3b: bwd_chunk_dbc_group]

(h_c the chunk's entry state, dS_c its exit-state gradient, per head; the same sums as
bwd_chunk_dbc_fused, regrouped). The fused launch forms each head's M = (dY X^T) o L o dt' and
multiplies it by B and by C per head and n-tile: 2 Q x Q x N products per head. Here the head
loop of 3a only forms and adds M, once per head, and 3b multiplies the group's sum by B and C
once per group; what 3b loops over heads is the (Q x P) x (P x N) state terms. The price is dS
through HBM, (B, G, Lp, Q) fp32: Q / (H / G * P * 2) of the bytes of x and dout (1/80 at 80
heads of 64, chunk 128).

3a: one program = a (BLOCK_Q x BLOCK_Q) block (i, j) of one chunk's dS and one group, the
group's heads walked in a fixed order (deterministic). Blocks above the diagonal and blocks of
rows past the sequence are stored as zeros, so every element of dS that 3b reads is written
and finite (3b multiplies the columns past the sequence by zero-padded rows of B and C).
With DA_W (da_mode 3) it also writes the decay gradient's W terms of each head, W = M o S
with S = C B^T (bwd_chunk_dx's docstring): of block (i, j), j <= i, the row sums of W to the
tokens of block i in slot j and minus its column sums to the tokens of block j in slot i (both
in slot i on the diagonal), so each token's slots add up to r - c of its row and column of W,
every (slot, block) written by one program; bwd_chunk_dx then adds its own terms.
Grid: ((Q / BLOCK_Q)^2 * SPLITS * nc * B * G,), a chunk's block pairs adjacent: the programs
of one chunk run together and share its dout and x blocks in L2 (with the chunk the fastest
index they ran a wave apart, and at 2.7B the launch read 1.8x the bytes of x and dout from
DRAM).

3b: one program = one whole chunk x one n-tile (BLOCK_N) of one group and one output (dC or
dB). Grid: (cdiv(N, BLOCK_N) * 2 * SPLITS * nc * B * G,), n-tiles fastest, then the output:
the programs reading a chunk's dout (dC) or x (dB) run side by side.

Head split (SPLITS > 1, `BackwardConfig.dcb_head_split`; short sequences, where nc * B * G
programs leave SMs idle while each walks all of its group's heads): the group's heads are cut
into SPLITS runs of HEADS_PER_GROUP / SPLITS. 3a's program of split s sums its run's M into
dS_s (at s * B + batch of dcb); 3b's program of split s adds its run's state terms and
dS_s B (dC) or dS_s^T C (dB), into an fp32 partial at s * B + batch of db / dc. Since dS is
linear in the head sum, the partials add up to dB and dC (sum_partials, in a fixed order:
deterministic). The W terms are per head, written by the one program that owns the head.
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
    load_state_raw,
    seq_bounds,
    state_weight,
    wop,
)


def bwd_chunk_dcb_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N) (read only if DA_W)
    c,           # (B, L, G, N) (read only if DA_W)
    z,           # (B, L, H, P) (ignored unless HAS_Z)
    dout,        # (B, L, H, P)
    dt,          # (B, H, Lp) float32 dt'
    cum,         # (B, H, Lp) float32 G2
    seq_idx,     # (B, L) int32 (ignored unless HAS_SEQ)
    dcb,         # (SPLITS * B, G, Lp, Q) float32 out: dS (split s's heads at s * B + batch),
                 # row = token, column = token within its chunk
    da_part,     # (>= Q / BLOCK_Q, B, H, Lp) float32 out (only if DA_W): W terms, slot = block
    Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int],         # padded dstate (DA_W: C_i B_j^T over all of N)
    HEADS_PER_GROUP: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOWP: ct.Constant[bool],
    LAT: ct.Constant[int],        # load latency hint in the head loop (0: none)
    DA_W: ct.Constant[bool],      # also the W terms of the decay gradient (da_mode 3)
    SPLITS: ct.Constant[int],     # programs sharing a group's heads (dividing HEADS_PER_GROUP)
):
    NBPC = Q // BLOCK_Q
    HPS = HEADS_PER_GROUP // SPLITS
    seqlen = x.shape[1]
    nbatch = x.shape[0]
    ngroups = dcb.shape[1]
    nc = ct.cdiv(seqlen, Q)
    n_pt = ct.cdiv(x.shape[3], BLOCK_P)
    pair = ct.bid(0) % (NBPC * NBPC)
    rest = ct.bid(0) // (NBPC * NBPC)
    split = rest % SPLITS
    rest = rest // SPLITS
    chunk = rest % nc
    bg = rest // nc
    batch = bg // ngroups
    group = bg % ngroups
    i = pair // NBPC
    j = pair % NBPC
    row_blk = chunk * NBPC + i
    col_blk = chunk * NBPC + j
    mm = x.dtype

    acc = ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32)
    if j <= i:
        if row_blk * BLOCK_Q < seqlen:
            tok_i = row_blk * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
            tok_j = col_blk * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
            s_i = block_seq(seq_idx, batch, row_blk, BLOCK_Q, HAS_SEQ)
            s_j = block_seq(seq_idx, batch, col_blk, BLOCK_Q, HAS_SEQ)
            if DA_W:
                # S_ij = C_i B_j^T, the group's, once for all its heads
                ci = load_rows(c, batch, row_blk, group, 0, BLOCK_Q, NP)
                bj = load_rows(b, batch, col_blk, group, 0, BLOCK_Q, NP)
                s_ij = ct.mma(mma_operand(ci, mm), mma_operand(bj.transpose(), mm),
                              ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32))
            for hh in range(HPS):
                head = group * HEADS_PER_GROUP + split * HPS + hh
                g_i = block_decay(cum, batch, head, row_blk, BLOCK_Q, LAT)
                g_j = block_decay(cum, batch, head, col_blk, BLOCK_Q, LAT)
                dt_j = block_decay(dt, batch, head, col_blk, BLOCK_Q, LAT)
                dyx = ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32)
                for pt in range(n_pt):
                    dy = load_dy(dout, z, batch, row_blk, head, pt, BLOCK_Q, BLOCK_P, HAS_Z, LAT)
                    xj = load_rows(x, batch, col_blk, head, pt, BLOCK_Q, BLOCK_P, LAT)
                    dyx = ct.mma(dy_op(dy, mm, LOWP, HAS_Z),
                                 dy_op(xj.transpose(), mm, LOWP, HAS_Z), dyx)
                m = dyx * intra_decay(g_i, g_j, tok_i, tok_j, s_i, s_j, HAS_SEQ) * dt_j[None, :]
                acc = acc + m
                if DA_W:
                    w = m * s_ij
                    r = ct.sum(w, axis=1)
                    cs = ct.sum(w, axis=0)
                    if i == j:
                        ct.store(da_part, index=(i, batch, head, row_blk),
                                 tile=(r - cs).reshape((1, 1, 1, BLOCK_Q)))
                    else:
                        ct.store(da_part, index=(j, batch, head, row_blk),
                                 tile=r.reshape((1, 1, 1, BLOCK_Q)))
                        ct.store(da_part, index=(i, batch, head, col_blk),
                                 tile=(-cs).reshape((1, 1, 1, BLOCK_Q)))
        else:
            if DA_W:
                # a row block past the sequence: its slot of block j still needs writing
                zero = ct.full((1, 1, 1, BLOCK_Q), 0.0, dtype=ct.float32)
                for hh in range(HPS):
                    head = group * HEADS_PER_GROUP + split * HPS + hh
                    ct.store(da_part, index=(i, batch, head, col_blk), tile=zero)
                    ct.store(da_part, index=(j, batch, head, row_blk), tile=zero)
    ct.store(dcb, index=(split * nbatch + batch, group, row_blk, j),
             tile=acc.reshape((1, 1, BLOCK_Q, BLOCK_Q)))


def bwd_chunk_dbc_group_fn(
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
    dcb,         # (SPLITS * B, G, Lp, Q) float32: dS from bwd_chunk_dcb
    db,          # (SPLITS * B, L, G, N) out (SPLITS > 1: fp32 partials, split s at s * B)
    dc,          # (SPLITS * B, L, G, N) out
    Q: ct.Constant[int],
    BLOCK_K: ct.Constant[int],    # tokens of dS's inner dimension per MMA
    BLOCK_P: ct.Constant[int],
    BLOCK_N: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOWP: ct.Constant[bool],
    LAT: ct.Constant[int],        # load latency hint in the head loop (0: none)
    SPLITS: ct.Constant[int],     # programs sharing a group's heads (dividing HEADS_PER_GROUP)
):
    NKB = Q // BLOCK_K
    HPS = HEADS_PER_GROUP // SPLITS
    seqlen = x.shape[1]
    nbatch = x.shape[0]
    ngroups = b.shape[2]
    nc = ct.cdiv(seqlen, Q)
    n_pt = ct.cdiv(x.shape[3], BLOCK_P)
    n_nt = ct.cdiv(b.shape[3], BLOCK_N)
    n_tile = ct.bid(0) % n_nt
    kind = (ct.bid(0) // n_nt) % 2               # 0: dC, 1: dB
    rest = ct.bid(0) // (2 * n_nt)
    split = rest % SPLITS
    rest = rest // SPLITS
    chunk = rest % nc
    bg = rest // nc
    batch = bg // ngroups
    group = bg % ngroups
    mm = x.dtype

    s = block_seq(seq_idx, batch, chunk, Q, HAS_SEQ)
    before, last = seq_bounds(seq_idx, batch, chunk, seqlen, Q, HAS_SEQ)
    # inner blocks holding tokens (a block wholly past the sequence is not loaded)
    k_end = ct.minimum(NKB, ct.cdiv(seqlen - chunk * Q, BLOCK_K))
    acc = ct.full((Q, BLOCK_N), 0.0, dtype=ct.float32)
    part = split * nbatch + batch
    if kind == 0:
        for hh in range(HPS):
            head = group * HEADS_PER_GROUP + split * HPS + hh
            state_w = state_weight(block_decay(cum, batch, head, chunk, Q, LAT), s, before,
                                   HAS_SEQ)
            for pt in range(n_pt):
                dy = load_dy(dout, z, batch, chunk, head, pt, Q, BLOCK_P, HAS_Z, LAT)
                h = load_state_raw(states, batch, head, chunk, pt, n_tile, BLOCK_P, BLOCK_N,
                                   LAT)
                acc = ct.mma(mma_operand(dy * state_w[:, None], mm), mma_operand(h, mm), acc)
        for kb in range(k_end):
            m = ct.load(dcb, index=(part, group, chunk, kb),
                        shape=(1, 1, Q, BLOCK_K)).reshape((Q, BLOCK_K))
            bk = load_rows(b, batch, chunk * NKB + kb, group, n_tile, BLOCK_K, BLOCK_N)
            acc = ct.mma(wop(m, mm, LOWP), wop(bk, mm, LOWP), acc)
        ct.store(dc, index=(part, chunk, group, n_tile),
                 tile=acc.reshape((1, Q, 1, BLOCK_N)).astype(dc.dtype))
    else:
        for hh in range(HPS):
            head = group * HEADS_PER_GROUP + split * HPS + hh
            g = block_decay(cum, batch, head, chunk, Q, LAT)
            dtv = block_decay(dt, batch, head, chunk, Q, LAT)
            g_last = chunk_last_decay(cum, batch, head, chunk, Q)
            x_w = exit_weight(g, g_last, s, last, HAS_SEQ) * dtv
            for pt in range(n_pt):
                xt = load_rows(x, batch, chunk, head, pt, Q, BLOCK_P, LAT).astype(ct.float32)
                ds = load_state_raw(dstates, batch, head, chunk, pt, n_tile, BLOCK_P, BLOCK_N,
                                    LAT)
                acc = ct.mma(mma_operand(xt * x_w[:, None], mm), mma_operand(ds, mm), acc)
        for kb in range(k_end):
            m = ct.load(dcb, index=(part, group, chunk * NKB + kb, 0),
                        shape=(1, 1, BLOCK_K, Q)).reshape((BLOCK_K, Q))
            ck = load_rows(c, batch, chunk * NKB + kb, group, n_tile, BLOCK_K, BLOCK_N)
            acc = ct.mma(wop(m.transpose(), mm, LOWP), wop(ck, mm, LOWP), acc)
        ct.store(db, index=(part, chunk, group, n_tile),
                 tile=acc.reshape((1, Q, 1, BLOCK_N)).astype(db.dtype))


bwd_chunk_dcb = ct.kernel(bwd_chunk_dcb_fn)
bwd_chunk_dcb_i64 = ct.kernel(int64_variant(
    bwd_chunk_dcb_fn, ["x", "b", "c", "z", "dout", "dt", "cum", "seq_idx", "dcb", "da_part"]))
bwd_chunk_dbc_group = ct.kernel(bwd_chunk_dbc_group_fn)
bwd_chunk_dbc_group_i64 = ct.kernel(int64_variant(
    bwd_chunk_dbc_group_fn, ["x", "b", "c", "z", "dout", "dt", "cum", "seq_idx", "states",
                             "dstates", "dcb", "db", "dc"]))
