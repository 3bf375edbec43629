"""Kernel 3 of the forward pass: the output of every chunk, fused.

For the query block i (BLOCK_Q tokens of chunk c) and the state h_c entering the chunk:

    Y_i = 2^{G_i} * (C_i @ h_c^T)                                  carried-state term
        + sum_{key blocks k <= i} (2^{G_i - G_k} * (C_i @ B_k^T) * M) @ (dt_k * X_k)
        + D * X_i                                                  skip
    Y_i <- Y_i * silu(Z_i)                                         gate, if z is given

M is the causal mask (and, with seq_idx, the same-sequence mask: key >= the start of the
query's sequence run in the chunk, from decay_cumsum's seq_start); the masked C @ B^T block
(BLOCK_Q x BLOCK_Q) never leaves the chip. Only the diagonal block needs the causal mask,
exponents are masked *before* exp2 so no inf is ever formed.

Non-finite inputs. The plain tile above is not causal under NaN/Inf: the masked entries are
zeros multiplied in, and 0 * NaN is NaN, so a bad x, B or dt at token t reaches the rows
before t of its query block. Causal forms of the three kernels on every tile cost 20-51% (X
through registers before the MMA), so CHECK splits the work over two launches of this kernel,
a flagging one and a pass over the flagged tiles:

- CHECK=1: the plain tile, plus one number per tile in `flags`: how many of its outputs are
  non-finite (every contamination shows there as a NaN). Clean input pays a compare and a sum
  (on the H200 at the seed problem chunk_scan 0.143 -> 0.160 ms, and 0.032 ms for the second
  launch; scan_causal 4, the default, flags from the state pass instead).
- CHECK=2 (the second launch, same grid): a tile whose flag is 0 returns at once; a flagged
  one is computed again, SANITIZE: the weights masked by a select after they are formed,
  where(M, 2^{G_i - G_k} (C_i B_k^T) dt_k, 0) (a bad B or dt column stays in the kept rows
  i >= t); in partially masked key blocks (the diagonal one; with seq_idx every block) a
  non-finite x entry enters the MMA as 0 and sets NaN in the outputs the recurrence makes
  non-finite, (i, p) with M_ij and x_jp bad for some j ((M @ bad) > 0, a second small MMA);
  with seq_idx the carried state is selected away on rows whose run began in the chunk. Rows
  before t then equal those of a run with a finite value at t (same products, same order).
- CHECK=3 / 5 (scan_causal 2 / 3): the plain tile, plus the sum of its accumulator (before
  D x and the gate, which touch their own row only) into `flags`: one sum per tile (3) or one
  per query row (5). A sum is non-finite iff a term is (or it overflows: then the flagged tile
  is recomputed for nothing, to the same values), and each contamination above leaves a NaN in
  the accumulator. Row sums first: a flat ct.sum over the tile compiled to 3x the
  instructions. SASS instructions added to the plain kernel (sm_90, the seed problem's tuned
  config, 64-token query blocks): +248 for CHECK=1's count, +88 for 3, +64 for 5, which needs
  no exchange between warps (no extra barrier) at the price of BLOCK_Q floats per tile.
- CHECK=4 / 6 (their second launch): a program per FIX_SPAN tiles loads their sums at once and
  returns when all are finite (at the seed problem 128 programs, one wave, where CHECK=2 ran
  8192 early exits in 31 waves); else it recomputes its tiles with a non-finite sum in the
  SANITIZE form, one after the other.
- CHECK=8 (scan_causal 4, after a plain CHECK=0 launch): the flags come from
  chunk_state_pass (FLAG), one per state program (state tile and segment), set where a chunk
  of its run holds a non-finite x, B or dt' (its docstring); chunk_scan's own launch is the
  plain one, with nothing added. A program per (batch, head) loads its row of flags (FLAG_W
  columns, padded to a power of two) and returns when none is set; else it walks the head's
  chunks, checks each one's x, B and decay weights, and recomputes every tile of a chunk
  holding a non-finite one in the SANITIZE form. Only a chunk holding a bad token can have
  an earlier output made non-finite by its masked products: in a later chunk the rows
  reached by the bad value are reached in the recurrence too (through the state). Unlike
  1 to 3, which look at the outputs, 4 looks at the inputs: finite C and B whose product
  overflows float32 (entries near 1e19) give Inf * 0 = NaN in an earlier row unflagged.
- CHECK=9 (scan_causal 5): CHECK=8 with a program per (batch, head) and tile of the chunk
  (query block in the chunk, p-tile) instead of one walking them: see `_fix_chunks`.
CHECK=0: the plain tile alone.

Recomputing a flagged tile in the flagging program itself (one launch, a branch on the sum)
was tried: loads under a branch on a computed value cost the kernel its warp-specialized
pipeline (sm_90, seed problem with every option: 128 threads and 221 registers instead of
256 and 128, no producer warps), for the clean tiles too; the same branch without loads kept
it.

Tiles: C, B (BLOCK_Q, BLOCK_N), walking NP = the padded dstate in BLOCK_N steps; X (BLOCK_Q,
BLOCK_P); h_c (BLOCK_P, BLOCK_N). Grid: (cdiv(L, BLOCK_Q) * B * H, cdiv(P, BLOCK_P)), query blocks fastest
(HEAD_MAJOR: heads fastest); with PERSISTENT a fixed (programs,) grid looping over the tiles.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand


def _mma_x(acc, cb, xk, LOWP: ct.Constant[bool], in_dtype):
    """acc + cb @ xk: the weights rounded to the input dtype (LOWP) or tf32."""
    if LOWP:
        return ct.mma(mma_operand(cb, in_dtype), mma_operand(xk, in_dtype), acc)
    return ct.mma(cb.astype(ct.tfloat32), xk.astype(ct.tfloat32), acc)


def _mma_x_sanitized(acc, cb, xk, keep, LOWP: ct.Constant[bool], in_dtype):
    """`_mma_x` for a partially masked key block of a flagged tile: a non-finite x entry
    enters the MMA as 0 and poisons (NaN) the kept outputs of its channel instead."""
    finite = ct.abs(xk.astype(ct.float32)) < float("inf")        # False for NaN too
    acc = _mma_x(acc, cb, ct.where(finite, xk, 0.0).astype(in_dtype), LOWP, in_dtype)
    # (M @ bad)_ip > 0: some kept key j of row i has a bad x_jp (0/1 operands: exact)
    hits = ct.mma(mma_operand(ct.where(keep, 1.0, 0.0), in_dtype),
                  mma_operand(ct.where(finite, 0.0, 1.0), in_dtype),
                  ct.full(acc.shape, 0.0, dtype=ct.float32))
    return ct.where(hits > 0.0, float("nan"), acc)


def _add_key_block(
    acc, cb, kblk, qblk, g_q, row, start_q, x, dt, cum, batch, head, p_tile,
    BLOCK_Q: ct.Constant[int], BLOCK_P: ct.Constant[int], HAS_SEQ: ct.Constant[bool],
    LOWP: ct.Constant[bool], LAT, SANITIZE: ct.Constant[bool],
):
    """acc += (2^{G_q - G_k} * (C_q B_k^T) * M * dt_k) @ X_k for the raw C B^T block `cb`
    (SANITIZE: the flagged tile's causal form, module docstring)."""
    g_k = ct.load(cum, index=(batch, head, kblk), shape=(1, 1, BLOCK_Q)).reshape((BLOCK_Q,))
    dt_k = ct.load(dt, index=(batch, head, kblk), shape=(1, 1, BLOCK_Q)).reshape((BLOCK_Q,))
    col = kblk * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)
    keep = row[:, None] >= col[None, :]
    if HAS_SEQ:
        # a per-query bound, not a per-(query, key) comparison of sequence ids: no key-column
        # vector to hold (with ids, 128-token blocks spilled 256 B per thread)
        keep = keep & (col[None, :] >= start_q[:, None])
    # dt is folded into the decayed C B^T in fp32, so X enters the MMA unrounded: one
    # rounding (of the weights) instead of two. LOWP rounds the weights to the input
    # dtype (half the MMA cost of tf32, mamba_ssm's choice); otherwise tf32.
    if SANITIZE:
        # kept entries: the same products as below; masked ones selected, never 0 * NaN
        cb = ct.where(keep, cb * ct.exp2(g_q[:, None] - g_k[None, :]) * dt_k[None, :], 0.0)
    else:
        expo = ct.where(keep, g_q[:, None] - g_k[None, :], -float("inf"))
        cb = cb * ct.exp2(expo) * dt_k[None, :]
    xk = ct.load(x, index=(batch, kblk, head, p_tile), shape=(1, BLOCK_Q, 1, BLOCK_P),
                 padding_mode=ct.PaddingMode.ZERO, latency=LAT).reshape((BLOCK_Q, BLOCK_P))
    if SANITIZE:
        if HAS_SEQ:
            acc = _mma_x_sanitized(acc, cb, xk, keep, LOWP, x.dtype)
        elif kblk == qblk:
            acc = _mma_x_sanitized(acc, cb, xk, keep, LOWP, x.dtype)
        else:
            # every key of an earlier block precedes every query: nothing masked
            acc = _mma_x(acc, cb, xk, LOWP, x.dtype)
    else:
        acc = _mma_x(acc, cb, xk, LOWP, x.dtype)
    return acc


