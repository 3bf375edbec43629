"""Kernel 2 of the forward pass: the sequential pass over chunks (chunk entry states).

For chunk c with tokens t (log2 decays G_t from decay_cumsum, G_last its last entry):

    h_{c+1} = 2^{G_last} * h_c + sum_t 2^{G_last - G_t} * dt_t * x_t (outer) B_t

computed as one tensor-core MMA  X^T (BLOCK_P x Q) @ (w * B) (Q x BLOCK_N).
Writes h_c (the state *entering* chunk c) for every chunk, and the final state after the last.

seq_idx: a token only contributes if it belongs to the sequence of the chunk's last token, and
the carried state is dropped when that sequence differs from the one the carry belongs to.
(Non-decreasing seq_idx makes this the exact reset of the recurrence.) Both are selects, not
multiplications by 0: a sequence that holds a NaN or Inf must not reach the next one's state
(0 * NaN is NaN), so the dropped tokens' x and B rows and the dropped carry are replaced by 0.
Without seq_idx nothing is dropped, and a bad token reaches every later state, as in the
recurrence.

Grid: (B * H, cdiv(P, BLOCK_P), cdiv(N, BLOCK_N)). The chunk loop is sequential inside a
program; independent (batch, head, p-tile, n-tile) slices run in parallel.

SEGMENTS > 1 splits the chunk loop into SEGMENTS runs (chunks floor(C s / S) up to
floor(C (s + 1) / S), lengths within one chunk of each other) that run in parallel (grid axis 2: n-tiles x SEGMENTS), because the sequential loop is latency-bound when
B * H * tiles programs do not fill the GPU several times over. Segment s > 0 starts from a
zero state (segment 0 from init), so it writes the local entry states l_c; by linearity the
true ones are

    h_c = l_c + f_c * H_s,    f_c = prod over chunks c' in [start_s, c) of 2^{G_last(c')}

(0 from a chunk where the carried state is dropped: a seq_idx reset), with H_s the state
entering segment s. The segment's programs write f_c (chunk_factor, one program per (b, h)),
their end state (seg_final) and the end factor (seg_factor); `chunk_state_carry` then forms
H_s, adds f_c H_s to the states of segments s >= 1 and writes the final state. Rounding: l_c
is rounded to the state dtype before H_s is added (twice in all, against once).

SEG_MODE (ForwardConfig.state_resweep): 1 runs the segments for their end states E_s and
factors F_s only (no state written), `chunk_state_carry` then forms the entering states H_s
into seg_entry, and 2 runs them again from H_s (segment 0 from init), writing the true h_c
(rounded once) and the flags: the inputs are read twice instead of the states being
rewritten (or added in the output launch, segment_fold).

FLAG (ForwardConfig.scan_causal=4): whether any chunk of the program's run holds a
non-finite x, B or dt', for chunk_scan's pass over flagged heads (kernels/chunk_scan.py,
CHECK=8, which then finds the chunks). A chunk's own term of the update, X^T (w B) over its
tokens, holds a non-finite entry whenever one of them does (0 * NaN is NaN; rounding or an
overflow can flag a clean chunk, which only costs a search), and without seq_idx such an
entry stays in the carried state to the end of the run (2^G h + u is non-finite once h or u
is: 0 * Inf is NaN too), so one tile sum of the run's last state, after the loop, is the
flag (a sum of finite entries overflows only past 3e38: the head is then searched for
nothing; a non-finite initial state flags too). With seq_idx a reset drops the state, so the
own terms are added elementwise into a tile over the run instead, and a chunk where a
sequence ends adds its raw term too, X^T (w B) over all its rows (the rows the select drops
never reach the state, but reach the scan's masked products). One float per program in
`flags` (B * H, p-tiles * n-tiles * SEGMENTS): 1.0 flagged, 0.0 not. No reduction runs in
the loop: a tile sum per chunk cost the seed problem's state pass 0.114 -> 0.125 ms (H100),
and reductions inside the loop, even every 8 chunks or only where a sequence ends, compiled
to another pipeline (209 or 89 KB of shared memory against 151 and 128 KB).
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand, state_segment


def _nonfinite(t):
    """Whether the 2-d tile t holds a non-finite entry (NaN too), as a (1,) 1.0 / 0.0 (a sum
    is non-finite iff a term is, or it overflows: then a clean chunk is recomputed for
    nothing, to the same values); row sums first."""
    total = ct.sum(ct.sum(t.astype(ct.float32), axis=1), axis=0, keepdims=True)
    return ct.where(ct.abs(total) < float("inf"), 0.0, 1.0)


def _update(hid, pending, carry, xt, bt, w, in_dtype, BLOCK_P: ct.Constant[int],
            BLOCK_N: ct.Constant[int], SCALE_X: ct.Constant[bool], FRESH_ACC: ct.Constant[bool],
            FLAG: ct.Constant[bool], HAS_SEQ: ct.Constant[bool]):
    """h <- carry * h + X^T (w B), one MMA; and (FLAG with seq_idx) the chunk's own term
    X^T (w B) added to `pending`, the run's sum of them."""
    # the weights go on the smaller operand: (w X)^T B == X^T (w B), one rounding either way
    if SCALE_X:
        lhs = mma_operand(xt.astype(ct.float32) * w[:, None], in_dtype).transpose()
        rhs = mma_operand(bt, in_dtype)
    else:
        lhs = mma_operand(xt.transpose(), in_dtype)
        rhs = mma_operand(bt.astype(ct.float32) * w[:, None], in_dtype)
    if FRESH_ACC or FLAG:
        # the MMA does not wait for the carried state: only a multiply-add is sequential
        upd = ct.mma(lhs, rhs, ct.full((BLOCK_P, BLOCK_N), 0.0, dtype=ct.float32))
        if FLAG:
            if HAS_SEQ:
                pending = pending + upd
        return hid * carry[:, None] + upd, pending
    return ct.mma(lhs, rhs, hid * carry[:, None]), pending


