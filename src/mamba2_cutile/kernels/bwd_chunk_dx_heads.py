"""Backward kernel 2, several heads per program: bwd_chunk_dx's outputs for HB heads of one group.

The same quantities as kernels/bwd_chunk_dx.py (read its docstring for the equations: dx, dz,
the per-p-tile partials of dD, ddt_direct and da, written to the same arrays at the same
indices, so the rest of the backward cannot tell the two apart), but one program handles
token block t (BLOCK_Q tokens of chunk c) x one p-tile x HB = HEAD_BLOCK heads h0 .. h0+HB-1
of ONE group (heads of a group are contiguous, head h is in group h // HPG with HPG = H / G
the heads per group, and HB divides HPG). What depends on the group only is formed once per
program:

  S_row  = C_t B_c^T      (BQ x Q):  S_row[i, j]  = S_{t_i, c_j}, the key blocks of row block t
  S_colT = B_t C_c^T      (BQ x Q):  S_colT[i, j] = S_{c_j, t_i}, the query blocks, transposed

with B_c, C_c the chunk's whole (Q, NP) B and C tiles (zero past L): two N-deep MMAs per
program instead of two per block pair, head and p-tile, and B/C read once per HB heads. Each
stays on chip (fp32; in the input dtype with LOWP, the dtype its MMAs take) while a runtime
loop walks the HB heads: first S_row's loop (the key side: y and dz, the da terms), then
S_colT's (the query side: dx, dD, ddt_direct), so one (BQ, Q) S tile is live at a time; the query
loop forms Bds again (one BQ x NP x BP MMA) rather than keep HB of them. Per head, with the
chunk-wide decays, L_row = L[t, c] (zero on key tokens after the row's, so the key blocks
k > t drop out) and L_colT[i, j] = L[c_j, t_i] (zero on query tokens before t):

  cb   = S_row o L_row o dt'_c                               (BQ x Q)
  y    = state_w Ch + cb X_c + D X_t          (only with z)
  W    = cb o (dY_t X_c^T)                                   (BQ x Q; zero for k > t)
  dXs  = exit_w Bds + (S_colT o L_colT) dY_c                 (BQ x BP)

and the da terms of the chunk's Q key positions s at once, the sums over key blocks of
bwd_chunk_dx becoming sums over the whole row:
  DA_MODE 1: u_s = [s = last] (sum_i V_i + carry) - colsum(W)_s
                   + [s in block t] (rowsum(W) + dGs - V)_s
  DA_MODE 0: contrib_s = sum_i ( [i >= s] (excl_cumsum_row(W)_is + dGs_i) + [i < s] V_i )
                         + carry        (carry_w <dS_c, h_c>_F, nonzero on the chunk's first
                                         block only, as in bwd_chunk_dx)
stored as one (Q,) row into slot p_tile * (Q // BQ) + t % (Q // BQ) of da_part, exactly the
slots and values bwd_chunk_dx writes block by block. DA_MODE 2 and the S buffer (DX_CB) are
not here: the plan launches bwd_chunk_dx for them.

The price of whole-chunk rows: the masked halves (k > t in S_row, q < t in S_colT) are
multiplied too, (Q / BQ - 1) / 2 blocks of each on average.

Registers (sm_90 CPU compile, B=2 T=4096 H=80 G=1 P=64 N=128, BQ=64; the head count does not
change them, the head loops are run-time loops): at dx_occupancy=1, dx_warps=8 no spills (168
registers at BP=32, 253 at BP=64), one program per SM; at the dispatcher's occupancy 2 and 4
warps 0.3-0.4 KB of spills per thread, 0.6-0.7 KB with every option on, 1.7 KB at an internal
chunk of 256 (a (64, 256) S tile).

Tiles: x_t, dout_t, z_t (BQ, BP); x_c, dY_c (Q, BP); B_c, C_c (Q, NP); B_t, C_t (BQ, NP), loaded
once per program (for S and every head's Ch and Bds); h_c, dS_c (BP, NP); S_row, S_colT, the
decays and W (BQ, Q). Grid: (cdiv(L, BQ) * B * (H / HB), cdiv(P, BP)), token blocks fastest;
blocks past the last token are not launched.
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
    load_dy,
    load_rows,
    load_state,
    seq_bounds,
    state_weight,
    wop,
)


def bwd_chunk_dx_heads_fn(
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
    da_part,     # (n_pt * Q // BQ, B, H, Lp) float32 out: da terms per slot
    ddt_part,    # (n_pt, B, H, Lp) float32 out: ddt_direct per p-tile
    dD_part,     # (cdiv(L, BQ), B, H, P) float32 out: colsum(dY o X) (only if D_MODE)
    Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int],
    HEAD_BLOCK: ct.Constant[int],  # HB heads per program (divides H / G)
    D_MODE: ct.Constant[int],      # 0: no D, 1: per head, 2: per (head, channel)
    HAS_Z: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOWP: ct.Constant[bool],
    DA_MODE: ct.Constant[int],     # 0: stable form, 1: local terms (see bwd_chunk_dx)
    LAT: ct.Constant[int],         # load latency hint of the chunk-wide loads (0: none)
):
    ZERO = ct.PaddingMode.ZERO
    NBPC = Q // BLOCK_Q
    seqlen = x.shape[1]
    nheads = x.shape[2]
    n_q = ct.cdiv(seqlen, BLOCK_Q)
    n_hb = nheads // HEAD_BLOCK
    t = ct.bid(0) % n_q
    bhb = ct.bid(0) // n_q
    p_tile = ct.bid(1)
    batch = bhb // n_hb
    head0 = (bhb % n_hb) * HEAD_BLOCK
    # H / G from the shapes, not a constant: one compile serves every head and group count
    group = head0 // (nheads // b.shape[2])
    chunk = t // NBPC
    first = chunk * NBPC
    slot = p_tile * NBPC + (t - first)
    mm = x.dtype

    # what every head of the program shares: token positions and seq ids
    tok_t = t * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
    tok_c = chunk * Q + ct.arange(Q, dtype=ct.int32)
    s_t = block_seq(seq_idx, batch, t, BLOCK_Q, HAS_SEQ)
    s_c = block_seq(seq_idx, batch, chunk, Q, HAS_SEQ)
    before, last = seq_bounds(seq_idx, batch, chunk, seqlen, Q, HAS_SEQ)
    last_tok = ct.minimum(chunk * Q + Q - 1, seqlen - 1)
    # the row block t's positions in the chunk's (Q,) da row
    in_t = (ct.arange(NBPC, dtype=ct.int32) == t - first)[:, None]

    # C_t and B_t, MMA operands of S and of every head's Ch and Bds
    c_t = mma_operand(load_rows(c, batch, t, group, 0, BLOCK_Q, NP), mm)
    b_t = mma_operand(load_rows(b, batch, t, group, 0, BLOCK_Q, NP), mm)

    # key side, S_row = C_t B_c^T for every head: y (dz), the da terms
    s_row = ct.mma(c_t,
                   mma_operand(load_rows(b, batch, chunk, group, 0, Q, NP, LAT), mm).transpose(),
                   ct.full((BLOCK_Q, Q), 0.0, dtype=ct.float32))
    if LOWP:
        s_row = s_row.astype(mm)    # only an MMA operand's factor, rounded to mm anyway
    if HAS_Z:
        # D of the program's heads, (HB, 1) or (HB, BP), for y: loaded once, each head's row
        # selected in the loop (tileiras 13.4 for sm_90 crashed, SIGSEGV, on this loop with a
        # per-head load of D added to y after the MMA, and with dD stored here)
        head_rows = ct.arange(HEAD_BLOCK, dtype=ct.int32)[:, None]
        if D_MODE == 1:
            d_heads = ct.load(D, index=(head0 // HEAD_BLOCK,), shape=(HEAD_BLOCK,)).reshape(
                (HEAD_BLOCK, 1))
        if D_MODE == 2:
            d_heads = ct.load(D, index=(head0 // HEAD_BLOCK, p_tile),
                              shape=(HEAD_BLOCK, BLOCK_P), padding_mode=ZERO)
    for hi in range(HEAD_BLOCK):
        head = head0 + hi
        g_t = block_decay(cum, batch, head, t, BLOCK_Q)
        dt_t = block_decay(dt, batch, head, t, BLOCK_Q)
        g_c = block_decay(cum, batch, head, chunk, Q, LAT)
        dt_c = block_decay(dt, batch, head, chunk, Q, LAT)
        g_last = chunk_last_decay(cum, batch, head, chunk, Q)
        state_w = state_weight(g_t, s_t, before, HAS_SEQ)
        exit_w = exit_weight(g_t, g_last, s_t, last, HAS_SEQ)

        xt = load_rows(x, batch, t, head, p_tile, BLOCK_Q, BLOCK_P).astype(ct.float32)
        do = load_rows(dout, batch, t, head, p_tile, BLOCK_Q, BLOCK_P).astype(ct.float32)
        dy = do
        if HAS_Z:
            zt = load_rows(z, batch, t, head, p_tile, BLOCK_Q, BLOCK_P).astype(ct.float32)
            sig = 1.0 / (1.0 + ct.exp(-zt))
            dy = do * zt * sig

        h = load_state(states, batch, head, chunk, p_tile, 0, BLOCK_P, NP)
        ds = load_state(dstates, batch, head, chunk, p_tile, 0, BLOCK_P, NP)
        carry = carry_weight(g_last, before, last, HAS_SEQ) * ct.sum(ct.sum(ds * h, axis=1),
                                                                     axis=0, keepdims=True)
        if t != first:
            carry = ct.full((1,), 0.0, dtype=ct.float32)    # added once per chunk
        ch = ct.mma(c_t,
                    mma_operand(h.transpose(), mm),
                    ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32))
        bds = ct.mma(b_t,
                     mma_operand(ds.transpose(), mm),
                     ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32))
        dgs = state_w * ct.sum(dy * ch, axis=1)             # (BQ,) state term of dG
        v = exit_w * dt_t * ct.sum(xt * bds, axis=1)        # (BQ,) exit term V

        # cb = S o L o dt' over the whole chunk row (zero on key tokens after the row's)
        key_le = tok_t[:, None] >= tok_c[None, :]
        if HAS_SEQ:
            key_le = key_le & (s_t[:, None] == s_c[None, :])
        cb = s_row.astype(ct.float32) * ct.exp2(
            ct.where(key_le, g_t[:, None] - g_c[None, :], -float("inf"))) * dt_c[None, :]
        xc = load_rows(x, batch, chunk, head, p_tile, Q, BLOCK_P, LAT)
        dyx = ct.mma(dy_op(dy, mm, LOWP, HAS_Z), dy_op(xc.transpose(), mm, LOWP, HAS_Z),
                     ct.full((BLOCK_Q, Q), 0.0, dtype=ct.float32))
        if HAS_Z:
            y0 = ch * state_w[:, None]
            if D_MODE != 0:
                # this head's row of the program's D tile
                y0 = y0 + ct.sum(ct.where(head_rows == hi, d_heads, 0.0), axis=0,
                                 keepdims=True) * xt
            y = ct.mma(wop(cb, mm, LOWP), wop(xc, mm, LOWP), y0)
        w = cb * dyx
        if DA_MODE == 1:
            k_part = ct.sum(v, axis=0, keepdims=True) + carry
            own = ct.broadcast_to((ct.sum(w, axis=1) + dgs - v)[None, :], (NBPC, BLOCK_Q))
            own = ct.where(in_t, own, 0.0).reshape((Q,))
            contrib = ct.where(tok_c == last_tok, k_part, 0.0) - ct.sum(w, axis=0) + own
        else:
            excl = ct.cumsum(w, axis=1) - w
            row_ge = tok_t[:, None] >= tok_c[None, :]           # i >= s
            e = ct.where(row_ge, excl + dgs[:, None],
                         ct.broadcast_to(v[:, None], (BLOCK_Q, Q)))
            contrib = ct.sum(e, axis=0) + carry
        ct.store(da_part, index=(slot, batch, head, chunk), tile=contrib.reshape((1, 1, 1, Q)))

        if HAS_Z:
            dzt = do * y * sig * (1.0 + zt * (1.0 - sig))
            ct.store(dz, index=(batch, t, head, p_tile),
                     tile=dzt.reshape((1, BLOCK_Q, 1, BLOCK_P)).astype(dz.dtype))

    # query side, S_colT = B_t C_c^T (formed after S_row is dead: one (BQ, Q) tile lives at a
    # time): dXs = exit_w Bds + (S o L)^T dY over the chunk's query tokens -> dx, ddt_direct
    s_colT = ct.mma(b_t,
                    mma_operand(load_rows(c, batch, chunk, group, 0, Q, NP, LAT), mm).transpose(),
                    ct.full((BLOCK_Q, Q), 0.0, dtype=ct.float32))
    if LOWP:
        s_colT = s_colT.astype(mm)
    for hi in range(HEAD_BLOCK):
        head = head0 + hi
        g_t = block_decay(cum, batch, head, t, BLOCK_Q)
        dt_t = block_decay(dt, batch, head, t, BLOCK_Q)
        g_c = block_decay(cum, batch, head, chunk, Q, LAT)
        g_last = chunk_last_decay(cum, batch, head, chunk, Q)
        exit_w = exit_weight(g_t, g_last, s_t, last, HAS_SEQ)
        xt = load_rows(x, batch, t, head, p_tile, BLOCK_Q, BLOCK_P).astype(ct.float32)
        # Bds again (one BQ x NP x BP MMA): cheaper than keeping HB of them
        ds = load_state(dstates, batch, head, chunk, p_tile, 0, BLOCK_P, NP)
        bds = ct.mma(b_t,
                     mma_operand(ds.transpose(), mm),
                     ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32))
        qry_ge = tok_c[None, :] >= tok_t[:, None]       # (BQ, Q) query token at or after
        if HAS_SEQ:
            qry_ge = qry_ge & (s_t[:, None] == s_c[None, :])
        lcol = ct.exp2(ct.where(qry_ge, g_c[None, :] - g_t[:, None], -float("inf")))
        dyc = load_dy(dout, z, batch, chunk, head, p_tile, Q, BLOCK_P, HAS_Z, LAT)
        acc = ct.mma(wop(s_colT.astype(ct.float32) * lcol, mm, LOWP), wop(dyc, mm, LOWP),
                     bds * exit_w[:, None])

        dxt = acc * dt_t[:, None]
        if D_MODE != 0:
            dy = load_dy(dout, z, batch, t, head, p_tile, BLOCK_Q, BLOCK_P, HAS_Z)
            if D_MODE == 1:
                dh_ = ct.load(D, index=(head,), shape=(1,)).reshape((1, 1))
            if D_MODE == 2:
                dh_ = ct.load(D, index=(head, p_tile), shape=(1, BLOCK_P), padding_mode=ZERO)
            dxt = dxt + dh_ * dy
            ct.store(dD_part, index=(t, batch, head, p_tile),
                     tile=ct.sum(dy * xt, axis=0).reshape((1, 1, 1, BLOCK_P)))
        ct.store(dx, index=(batch, t, head, p_tile),
                 tile=dxt.reshape((1, BLOCK_Q, 1, BLOCK_P)).astype(dx.dtype))
        ct.store(ddt_part, index=(p_tile, batch, head, t),
                 tile=ct.sum(xt * acc, axis=1).reshape((1, 1, 1, BLOCK_Q)))


bwd_chunk_dx_heads = ct.kernel(bwd_chunk_dx_heads_fn)
bwd_chunk_dx_heads_i64 = ct.kernel(int64_variant(
    bwd_chunk_dx_heads_fn, ["x", "b", "c", "z", "dout", "D", "dt", "cum", "seq_idx", "states",
                            "dstates", "dx", "dz", "da_part", "ddt_part", "dD_part"]))