def _carried(acc, state_scale, start_q, HAS_SEQ: ct.Constant[bool]):
    """The carried-state term C h^T times 2^{G_q}. With seq_idx the state belongs to the
    sequence of the token before the chunk: only rows whose run began before the chunk (start
    -1) take it, by a select in every mode (h may be another sequence's NaN, and 0 * NaN
    would carry it into this sequence's first rows)."""
    if HAS_SEQ:
        return ct.where((start_q < 0)[:, None], acc * state_scale[:, None], 0.0)
    return acc * state_scale[:, None]


def _entry_state(states, seg_entry, chunk_factor, batch, head, chunk, p_tile, nt,
                 BLOCK_P: ct.Constant[int], BLOCK_N: ct.Constant[int], SEGS: ct.Constant[int],
                 LAT):
    """The (BLOCK_P, BLOCK_N) tile nt of the state entering `chunk`: as stored, or with SEGS > 1
    the segment's local state plus f_c H_s in float32 (chunk c in segment s: floor(C s / S) <=
    c, the segments of kernels/_common.state_segment). The product is a select where f_c = 0
    (a seq_idx reset: H_s may be another sequence's NaN) and in segment 0 (nothing enters it,
    and its f_c, written by the state pass, may be a NaN dt's NaN)."""
    h = ct.load(states, index=(batch, head, chunk, p_tile, nt),
                shape=(1, 1, 1, BLOCK_P, BLOCK_N), padding_mode=ct.PaddingMode.ZERO,
                latency=LAT).reshape((BLOCK_P, BLOCK_N))
    if SEGS > 1:
        seg = ((chunk + 1) * SEGS - 1) // states.shape[2]
        f = ct.load(chunk_factor, index=(batch, head, chunk), shape=(1, 1, 1)).reshape((1, 1))
        f = ct.where((ct.full((1, 1), 0, dtype=ct.int32) + seg) > 0, f, 0.0)
        hs = ct.load(seg_entry, index=(batch, head, seg, p_tile, nt),
                     shape=(1, 1, 1, BLOCK_P, BLOCK_N), padding_mode=ct.PaddingMode.ZERO,
                     latency=LAT).reshape((BLOCK_P, BLOCK_N))
        h = h.astype(ct.float32) + ct.where(f == 0.0, 0.0, f * hs)
    return h