def chunk_state_pass_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N)
    dt,          # (B, H, Lp) float32, from decay_cumsum
    cum,         # (B, H, Lp) float32, from decay_cumsum
    init,        # (B, H, P, N) float32 (ignored unless HAS_INIT)
    seq_idx,     # (B, L) int32 (ignored unless HAS_SEQ)
    states,      # (B, H, C, P, N) state dtype: entry state of each chunk
    final,       # (B, H, P, N) float32
    Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    BLOCK_N: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    HAS_INIT: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOAD_LATENCY: ct.Constant[int],
    SCALE_X: ct.Constant[bool],
    FRESH_ACC: ct.Constant[bool],
    SEGMENTS: ct.Constant[int],
    seg_final,   # (B, H, SEGMENTS, P, N) float32: each segment's end state from its own start
    seg_factor,  # (B, H, SEGMENTS) float32: the factor of the state entering it at its end
    chunk_factor,  # (B, H, C) float32: f_c
    flags,       # (B * H, p-tiles * n-tiles * SEGMENTS) float32: runs with a non-finite term
    FLAG: ct.Constant[bool],
    seg_entry,   # (B, H, SEGMENTS, P, N) float32: the state entering each run (SEG_MODE 2)
    SEG_MODE: ct.Constant[int],   # (SEGMENTS > 1) 0: local entry states l_c, f_c, the runs'
                                  # ends; 1: the runs' ends only; 2: the true entry states,
                                  # each run from seg_entry (segment 0 from init)
):
    bh, p_tile = ct.bid(0), ct.bid(1)
    LAT = None if LOAD_LATENCY == 0 else LOAD_LATENCY   # 0: the compiler decides
    nheads = x.shape[2]
    batch = bh // nheads
    head = bh % nheads
    group = head // HEADS_PER_GROUP
    seqlen = x.shape[1]
    num_chunks = cum.shape[2] // Q
    n_tile = ct.bid(2)
    seg = 0
    c_begin = 0
    c_end = num_chunks
    if SEGMENTS > 1:
        n_tile, seg, c_begin, c_end = state_segment(b.shape[3], BLOCK_N, num_chunks,
                                                    SEGMENTS)
        writer = p_tile + n_tile == 0           # f_c is the same for every tile: one writes it
        factor = ct.full((1,), 1.0, dtype=ct.float32)

    hid = ct.full((BLOCK_P, BLOCK_N), 0.0, dtype=ct.float32)
    if HAS_INIT:
        if seg == 0:                            # later segments start from zero
            hid = ct.load(init, index=(batch, head, p_tile, n_tile),
                          shape=(1, 1, BLOCK_P, BLOCK_N),
                          padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_P, BLOCK_N))
            hid = hid.astype(ct.float32)
    if SEGMENTS > 1:
        if SEG_MODE == 2:
            if seg > 0:
                hid = ct.load(seg_entry, index=(batch, head, seg, p_tile, n_tile),
                              shape=(1, 1, 1, BLOCK_P, BLOCK_N),
                              padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_P, BLOCK_N))
    pending = ct.full((1, 1), 0.0, dtype=ct.float32)
    if FLAG:
        if HAS_SEQ:
            pending = ct.full((BLOCK_P, BLOCK_N), 0.0, dtype=ct.float32)
    # the sequence the carried state belongs to: the row's first one at the start
    seq_prev = ct.full((1,), 0, dtype=ct.int32)
    if HAS_SEQ:
        seq_prev = ct.load(seq_idx, index=(batch, 0), shape=(1, 1)).reshape((1,))
        if SEGMENTS > 1:
            if c_begin > 0:
                # the chunk before the segment: its last sequence, as the sequential loop
                # carries it (the max over its tokens, all real: it is not the last chunk)
                s_prev = ct.load(seq_idx, index=(batch, c_begin - 1), shape=(1, Q),
                                 padding_mode=ct.PaddingMode.ZERO).reshape((Q,))
                seq_prev = ct.max(s_prev, axis=0, keepdims=True)

    for c in range(c_begin, c_end):
        if SEGMENTS == 1 or SEG_MODE != 1:
            ct.store(states, index=(batch, head, c, p_tile, n_tile),
                     tile=hid.reshape((1, 1, 1, BLOCK_P, BLOCK_N)).astype(states.dtype))
        if SEGMENTS > 1:
            if SEG_MODE == 0:
                if writer:
                    ct.store(chunk_factor, index=(batch, head, c),
                             tile=factor.reshape((1, 1, 1)))
        xt = ct.load(x, index=(batch, c, head, p_tile), shape=(1, Q, 1, BLOCK_P),
                     padding_mode=ct.PaddingMode.ZERO,
                     latency=LAT).reshape((Q, BLOCK_P))
        bt = ct.load(b, index=(batch, c, group, n_tile), shape=(1, Q, 1, BLOCK_N),
                     padding_mode=ct.PaddingMode.ZERO,
                     latency=LAT).reshape((Q, BLOCK_N))
        dtt = ct.load(dt, index=(batch, head, c), shape=(1, 1, Q)).reshape((Q,))
        g = ct.load(cum, index=(batch, head, c), shape=(1, 1, Q)).reshape((Q,))
        g_last = ct.extract(g, index=(Q - 1,), shape=(1,))
        w = dtt * ct.exp2(g_last - g)
        carry = ct.exp2(g_last)
        if HAS_SEQ:
            token = c * Q + ct.arange(Q, dtype=ct.int32)
            s = ct.load(seq_idx, index=(batch, c), shape=(1, Q),
                        padding_mode=ct.PaddingMode.ZERO).reshape((Q,))
            s_last = ct.max(ct.where(token < seqlen, s, -2147483647), axis=0, keepdims=True)
            in_last = s == s_last
            w_raw = w
            w = ct.where(in_last, w, 0.0)
            hid = ct.where(seq_prev == s_last, hid, 0.0)
            if SEGMENTS > 1:
                factor = ct.where(seq_prev == s_last, factor, 0.0)
            seq_prev = s_last
            if (ct.extract(s, index=(0,), shape=(1,)) != s_last).reshape(()):
                # a sequence ends inside this chunk (rare): its x and B rows are selected
                # away, which costs a pass of both tiles through registers
                xs = ct.load(x, index=(batch, c, head, p_tile), shape=(1, Q, 1, BLOCK_P),
                             padding_mode=ct.PaddingMode.ZERO).reshape((Q, BLOCK_P))
                bs = ct.load(b, index=(batch, c, group, n_tile), shape=(1, Q, 1, BLOCK_N),
                             padding_mode=ct.PaddingMode.ZERO).reshape((Q, BLOCK_N))
                if FLAG:
                    # the dropped rows too: they stay out of the state, not out of the scan's
                    # masked products (an MMA, not a reduction, in the loop)
                    _, pending = _update(hid, pending, carry, xs, bs, w_raw, x.dtype, BLOCK_P,
                                         BLOCK_N, SCALE_X, FRESH_ACC, FLAG, HAS_SEQ)
                xs = ct.where(in_last[:, None], xs, 0.0).astype(x.dtype)
                bs = ct.where(in_last[:, None], bs, 0.0).astype(b.dtype)
                hid, pending = _update(hid, pending, carry, xs, bs, w, x.dtype, BLOCK_P,
                                       BLOCK_N, SCALE_X, FRESH_ACC, FLAG, HAS_SEQ)
            else:
                hid, pending = _update(hid, pending, carry, xt, bt, w, x.dtype, BLOCK_P,
                                       BLOCK_N, SCALE_X, FRESH_ACC, FLAG, HAS_SEQ)
        else:
            hid, pending = _update(hid, pending, carry, xt, bt, w, x.dtype, BLOCK_P, BLOCK_N,
                                   SCALE_X, FRESH_ACC, FLAG, HAS_SEQ)
        if SEGMENTS > 1:
            factor = factor * carry

    if FLAG:
        flag_col = (p_tile * ct.cdiv(b.shape[3], BLOCK_N) + n_tile) * SEGMENTS + seg
        bad = _nonfinite(hid)
        if HAS_SEQ:
            bad = _nonfinite(pending)
        ct.store(flags, index=(bh, flag_col), tile=bad.reshape((1, 1)))
    if SEGMENTS > 1:
        if SEG_MODE != 2:                       # (2: chunk_state_carry wrote the final state)
            ct.store(seg_final, index=(batch, head, seg, p_tile, n_tile),
                     tile=hid.reshape((1, 1, 1, BLOCK_P, BLOCK_N)))
            if writer:
                ct.store(seg_factor, index=(batch, head, seg),
                         tile=factor.reshape((1, 1, 1)))
    else:
        ct.store(final, index=(batch, head, p_tile, n_tile),
                 tile=hid.reshape((1, 1, BLOCK_P, BLOCK_N)))


chunk_state_pass = ct.kernel(chunk_state_pass_fn)
chunk_state_pass_i64 = ct.kernel(int64_variant(
    chunk_state_pass_fn, ["x", "b", "dt", "cum", "init", "seq_idx", "states", "final",
                          "seg_final", "seg_factor", "chunk_factor", "flags", "seg_entry"]))
