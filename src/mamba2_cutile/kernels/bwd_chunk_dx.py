"""Backward kernel 2 (parallel over chunks): dx, dz, and per-p-tile partials of dD, ddt and da.

One program = token block t (BLOCK_Q tokens of chunk c) x one p-tile (BLOCK_P channels) of one
head. With dY = dout * silu(z), S = C B^T, L the masked intra-chunk decay (bwd_common),
h_c the entry state and dS_c the exit-state gradient of the chunk (p-tile rows, all of N):

  carried/exit terms   Ch  = C_t h_c^T,  Bds = B_t dS_c^T                       (BQ x BP)
  y (only with z)      y_t = state_w Ch + sum_{k<=t} (L o S o dt'_k)_{tk} X_k + D X_t
                       dz  = dout * y * silu'(z)                                   [stage 1+2]
  dx                   dXs = exit_w Bds + sum_{q>=t} (L o S)_{qt}^T dY_q
                       dx  = dt' dXs + D dY;   ddt_direct = rowsum(X o dXs)        [stage 4]
  dD partial           colsum(dY o X) (per channel; the host sums over tokens/batch)
  da (stage4_ddecay), partial over p-tiles and over the row blocks i of the chunk:
       da_s = sum_{i>=s} sum_{j<s} W_ij                  W = L o S o dt'_j o (dY X^T)
            + sum_{j<s} V_j                              V = exit_w dt' rowsum(X o Bds)
            + carry_w <dS_c, h_c>_F                      (all s of the chunk)
            + sum_{i>=s} dGs_i                           dGs = state_w rowsum(dY o Ch)
  Four ways to get da (DA_MODE, a compile-time constant; all deterministic, no atomics):
  0 (stable form: every contribution a plain sum of terms, nothing large cancels). Program t
     owns rows i in block t. Walking key blocks k = first..t it keeps the row prefix
     pre_i = sum_{j in blocks < k} W_ij, so for s in block k
       contrib_s = sum_{i in t} ( [i >= s] (pre_i + excl_cumsum_j(W)_is + dGs_i)
                                + [i <  s] V_i )
     and for key blocks k > t (no W, every i < s) contrib_s = sum_i V_i; the carry term is
     added once per chunk, by its first block. Program t writes its contributions for the
     whole chunk into its own slot (p_tile * (Q // BLOCK_Q) + t % (Q // BLOCK_Q)) of da_part;
     the dt kernel adds the slots in a fixed order.
  1 (the default): the same slots hold per-token terms u whose suffix sum over the chunk is
     da (the dt kernel takes it). With r / c the row / column sums of W,
       da_s = sum_{i>=s} (r_i - c_i + dGs_i - V_i) + (sum_j V_j + carry_w <dS_c, h_c>_F),
     the constant put on the chunk's last real token. sum_{i>=s} (r_i - c_i) is the same
     sum_{i>=s} sum_{j<s} W_ij (the pairs with both i, j >= s cancel): no cumsum per block
     pair, at the price of that cancellation in fp32 (terms of one size, no exponentials;
     about 4e-7 relative in dA in a float32 emulation, against 1e-7 for mode 0).
  2: the W terms (r - c) come from bwd_chunk_dbc_fused, which has dY X^T over all of P
     already; this kernel writes dGs - V of its own rows into slot p_tile of da_part
     (n_pt + n_nt slots) and V (+ the carry term on the chunk's first token) into v_part; the
     dt kernel forms da_s = suffix_sum(all slots)_s + sum_tokens(v_part). Without z the
     key-block loop is then skipped entirely.
  3: the same with the W terms from bwd_chunk_dcb (bc_fused 2), which runs first and writes
     r - c in W_SLOTS slots; this kernel adds dGs - V of its rows into slot p_tile (a read,
     add and write: no other program touches that slot's block) and writes one number per
     program, sum_block V (+ the carry term on the chunk's first block), into v_part, which
     the dt kernel adds to the chunk's suffix sums: max(W_SLOTS, n_pt) slots in all.

Tiles: x, dout, z (BQ, BP); B, C (BQ, NP) with NP the padded dstate; h_c, dS_c (BP, NP);
Q x Q work in BQ x BQ blocks (BQ = BLOCK_Q <= Q). Grid: (cdiv(L, BQ) * B * H, cdiv(P, BP)),
token blocks fastest; blocks past the last token are not launched.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand
from .bwd_common import (
    block_decay,
    block_seq,
    carry_weight,
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


def bwd_chunk_dx_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N)
    c,           # (B, L, G, N)
    z,           # (B, L, H, P) (ignored unless HAS_Z)
    dout,        # (B, L, H, P)
    D,           # (H,) or (H, P) float32 per D_MODE
    dt,          # (B, H, Lp) float32 dt'
    cum,         # (B, H, Lp) float32 G2
    seq_idx,     # (B, L) int32 (ignored unless HAS_SEQ)
    states,      # (B, H, C, P, N) entry states h_c
    dstates,     # (B, H, C, P, N) exit-state gradients dS_c
    dx,          # (B, L, H, P) out
    dz,          # (B, L, H, P) out (written only if HAS_Z)
    da_part,     # (n_pt * Q // BQ, B, H, Lp) float32 out: da terms per slot (DA_MODE 2:
                 # (n_pt + n_nt, B, H, Lp), this kernel writing slots 0..n_pt-1; DA_MODE 3:
                 # (max(W_SLOTS, n_pt), B, H, Lp), slots < W_SLOTS read and written)
    ddt_part,    # (n_pt, B, H, Lp) float32 out: ddt_direct per p-tile
    dD_part,     # float32 out (only if D_MODE): colsum(dY o X), (cdiv(L, BQ), B, H, P); D_MODE 1
                 # its sum over the p-tile, (cdiv(L, BQ), B, H, n_pt)
    v_part,      # (n_pt, B, H, Lp) float32 out: V (+ carry on the chunk's first token), DA_MODE 2;
                 # DA_MODE 3: (n_pt, B, H, nc * Q // BQ), sum_block V (+ carry on the first block)
    Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    D_MODE: ct.Constant[int],     # 0: no D, 1: per head, 2: per (head, channel)
    HAS_Z: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOWP: ct.Constant[bool],
    DA_MODE: ct.Constant[int],    # 0: stable form, 1: local terms, 2, 3: split (see above)
    W_SLOTS: ct.Constant[int],    # DA_MODE 3: the slots bwd_chunk_dcb wrote (Q // its BLOCK_Q)
    LAT: ct.Constant[int],        # load latency hint in the key/query block loops (0: none)
):
    ZERO = ct.PaddingMode.ZERO
    NBPC = Q // BLOCK_Q                  # token blocks per chunk
    seqlen = x.shape[1]
    nheads = x.shape[2]
    n_q = ct.cdiv(seqlen, BLOCK_Q)
    t = ct.bid(0) % n_q
    bh = ct.bid(0) // n_q
    p_tile = ct.bid(1)
    batch = bh // nheads
    head = bh % nheads
    group = head // HEADS_PER_GROUP
    chunk = t // NBPC
    first = chunk * NBPC
    end = ct.minimum(first + NBPC, n_q)  # key blocks of this chunk holding tokens
    slot = p_tile * NBPC + (t - first)
    mm = x.dtype

    tok_t = t * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
    g_t = block_decay(cum, batch, head, t, BLOCK_Q)
    dt_t = block_decay(dt, batch, head, t, BLOCK_Q)
    g_last = chunk_last_decay(cum, batch, head, chunk, Q)
    s_t = block_seq(seq_idx, batch, t, BLOCK_Q, HAS_SEQ)
    before, last = seq_bounds(seq_idx, batch, chunk, seqlen, Q, HAS_SEQ)
    state_w = state_weight(g_t, s_t, before, HAS_SEQ)
    exit_w = exit_weight(g_t, g_last, s_t, last, HAS_SEQ)

    xt = load_rows(x, batch, t, head, p_tile, BLOCK_Q, BLOCK_P).astype(ct.float32)
    do = load_rows(dout, batch, t, head, p_tile, BLOCK_Q, BLOCK_P).astype(ct.float32)
    dy = do
    if HAS_Z:
        zt = load_rows(z, batch, t, head, p_tile, BLOCK_Q, BLOCK_P).astype(ct.float32)
        ez = 1.0 + ct.exp(-zt)
        sig = 1.0 / ez
        dy = do * (zt / ez)                             # load_dy's dY, as for the blocks q > t

    # carried-state and exit-state terms (p-tile rows of h_c and dS_c, all of N)
    # in the state dtype: the MMAs take them as they are (bf16 states: no fp32 copies held)
    h = load_state_raw(states, batch, head, chunk, p_tile, 0, BLOCK_P, NP)
    ds = load_state_raw(dstates, batch, head, chunk, p_tile, 0, BLOCK_P, NP)
    carry = ct.full((1,), 0.0, dtype=ct.float32)
    if t == first:                                      # added once per chunk
        carry = carry_weight(g_last, before, last, HAS_SEQ) * ct.sum(
            ct.sum(ds.astype(ct.float32) * h.astype(ct.float32), axis=1), axis=0,
            keepdims=True)
    ct_t = mma_operand(load_rows(c, batch, t, group, 0, BLOCK_Q, NP), mm)
    ch = ct.mma(ct_t, mma_operand(h.transpose(), mm),
                ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32))
    bt = mma_operand(load_rows(b, batch, t, group, 0, BLOCK_Q, NP), mm)
    bds = ct.mma(bt, mma_operand(ds.transpose(), mm),
                 ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32))
    dgs = state_w * ct.sum(dy * ch, axis=1)                 # (BQ,) state term of dG
    v = exit_w * dt_t * ct.sum(xt * bds, axis=1)            # (BQ,) exit term V
    acc = bds * exit_w[:, None]                             # dXs, exit part
    # dXs's query block q = t, from the C_t and dY_t tiles already held (no second load of
    # either; first in the sum over q >= t as before)
    st = ct.mma(bt, ct_t.transpose(), ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32))
    lt = intra_decay(g_t, g_t, tok_t, tok_t, s_t, s_t, HAS_SEQ).transpose()
    acc = ct.mma(wop(st * lt, mm, LOWP), wop(dy, mm, LOWP), acc)
    y = ch * state_w[:, None]                               # y, carried-state part

    # key blocks k <= t: y's intra-chunk part and the da contributions of rows t
    pre = ct.full((BLOCK_Q,), 0.0, dtype=ct.float32)
    if DA_MODE == 1:
        last_tok = ct.minimum(chunk * Q + Q - 1, seqlen - 1)
        k_part = ct.sum(v, axis=0, keepdims=True) + carry
    dy_x = dy_op(dy, mm, LOWP, HAS_Z)
    # DA_MODE 2, 3 without z: the key blocks are needed for nothing (the dB/dC launch forms W)
    k_end = t + 1
    if DA_MODE >= 2 and not HAS_Z:
        k_end = first
    for k in range(first, k_end):
        tok_k = k * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
        g_k = block_decay(cum, batch, head, k, BLOCK_Q, LAT)
        dt_k = block_decay(dt, batch, head, k, BLOCK_Q, LAT)
        s_k = block_seq(seq_idx, batch, k, BLOCK_Q, HAS_SEQ)
        bk = load_rows(b, batch, k, group, 0, BLOCK_Q, NP, LAT)
        s = ct.mma(ct_t, mma_operand(bk.transpose(), mm),
                   ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32))
        cb = s * intra_decay(g_t, g_k, tok_t, tok_k, s_t, s_k, HAS_SEQ) * dt_k[None, :]
        xk = load_rows(x, batch, k, head, p_tile, BLOCK_Q, BLOCK_P, LAT)
        if HAS_Z:
            y = ct.mma(wop(cb, mm, LOWP), wop(xk, mm, LOWP), y)
        if DA_MODE < 2:
            dyx = ct.mma(dy_x, dy_op(xk.transpose(), mm, LOWP, HAS_Z),
                         ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32))
            w = cb * dyx
        if DA_MODE == 1:
            pre = pre + ct.sum(w, axis=1)                   # row sums (complete at k == t)
            contrib = ct.where(tok_k == last_tok, k_part, 0.0) - ct.sum(w, axis=0)
            if k == t:
                contrib = contrib + pre + dgs - v
        if DA_MODE == 0:
            excl = ct.cumsum(w, axis=1) - w
            row_ge = tok_t[:, None] >= tok_k[None, :]               # i >= s
            e = ct.where(row_ge, pre[:, None] + excl + dgs[:, None],
                         ct.broadcast_to(v[:, None], (BLOCK_Q, BLOCK_Q)))
            contrib = ct.sum(e, axis=0)
            if k == t:
                contrib = contrib + carry
            pre = pre + ct.sum(w, axis=1)
        if DA_MODE < 2:
            ct.store(da_part, index=(slot, batch, head, k),
                     tile=contrib.reshape((1, 1, 1, BLOCK_Q)))
    if DA_MODE == 2:
        ct.store(da_part, index=(p_tile, batch, head, t),
                 tile=(dgs - v).reshape((1, 1, 1, BLOCK_Q)))
        ct.store(v_part, index=(p_tile, batch, head, t),
                 tile=(v + ct.where(tok_t == chunk * Q, carry, 0.0)).reshape((1, 1, 1, BLOCK_Q)))
    if DA_MODE == 3:
        # slot p_tile of block t: bwd_chunk_dcb wrote its W terms there (p_tile < W_SLOTS)
        u = dgs - v
        if p_tile < W_SLOTS:
            u = u + ct.load(da_part, index=(p_tile, batch, head, t),
                            shape=(1, 1, 1, BLOCK_Q)).reshape((BLOCK_Q,))
        ct.store(da_part, index=(p_tile, batch, head, t), tile=u.reshape((1, 1, 1, BLOCK_Q)))
        ct.store(v_part, index=(p_tile, batch, head, t),
                 tile=(ct.sum(v, axis=0, keepdims=True) + carry).reshape((1, 1, 1, 1)))
    # key blocks k > t of the chunk: only the exit term (every i < s) and the carry
    k_rest = first + NBPC
    if DA_MODE >= 2:
        k_rest = t + 1
    for k in range(t + 1, k_rest):
        if DA_MODE == 1:
            tok_k = k * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
            rest = ct.where(tok_k == last_tok, k_part, 0.0)
        else:
            rest = ct.full((BLOCK_Q,), 0.0, dtype=ct.float32) + (
                ct.sum(v, axis=0, keepdims=True) + carry)
        ct.store(da_part, index=(slot, batch, head, k), tile=rest.reshape((1, 1, 1, BLOCK_Q)))

    if D_MODE == 1:
        dh_ = ct.load(D, index=(head,), shape=(1,)).reshape((1, 1))
    if D_MODE == 2:
        dh_ = ct.load(D, index=(head, p_tile), shape=(1, BLOCK_P), padding_mode=ZERO)
    if HAS_Z:
        if D_MODE != 0:
            y = y + dh_ * xt
        dzt = do * y * sig * (1.0 + zt * (1.0 - sig))
        ct.store(dz, index=(batch, t, head, p_tile),
                 tile=dzt.reshape((1, BLOCK_Q, 1, BLOCK_P)).astype(dz.dtype))

    # query blocks q > t: dXs += (L o S)_{qt}^T dY_q (q = t above)
    for q in range(t + 1, end):
        tok_q = q * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
        g_q = block_decay(cum, batch, head, q, BLOCK_Q, LAT)
        s_q = block_seq(seq_idx, batch, q, BLOCK_Q, HAS_SEQ)
        cq = load_rows(c, batch, q, group, 0, BLOCK_Q, NP, LAT)
        st = ct.mma(bt, mma_operand(cq.transpose(), mm),
                    ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32))
        lt = intra_decay(g_q, g_t, tok_q, tok_t, s_q, s_t, HAS_SEQ).transpose()
        dyq = load_dy(dout, z, batch, q, head, p_tile, BLOCK_Q, BLOCK_P, HAS_Z, LAT)
        acc = ct.mma(wop(st * lt, mm, LOWP), wop(dyq, mm, LOWP), acc)

    dxt = acc * dt_t[:, None]
    if D_MODE != 0:
        dxt = dxt + dh_ * dy
        if D_MODE == 1:
            ct.store(dD_part, index=(t, batch, head, p_tile),
                     tile=ct.sum(ct.sum(dy * xt, axis=1), axis=0, keepdims=True).reshape(
                         (1, 1, 1, 1)))
        else:
            ct.store(dD_part, index=(t, batch, head, p_tile),
                     tile=ct.sum(dy * xt, axis=0).reshape((1, 1, 1, BLOCK_P)))
    ct.store(dx, index=(batch, t, head, p_tile),
             tile=dxt.reshape((1, BLOCK_Q, 1, BLOCK_P)).astype(dx.dtype))
    ct.store(ddt_part, index=(p_tile, batch, head, t),
             tile=ct.sum(xt * acc, axis=1).reshape((1, 1, 1, BLOCK_Q)))


bwd_chunk_dx = ct.kernel(bwd_chunk_dx_fn)
bwd_chunk_dx_i64 = ct.kernel(int64_variant(
    bwd_chunk_dx_fn, ["x", "b", "c", "z", "dout", "D", "dt", "cum", "seq_idx", "states",
                      "dstates", "dx", "dz", "da_part", "ddt_part", "dD_part", "v_part"]))