def _state_term(acc, c, states, seg_entry, chunk_factor, batch, qblk, group, head, chunk,
                p_tile, n_tiles, BLOCK_Q: ct.Constant[int], BLOCK_P: ct.Constant[int],
                BLOCK_N: ct.Constant[int], SEGS: ct.Constant[int], LAT, in_dtype):
    """acc + C h^T over the n_tiles dstate tiles (C loaded for this product alone)."""
    for nt in range(n_tiles):
        c_t = ct.load(c, index=(batch, qblk, group, nt), shape=(1, BLOCK_Q, 1, BLOCK_N),
                      padding_mode=ct.PaddingMode.ZERO, latency=LAT).reshape((BLOCK_Q, BLOCK_N))
        h = _entry_state(states, seg_entry, chunk_factor, batch, head, chunk, p_tile, nt,
                         BLOCK_P, BLOCK_N, SEGS, LAT)
        acc = ct.mma(mma_operand(c_t, in_dtype), mma_operand(h.transpose(), in_dtype), acc)
    return acc


def _diag_tile_mma(
    b, c, states, seg_entry, chunk_factor, cb, acc, nt, batch, qblk, group, head, chunk, p_tile,
    BLOCK_Q: ct.Constant[int], BLOCK_P: ct.Constant[int], BLOCK_N: ct.Constant[int], LAT,
    in_dtype, SEGS: ct.Constant[int],
):
    """One dstate tile of C B^T (diagonal block) and of C h^T, sharing the C tile."""
    ZERO = ct.PaddingMode.ZERO
    c_t = ct.load(c, index=(batch, qblk, group, nt), shape=(1, BLOCK_Q, 1, BLOCK_N),
                  padding_mode=ZERO, latency=LAT).reshape((BLOCK_Q, BLOCK_N))
    bt = ct.load(b, index=(batch, qblk, group, nt), shape=(1, BLOCK_Q, 1, BLOCK_N),
                 padding_mode=ZERO, latency=LAT).reshape((BLOCK_Q, BLOCK_N))
    h = _entry_state(states, seg_entry, chunk_factor, batch, head, chunk, p_tile, nt, BLOCK_P,
                     BLOCK_N, SEGS, LAT)
    c_op = mma_operand(c_t, in_dtype)
    cb = ct.mma(c_op, mma_operand(bt.transpose(), in_dtype), cb)
    acc = ct.mma(c_op, mma_operand(h.transpose(), in_dtype), acc)
    return cb, acc


def _tile_acc(
    x, b, c, dt, cum, states, cbuf, seg_entry, chunk_factor, qblk, p_tile, batch, head, group,
    chunk, first_blk, g_q, row, state_scale, start_q, Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int], BLOCK_P: ct.Constant[int], NP: ct.Constant[int],
    HAS_SEQ: ct.Constant[bool], LAT, LOWP: ct.Constant[bool], BLOCK_N: ct.Constant[int],
    SANITIZE: ct.Constant[bool], CB_IN: ct.Constant[bool], SEGS: ct.Constant[int],
):
    """The tile's carried-state and masked (C B^T) X terms, fp32, before D x and the gate
    (SANITIZE: in the causal form, module docstring)."""
    ZERO = ct.PaddingMode.ZERO
    # dstate is walked in BLOCK_N tiles: with several tiles the loop lets the compiler
    # prefetch the next C/B/h tiles while the current MMAs run. cdiv(N, BLOCK_N), not
    # NP // BLOCK_N: a tile wholly past dstate would be an out-of-bounds load.
    n_tiles = ct.cdiv(c.shape[3], BLOCK_N)
    ONE_TILE = BLOCK_N == NP      # then no K loop at all: straight-line code, C loaded once
    acc = ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32)
    if CB_IN:
        # C B^T blocks from chunk_cb (formed once per chunk and group); C here only for the
        # carried-state term
        acc = _carried(_state_term(acc, c, states, seg_entry, chunk_factor, batch, qblk, group,
                                   head, chunk, p_tile, n_tiles, BLOCK_Q, BLOCK_P, BLOCK_N,
                                   SEGS, LAT, x.dtype), state_scale, start_q, HAS_SEQ)
        for kblk in range(first_blk, qblk + 1):
            cb = ct.load(cbuf, index=(batch, chunk, group, qblk - first_blk, kblk - first_blk),
                         shape=(1, 1, 1, BLOCK_Q, BLOCK_Q),
                         latency=LAT).reshape((BLOCK_Q, BLOCK_Q))
            acc = _add_key_block(acc, cb, kblk, qblk, g_q, row, start_q, x, dt, cum, batch,
                                 head, p_tile, BLOCK_Q, BLOCK_P, HAS_SEQ, LOWP, LAT, SANITIZE)
    elif BLOCK_Q == Q:
        # The chunk's only key block is the diagonal one: each C tile is loaded once and
        # feeds both the carried-state MMA and C B^T.
        cb = ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32)
        if ONE_TILE:
            cb, acc = _diag_tile_mma(b, c, states, seg_entry, chunk_factor, cb, acc, 0, batch,
                                     qblk, group, head, chunk, p_tile, BLOCK_Q, BLOCK_P,
                                     BLOCK_N, LAT, x.dtype, SEGS)
        else:
            for nt in range(n_tiles):
                cb, acc = _diag_tile_mma(b, c, states, seg_entry, chunk_factor, cb, acc, nt,
                                         batch, qblk, group, head, chunk, p_tile, BLOCK_Q,
                                         BLOCK_P, BLOCK_N, LAT, x.dtype, SEGS)
        acc = _carried(acc, state_scale, start_q, HAS_SEQ)
        acc = _add_key_block(acc, cb, qblk, qblk, g_q, row, start_q, x, dt, cum, batch, head,
                             p_tile, BLOCK_Q, BLOCK_P, HAS_SEQ, LOWP, LAT, SANITIZE)
    elif ONE_TILE:
        c_q = mma_operand(ct.load(c, index=(batch, qblk, group, 0),
                                  shape=(1, BLOCK_Q, 1, BLOCK_N), padding_mode=ZERO,
                                  latency=LAT).reshape((BLOCK_Q, BLOCK_N)), x.dtype)
        h = _entry_state(states, seg_entry, chunk_factor, batch, head, chunk, p_tile, 0,
                         BLOCK_P, BLOCK_N, SEGS, LAT)
        acc = _carried(ct.mma(c_q, mma_operand(h.transpose(), x.dtype), acc), state_scale,
                       start_q, HAS_SEQ)
        for kblk in range(first_blk, qblk + 1):
            bt = ct.load(b, index=(batch, kblk, group, 0), shape=(1, BLOCK_Q, 1, BLOCK_N),
                         padding_mode=ZERO, latency=LAT).reshape((BLOCK_Q, BLOCK_N))
            cb = ct.mma(c_q, mma_operand(bt.transpose(), x.dtype),
                        ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32))
            acc = _add_key_block(acc, cb, kblk, qblk, g_q, row, start_q, x, dt, cum, batch,
                                 head, p_tile, BLOCK_Q, BLOCK_P, HAS_SEQ, LOWP, LAT, SANITIZE)
    else:
        acc = _carried(_state_term(acc, c, states, seg_entry, chunk_factor, batch, qblk, group,
                                   head, chunk, p_tile, n_tiles, BLOCK_Q, BLOCK_P, BLOCK_N,
                                   SEGS, LAT, x.dtype), state_scale, start_q, HAS_SEQ)
        for kblk in range(first_blk, qblk + 1):
            cb = ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32)
            for nt in range(n_tiles):
                c_t = ct.load(c, index=(batch, qblk, group, nt),
                              shape=(1, BLOCK_Q, 1, BLOCK_N), padding_mode=ZERO,
                              latency=LAT).reshape((BLOCK_Q, BLOCK_N))
                bt = ct.load(b, index=(batch, kblk, group, nt), shape=(1, BLOCK_Q, 1, BLOCK_N),
                             padding_mode=ZERO, latency=LAT).reshape((BLOCK_Q, BLOCK_N))
                cb = ct.mma(mma_operand(c_t, x.dtype), mma_operand(bt.transpose(), x.dtype),
                            cb)
            acc = _add_key_block(acc, cb, kblk, qblk, g_q, row, start_q, x, dt, cum, batch,
                                 head, p_tile, BLOCK_Q, BLOCK_P, HAS_SEQ, LOWP, LAT, SANITIZE)
    return acc


def _skip(acc, xq, D, head, p_tile, BLOCK_P: ct.Constant[int], D_MODE: ct.Constant[int]):
    """Y + D x, D per head (D_MODE 1) or per (head, channel) (2); `xq` the float32 x tile. The
    one home of the skip term of every output launch (chunk_scan, chunk_scan_group,
    chunk_scan_walk)."""
    if D_MODE == 1:
        return acc + ct.load(D, index=(head,), shape=(1,)).reshape((1, 1)) * xq
    return acc + ct.load(D, index=(head, p_tile), shape=(1, BLOCK_P),
                         padding_mode=ct.PaddingMode.ZERO) * xq


def _gate(acc, z, batch, qblk, head, p_tile, BLOCK_Q: ct.Constant[int],
          BLOCK_P: ct.Constant[int], LAT: ct.Constant[int]):
    """Y * silu(z) over the (BLOCK_Q, BLOCK_P) tile at query block `qblk`: the z gate of every
    output launch."""
    zq = ct.load(z, index=(batch, qblk, head, p_tile), shape=(1, BLOCK_Q, 1, BLOCK_P),
                 padding_mode=ct.PaddingMode.ZERO, latency=LAT).reshape(
                     (BLOCK_Q, BLOCK_P)).astype(ct.float32)
    return acc * (zq / (1.0 + ct.exp(-zq)))


def _finite(t):
    """Whether the sum of the fp32 tile `t` is finite (False for NaN too)."""
    return ct.abs(ct.sum(t)) < float("inf")


def _scan_tile(
    x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor, out, qblk, p_tile,
    bh,
    Q: ct.Constant[int], BLOCK_Q: ct.Constant[int], BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int], HEADS_PER_GROUP: ct.Constant[int], D_MODE: ct.Constant[int],
    HAS_Z: ct.Constant[bool], HAS_SEQ: ct.Constant[bool], LOAD_LATENCY: ct.Constant[int],
    LOWP: ct.Constant[bool], BLOCK_N: ct.Constant[int], CB_IN: ct.Constant[bool],
    SEGS: ct.Constant[int], flags,
    CHECK: ct.Constant[int], SANITIZE: ct.Constant[bool],
):
    """One output tile: BLOCK_Q tokens (query block `qblk`) x BLOCK_P channels of one head
    (CHECK=1: and its count of non-finite outputs into `flags`; CHECK 3 / 5: the sum / the row
    sums of its accumulator)."""
    nheads = x.shape[2]
    batch = bh // nheads
    head = bh % nheads
    group = head // HEADS_PER_GROUP
    blocks_per_chunk = Q // BLOCK_Q
    chunk = qblk // blocks_per_chunk
    first_blk = chunk * blocks_per_chunk          # first key block of this chunk
    ZERO = ct.PaddingMode.ZERO
    LAT = None if LOAD_LATENCY == 0 else LOAD_LATENCY   # 0: the compiler decides

    g_q = ct.load(cum, index=(batch, head, qblk), shape=(1, 1, BLOCK_Q)).reshape((BLOCK_Q,))
    row = qblk * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)   # token index of each query
    state_scale = ct.exp2(g_q)
    start_q = row
    if HAS_SEQ:
        start_q = ct.load(seq_start, index=(batch, qblk),
                          shape=(1, BLOCK_Q)).reshape((BLOCK_Q,))
    acc = _tile_acc(x, b, c, dt, cum, states, cbuf, seg_entry, chunk_factor, qblk, p_tile,
                    batch, head, group, chunk, first_blk, g_q, row, state_scale, start_q, Q,
                    BLOCK_Q, BLOCK_P, NP, HAS_SEQ, LAT, LOWP, BLOCK_N, SANITIZE, CB_IN, SEGS)
    if CHECK == 3 or CHECK == 5:
        # before D x and the gate (their own row only); row sums first: a flat ct.sum of the
        # tile compiled to 54 shuffles against 9 (module docstring)
        n_q = ct.cdiv(x.shape[1], BLOCK_Q)
        n_p = ct.cdiv(x.shape[3], BLOCK_P)
        tile_id = (bh * n_q + qblk) * n_p + p_tile
        rows = ct.sum(acc, axis=1)
        if CHECK == 3:
            ct.store(flags, index=(tile_id, 0), tile=ct.sum(rows).reshape((1, 1)))
        else:
            ct.store(flags, index=(tile_id, 0), tile=rows.reshape((1, BLOCK_Q)))

    if D_MODE != 0:
        xq = ct.load(x, index=(batch, qblk, head, p_tile), shape=(1, BLOCK_Q, 1, BLOCK_P),
                     padding_mode=ZERO).reshape((BLOCK_Q, BLOCK_P)).astype(ct.float32)
        acc = _skip(acc, xq, D, head, p_tile, BLOCK_P, D_MODE)
    if HAS_Z:
        acc = _gate(acc, z, batch, qblk, head, p_tile, BLOCK_Q, BLOCK_P, LAT)
    ct.store(out, index=(batch, qblk, head, p_tile),
             tile=acc.reshape((1, BLOCK_Q, 1, BLOCK_P)).astype(out.dtype))
    if CHECK == 1:
        bad = ct.sum(ct.where(ct.abs(acc) < float("inf"), 0.0, 1.0))
        ct.store(flags, index=(bh, qblk, p_tile), tile=bad.reshape((1, 1, 1)))


def _scan_or_fix(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor, out,
                 qblk, p_tile, bh,
                 Q: ct.Constant[int], BLOCK_Q: ct.Constant[int], BLOCK_P: ct.Constant[int],
                 NP: ct.Constant[int], HEADS_PER_GROUP: ct.Constant[int],
                 D_MODE: ct.Constant[int], HAS_Z: ct.Constant[bool],
                 HAS_SEQ: ct.Constant[bool], LOAD_LATENCY: ct.Constant[int],
                 LOWP: ct.Constant[bool], BLOCK_N: ct.Constant[int], CB_IN: ct.Constant[bool],
                 SEGS: ct.Constant[int], flags,
                 CHECK: ct.Constant[int]):
    """CHECK 0, 1, 3, 5: the plain tile (and its flags); CHECK 2: the flagged tile again,
    sanitized."""
    if CHECK == 2:
        bad = ct.load(flags, index=(bh, qblk, p_tile), shape=(1, 1, 1)).reshape(())
        if bad > 0.0:
            _scan_tile(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor,
                       out, qblk, p_tile, bh, Q,
                       BLOCK_Q, BLOCK_P, NP, HEADS_PER_GROUP, D_MODE, HAS_Z, HAS_SEQ,
                       LOAD_LATENCY, LOWP, BLOCK_N, CB_IN, SEGS, flags, 0, True)
    else:
        _scan_tile(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor, out,
                   qblk, p_tile, bh, Q,
                   BLOCK_Q, BLOCK_P, NP, HEADS_PER_GROUP, D_MODE, HAS_Z, HAS_SEQ,
                   LOAD_LATENCY, LOWP, BLOCK_N, CB_IN, SEGS, flags, CHECK, False)


#: tiles whose flags one program of the CHECK 4 / 6 pass reads at once (a power of two): its
#: grid is cdiv(tiles, FIX_SPAN), so that on clean input it is one short wave (128 programs at
#: the seed problem's 8192 tiles of 64 tokens), where CHECK=2's program per tile ran 31 waves
#: of early exits at 2 CTAs per SM
FIX_SPAN = 64


def _fix_span(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor, out, span,
              Q: ct.Constant[int], BLOCK_Q: ct.Constant[int], BLOCK_P: ct.Constant[int],
              NP: ct.Constant[int], HEADS_PER_GROUP: ct.Constant[int],
              D_MODE: ct.Constant[int], HAS_Z: ct.Constant[bool],
              HAS_SEQ: ct.Constant[bool], LOAD_LATENCY: ct.Constant[int],
              LOWP: ct.Constant[bool], BLOCK_N: ct.Constant[int], CB_IN: ct.Constant[bool],
              SEGS: ct.Constant[int], flags,
              W: ct.Constant[int]):
    """CHECK 4 and 6: the tiles FIX_SPAN * span .. + FIX_SPAN - 1 (in flag order) whose sums
    (W of them each: 1 or BLOCK_Q) are not all finite, again in the causal form; one load
    and a sum when all are finite."""
    n_tiles = flags.shape[0]
    sums = ct.load(flags, index=(span, 0), shape=(FIX_SPAN, W),
                   padding_mode=ct.PaddingMode.ZERO)
    if not _finite(sums):
        n_q = ct.cdiv(x.shape[1], BLOCK_Q)
        n_p = ct.cdiv(x.shape[3], BLOCK_P)
        for i in range(FIX_SPAN):
            t = span * FIX_SPAN + i
            if t < n_tiles:
                if not _finite(ct.load(flags, index=(t, 0), shape=(1, W))):
                    rest = t // n_p
                    _scan_tile(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry,
                               chunk_factor, out, rest % n_q,
                               t % n_p, rest // n_q, Q, BLOCK_Q, BLOCK_P, NP, HEADS_PER_GROUP,
                               D_MODE, HAS_Z, HAS_SEQ, LOAD_LATENCY, LOWP, BLOCK_N, CB_IN, SEGS,
                               flags, 0,
                               True)


def _chunk_is_bad(x, b, dt, cum, batch, head, group, chunk, Q: ct.Constant[int],
                  BLOCK_P: ct.Constant[int], BLOCK_N: ct.Constant[int]):
    """Whether the chunk's x (every channel of the head), B (every state index of its group)
    or decay weights w = dt' 2^(G_last - G) hold a non-finite entry (chunk_state_pass's own
    term of the chunk, X^T (w B) over all its rows, is non-finite exactly then): the sum of
    their sums is not finite. A sum of finite entries overflows only past 3e38 (the chunk is
    then recomputed for nothing, to the same values)."""
    ZERO = ct.PaddingMode.ZERO
    dtt = ct.load(dt, index=(batch, head, chunk), shape=(1, 1, Q)).reshape((Q,))
    g = ct.load(cum, index=(batch, head, chunk), shape=(1, 1, Q)).reshape((Q,))
    g_last = ct.extract(g, index=(Q - 1,), shape=(1,))
    total = ct.sum(dtt * ct.exp2(g_last - g), axis=0, keepdims=True)
    for p_tile in range(ct.cdiv(x.shape[3], BLOCK_P)):
        xt = ct.load(x, index=(batch, chunk, head, p_tile), shape=(1, Q, 1, BLOCK_P),
                     padding_mode=ZERO).reshape((Q, BLOCK_P)).astype(ct.float32)
        total = total + ct.sum(ct.sum(xt, axis=1), axis=0, keepdims=True)
    for n_tile in range(ct.cdiv(b.shape[3], BLOCK_N)):
        bt = ct.load(b, index=(batch, chunk, group, n_tile), shape=(1, Q, 1, BLOCK_N),
                     padding_mode=ZERO).reshape((Q, BLOCK_N)).astype(ct.float32)
        total = total + ct.sum(ct.sum(bt, axis=1), axis=0, keepdims=True)
    return ct.where(ct.abs(total) < float("inf"), 0.0, 1.0).reshape(())


def _fix_chunks(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor, out,
                bh,
                Q: ct.Constant[int], BLOCK_Q: ct.Constant[int], BLOCK_P: ct.Constant[int],
                NP: ct.Constant[int], HEADS_PER_GROUP: ct.Constant[int],
                D_MODE: ct.Constant[int], HAS_Z: ct.Constant[bool],
                HAS_SEQ: ct.Constant[bool], LOAD_LATENCY: ct.Constant[int],
                LOWP: ct.Constant[bool], BLOCK_N: ct.Constant[int], CB_IN: ct.Constant[bool],
                SEGS: ct.Constant[int], flags,
                FLAG_W: ct.Constant[int], PER_TILE: ct.Constant[bool]):
    """CHECK 8: (batch, head) bh. When chunk_state_pass flagged any of its state programs
    (row bh of `flags`), each chunk whose inputs hold a non-finite value, every tile again in
    the causal form; one load and a sum when none is. CHECK 9 (PER_TILE): the program's own
    tile of each such chunk (grid axis 1: query block in the chunk x p-tile), so that no
    loop over tiles wraps the tile's code: sm_90 compiles of a quarter of the size and
    time (3.7-4.2 MB, 24-29 s -> 0.9-1.5 MB, 4-8 s at chunks 128 and 256, every option), at the
    price of that many more programs exiting at once on clean input."""
    marks = ct.load(flags, index=(bh, 0), shape=(1, FLAG_W), padding_mode=ct.PaddingMode.ZERO)
    if ct.sum(ct.sum(marks, axis=1), axis=0) > 0.0:
        nheads = x.shape[2]
        batch = bh // nheads
        head = bh % nheads
        group = head // HEADS_PER_GROUP
        nc = cum.shape[2] // Q
        n_q = ct.cdiv(x.shape[1], BLOCK_Q)
        n_p = ct.cdiv(x.shape[3], BLOCK_P)
        nbpc = Q // BLOCK_Q
        for chunk in range(nc):
            if _chunk_is_bad(x, b, dt, cum, batch, head, group, chunk, Q, BLOCK_P,
                             BLOCK_N) > 0.0:
                if PER_TILE:
                    qblk = chunk * nbpc + ct.bid(1) // n_p
                    if qblk < n_q:
                        _scan_tile(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry,
                                   chunk_factor, out, qblk,
                                   ct.bid(1) % n_p, bh, Q, BLOCK_Q, BLOCK_P, NP,
                                   HEADS_PER_GROUP, D_MODE, HAS_Z, HAS_SEQ, LOAD_LATENCY, LOWP,
                                   BLOCK_N, CB_IN, SEGS, flags, 0, True)
                else:
                    q_end = ct.minimum(chunk * nbpc + nbpc, n_q)
                    for qblk in range(chunk * nbpc, q_end):
                        for p_tile in range(n_p):
                            _scan_tile(x, b, c, z, D, dt, cum, seq_start, states, cbuf,
                                       seg_entry, chunk_factor, out, qblk,
                                       p_tile, bh, Q, BLOCK_Q, BLOCK_P, NP, HEADS_PER_GROUP,
                                       D_MODE, HAS_Z, HAS_SEQ, LOAD_LATENCY, LOWP, BLOCK_N,
                                       CB_IN, SEGS, flags, 0, True)


def chunk_scan_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N)
    c,           # (B, L, G, N)
    z,           # (B, L, H, P) (ignored unless HAS_Z)
    D,           # (H,) or (H, P) float32 per D_MODE
    dt,          # (B, H, Lp) float32
    cum,         # (B, H, Lp) float32
    seq_start,   # (B, Lp) int32: where each token's sequence run begins in its chunk, -1 before
                 # it (decay_cumsum; ignored unless HAS_SEQ)
    states,      # (B, H, C, P, N) entry state of each chunk
    cbuf,        # (B, C, G, Q, Q) float32: C B^T per chunk and group (chunk_cb; read if CB_IN)
    seg_entry,   # (B, H, SEGS, P, N) float32: the state entering each segment of the state
                 # pass (chunk_state_carry, ENTRY_ONLY; read if SEGS > 1)
    chunk_factor,  # (B, H, C) float32: f_c of the segmented state pass (read if SEGS > 1)
    out,         # (B, L, H, P)
    Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    D_MODE: ct.Constant[int],     # 0: no D, 1: per head, 2: per (head, channel)
    HAS_Z: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOAD_LATENCY: ct.Constant[int],
    PERSISTENT: ct.Constant[bool],
    LOWP: ct.Constant[bool],      # the (C B^T) X MMA in the input dtype instead of tf32
    HEAD_MAJOR: ct.Constant[bool],
    BLOCK_N: ct.Constant[int],    # dstate tile (divides NP)
    CB_IN: ct.Constant[bool],     # C B^T blocks read from cbuf, not formed here
    SEGS: ct.Constant[int],       # > 1: `states` holds the segments' local states l_c; the
                                  # entry state is l_c + f_c H_s (ForwardConfig.segment_fold)
    FLAG_W: ct.Constant[int],     # CHECK 8: flag columns read per head (a power of two)
    flags,       # float32, read/written per CHECK: (B * H, cdiv(L, BLOCK_Q), cdiv(P, BLOCK_P))
                 # for 1 and 2; (B * H * cdiv(L, BLOCK_Q) * cdiv(P, BLOCK_P), W) for 3 to 6,
                 # W = 1 (3, 4) or BLOCK_Q (5, 6); 8: (B * H, state tiles * segments)
    CHECK: ct.Constant[int],      # 0 plain, 1 plain + count, 2 counted tiles again, sanitized;
                                  # 3/5 plain + tile/row sums, 4/6 the FIX_SPAN pass over them;
                                  # 8 the pass over chunk_state_pass's head flags (9: a
                                  # program per tile of the chunk)
):
    # Query blocks run to cdiv(L, BLOCK_Q) only: a block past the last token would load
    # tiles lying entirely outside x, which is undefined.
    n_q = ct.cdiv(x.shape[1], BLOCK_Q)
    n_bh = x.shape[0] * x.shape[2]
    if CHECK == 4 or CHECK == 6:
        # its own grid, (cdiv(tiles, FIX_SPAN),): PERSISTENT and HEAD_MAJOR do not apply
        _fix_span(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor, out,
                  ct.bid(0), Q, BLOCK_Q,
                  BLOCK_P, NP, HEADS_PER_GROUP, D_MODE, HAS_Z, HAS_SEQ, LOAD_LATENCY, LOWP,
                  BLOCK_N, CB_IN, SEGS, flags, 1 if CHECK == 4 else BLOCK_Q)
    elif CHECK == 8 or CHECK == 9:
        # its own grid, (B * H,) for 8, (B * H, Q / BLOCK_Q * p-tiles) for 9
        _fix_chunks(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor, out,
                    ct.bid(0), Q, BLOCK_Q,
                    BLOCK_P, NP, HEADS_PER_GROUP, D_MODE, HAS_Z, HAS_SEQ, LOAD_LATENCY, LOWP,
                    BLOCK_N, CB_IN, SEGS, flags, FLAG_W, CHECK == 9)
    elif PERSISTENT:
        # a fixed grid walks the tiles, so the loads of the next tile overlap this one's math
        n_p = ct.cdiv(x.shape[3], BLOCK_P)
        for t in range(ct.bid(0), n_q * n_p * n_bh, ct.num_blocks(0)):
            if HEAD_MAJOR:
                # programs running together share the B and C tiles of one query block
                bh = t % n_bh
                rest = t // n_bh
                p_tile, qblk = rest % n_p, rest // n_p
            else:
                qblk = t % n_q
                rest = t // n_q
                p_tile, bh = rest % n_p, rest // n_p
            _scan_or_fix(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor,
                         out, qblk, p_tile, bh, Q,
                         BLOCK_Q, BLOCK_P, NP, HEADS_PER_GROUP, D_MODE, HAS_Z, HAS_SEQ,
                         LOAD_LATENCY, LOWP, BLOCK_N, CB_IN, SEGS, flags, CHECK)
    else:
        # grid (n_q * B * H, p tiles): batch*heads on axis 0 has no 65535 limit
        t = ct.bid(0)
        if HEAD_MAJOR:
            # neighbouring programs are the heads of one query block: they share B and C
            qblk, bh = t // n_bh, t % n_bh
        else:
            qblk, bh = t % n_q, t // n_q
        _scan_or_fix(x, b, c, z, D, dt, cum, seq_start, states, cbuf, seg_entry, chunk_factor,
                     out, qblk, ct.bid(1), bh, Q,
                     BLOCK_Q, BLOCK_P, NP, HEADS_PER_GROUP, D_MODE, HAS_Z, HAS_SEQ,
                     LOAD_LATENCY, LOWP, BLOCK_N, CB_IN, SEGS, flags, CHECK)

chunk_scan = ct.kernel(chunk_scan_fn)
chunk_scan_i64 = ct.kernel(int64_variant(
    chunk_scan_fn, ["x", "b", "c", "z", "D", "dt", "cum", "seq_start", "states", "cbuf",
                    "seg_entry", "chunk_factor", "out", "flags"]))
