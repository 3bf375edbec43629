"""Causal depthwise conv1d forward, form 3 ("row streaming", channel-last x): the math of
`causal_conv1d_fwd`,

    pre[t]   = bias[c] + sum_{k<W} w[c, k] * e(t-(W-1)+k) * [id(t-(W-1)+k) == id(t)]
    out[t]   = act(pre[t]) (identity or SiLU: pre * sigmoid(pre)), 0 where id(t) < 0
    final[j] = e(l-(W-1)+j) * [id(l-(W-1)+j) == id(l-1)]        (j < W-1)

e(u) is x, the initial states at u = -(W-1)..-1, zero before and past the end; id(u < 0) is
the row's first id, id(0).

Layout of the work: each input row crosses L2 -> SM once. A program owns BLOCK_D channels of
one batch row and `span` consecutive tokens s0 .. s0+span-1; it walks them ROWS at a time and
carries the last W-1 input rows (float32, (1, BLOCK_D) each) and their ids from row to row, so
that tap k of token t is a register it already holds, not a reload of a shifted tile (form 1
issues W overlapping tile loads per block, W+1 passes of L2 -> SM traffic). Per span the
W-1 rows before s0 are read again (the halo; W-1 rows per span: 0.6% at 512, 4.7% at 64).

- Every row is a (1, BLOCK_D) tile and every tap, weight and output row has that one shape, so
  the whole per-token computation is elementwise on one register layout. ROW_TILE = 0 loads
  each of a step's ROWS rows as its own (1, BLOCK_D) tile and stores each output row (sm_90
  SASS, bf16, BLOCK_D = 256 at 4 warps: one 4-byte LDG and one STG per row and thread, no
  SHFL, LDS or STS in the loop); ROW_TILE = 1 loads the step as one (ROWS, BLOCK_D) tile,
  takes the rows out with `ct.extract` and stores one tile assembled with `ct.cat` (fewer
  memory instructions, but the compiler moves the rows through shared memory: 17 KB, LDS /
  STS / BAR per step).
- Full steps (all ROWS tokens inside the sequence) are straight-line code over the ROWS rows:
  the loads can all be in flight before the first is used. With UNCHECKED (the launcher's
  promise that BLOCK_D divides dim, and tileiras 13.4+) their loads and stores skip the
  bounds checks. The sequence's last, partial step branches per row on t < seqlen (no load
  or store of a row past the end).
- The halo of the first span comes from initial_states (a gather per row) or is zero: no
  head copy is built. The final states are W-1 rows of x (or of the initial
  states, when seqlen < W-1), written by the program holding the last token.
- PREFETCH: the loads of the next full step are issued before the current step's math and
  carried into the next iteration (software pipelining by hand: 2 x ROWS rows in flight per
  thread while it computes, where without it the loads wait for the previous step's stores).
- SILU: 0 no activation, 1 SiLU in IEEE float32 (float32 outputs), 2 SiLU through the
  approximate exp2 and reciprocal (16-bit outputs, whose rounding, 2^-9 or 2^-12, dwarfs
  their ~2^-21): at 4.3 TB/s an SM must finish ~4 elements a clock, and the IEEE division
  and expf tripled the kernel's FFMAs (sm_90 SASS: 428 against 128).
- Grid: (cdiv(dim, BLOCK_D), cdiv(seqlen, span), batch). `span` is a run-time int32 (one
  compile serves every span, so the launcher can pick any span per shape, e.g. one that makes
  the grid fill whole waves of CTA slots, see `conv1d.plan.rows_span`): any multiple of ROWS
  that is at least W-1 (so the halo of a span s0 > 0 lies inside x). The full steps index
  views of x and out that start at s0 (see `_fwd_rows`). sm_90 registers (bf16, bias + SiLU,
  width 4, BLOCK_D 256, ROWS 8, CPU compile): 80, 6 CTAs per SM (a compile-time span gave
  72, 7 per SM); under the occupancy-8 hint, which the launcher gives 16-bit inputs with
  32-bit indexing by default, 64 and 8 per SM (63 at a compile-time span), no spills (the
  float32 and 64-bit variants spill under it: they run unhinted).
"""

import cuda.tile as ct

from ._common import int64_variant
from ._common import sigmoid as _sigmoid
from .causal_conv1d_common import raw_slice_tile, weight_rows_plain


def load_row(t, b, row, d_blk, BLOCK_D: ct.Constant[int], UNCHECKED: ct.Constant[bool]):
    """Token `row` of the channel-last (batch, seqlen, dim) tensor t at channel block d_blk,
    as (1, BLOCK_D) in t's dtype (channels past dim are zero; 0 <= row < seqlen). A plain
    load: TMA for one row would add a producer warp group for nothing."""
    if UNCHECKED:
        tile = ct.load(t, index=(b, row, d_blk), shape=(1, 1, BLOCK_D), allow_tma=False,
                       check_bounds=False)
    else:
        tile = ct.load(t, index=(b, row, d_blk), shape=(1, 1, BLOCK_D),
                       padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
    return tile.reshape((1, BLOCK_D))


def store_row(t, b, row, d_blk, value, BLOCK_D: ct.Constant[int],
              UNCHECKED: ct.Constant[bool]):
    """value (1, BLOCK_D) stored as token `row` of the channel-last tensor t (0 <= row <
    seqlen), cast to t's dtype."""
    ct.store(t, index=(b, row, d_blk), tile=value.astype(t.dtype).reshape((1, 1, BLOCK_D)),
             allow_tma=False, check_bounds=not UNCHECKED)


def load_id(seq_idx, b, row):
    """id(row) as a (1, 1) int32 tile, 0 <= row < seqlen."""
    return ct.load(seq_idx, index=(b, row), shape=(1, 1), allow_tma=False)


def load_state_row(states, b, j, d_blk, BLOCK_D: ct.Constant[int]):
    """Column j of states (batch, dim, W-1) at the channel block as (1, BLOCK_D) float32 (a
    gather, whose result takes the layout of its (1, BLOCK_D) index: no layout conversion,
    where a (1, BLOCK_D, 1) tile load reshaped goes through shared memory)."""
    c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
    return ct.gather(states, (b, c, j)).astype(ct.float32)


def store_state_row(states, b, j, d_blk, value, BLOCK_D: ct.Constant[int]):
    """value (1, BLOCK_D) into column j of states (batch, dim, W-1) (a scatter; channels past
    dim are dropped)."""
    c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
    ct.scatter(states, (b, c, j), value.astype(states.dtype))


def halo_rows(x, init, seq_idx, b, s0, d_blk, WIDTH: ct.Constant[int],
              BLOCK_D: ct.Constant[int], HAS_INIT: ct.Constant[bool],
              HAS_SEQ: ct.Constant[bool]):
    """(e(s0-(W-1)+j) as (1, BLOCK_D) float32, id(s0-(W-1)+j) as (1, 1)) for j < W-1, as two
    tuples (the ids one empty without seq_idx); s0 is a span start (a multiple of the span,
    which is >= W-1, so s0 > 0 means every halo row is inside x)."""
    xs = ()
    ids = ()
    if s0 == 0:
        first = ct.full((1, 1), 0, dtype=ct.int32)
        if HAS_SEQ:
            first = load_id(seq_idx, b, 0)
        for j in ct.static_iter(range(WIDTH - 1)):
            if HAS_INIT:
                xs += (load_state_row(init, b, j, d_blk, BLOCK_D),)
            else:
                xs += (ct.full((1, BLOCK_D), 0.0, dtype=ct.float32),)
            if HAS_SEQ:
                ids += (first,)
    else:
        for j in ct.static_iter(range(WIDTH - 1)):
            u = s0 - (WIDTH - 1) + j
            xs += (load_row(x, b, u, d_blk, BLOCK_D, False).astype(ct.float32),)
            if HAS_SEQ:
                ids += (load_id(seq_idx, b, u),)
    return xs, ids


def conv_row(xs, ids, xt, idt, wts, bias_row, WIDTH: ct.Constant[int],
             HAS_SEQ: ct.Constant[bool]):
    """pre(t) as (1, BLOCK_D) float32 from the W-1 carried rows xs (tokens t-(W-1)..t-1, ids
    `ids`) and row t (xt float32, id idt); taps summed in k order."""
    acc = bias_row
    for k in ct.static_iter(range(WIDTH - 1)):
        tap = xs[k]
        if HAS_SEQ:
            tap = ct.where(ids[k] == idt, tap, 0.0)
        acc = acc + wts[k] * tap
    return acc + wts[WIDTH - 1] * xt


def shift(carried, new, WIDTH: ct.Constant[int]):
    """The carried W-1 rows without the oldest and with `new` appended."""
    moved = ()
    for k in ct.static_iter(range(1, WIDTH - 1)):
        moved += (carried[k],)
    return moved + (new,)


def sigmoid(p, SILU: ct.Constant[int]):
    """1 / (1 + exp(-p)): IEEE float32 at SILU = 1, the approximate form at SILU = 2
    (`_common.sigmoid`)."""
    return _sigmoid(p, SILU == 2)


def _activate(acc, idt, HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[int]):
    if SILU == 2:
        acc = acc * sigmoid(acc, SILU)
    elif SILU == 1:
        acc = acc / (1.0 + ct.exp(-acc))
    if HAS_SEQ:
        acc = ct.where(idt >= 0, acc, 0.0)
    return acc


def cat_rows(rows, ROWS: ct.Constant[int]):
    """The ROWS (1, BLOCK_D) tiles of `rows` stacked into (ROWS, BLOCK_D): a balanced tree of
    `ct.cat` (which joins equal shapes only), level by level (ROWS <= 64)."""
    level = rows
    for lvl in ct.static_iter(range(6)):
        if (ROWS >> lvl) > 1:
            joined = ()
            for i in ct.static_iter(range(ROWS >> (lvl + 1))):
                joined += (ct.cat((level[2 * i], level[2 * i + 1]), 0),)
            level = joined
    return level[0]


def step_loads(x, b, start, d_blk, ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
               ROW_TILE: ct.Constant[bool], UNCHECKED: ct.Constant[bool]):
    """The ROWS tokens from `start` (all inside the sequence) in x's dtype: one (ROWS,
    BLOCK_D) tile (ROW_TILE: a slice load, so `start` needs no alignment), else a tuple of
    ROWS (1, BLOCK_D) rows."""
    if ROW_TILE:
        raw = raw_slice_tile(x, b, start, x.shape[1], d_blk, ROWS, BLOCK_D, True, False,
                             UNCHECKED)
    else:
        raw = ()
        for i in ct.static_iter(range(ROWS)):
            raw += (load_row(x, b, start + i, d_blk, BLOCK_D, UNCHECKED),)
    return raw


def next_step_loads(x, b, start, d_blk, ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
                    ROW_TILE: ct.Constant[bool], UNCHECKED: ct.Constant[bool]):
    """`step_loads` of a step that may lie (partly) past the end (a prefetch): the tokens are
    clamped to the last one, so every load is in bounds and no branch guards them (a branch
    let the compiler sink the loads below the math they were meant to overlap). The clamped
    rows are never used: a step is consumed only when it is full. Needs seqlen >= ROWS."""
    seqlen = x.shape[1]
    if ROW_TILE:
        raw = raw_slice_tile(x, b, ct.minimum(start, seqlen - ROWS), seqlen, d_blk, ROWS,
                             BLOCK_D, True, False, UNCHECKED)
    else:
        raw = ()
        for i in ct.static_iter(range(ROWS)):
            raw += (load_row(x, b, ct.minimum(start + i, seqlen - 1), d_blk, BLOCK_D,
                             UNCHECKED),)
    return raw


def no_step(x, ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
            ROW_TILE: ct.Constant[bool]):
    """`step_loads`' structure filled with zeros (a prefetch slot before its first load)."""
    if ROW_TILE:
        raw = ct.full((ROWS, BLOCK_D), 0, dtype=x.dtype)
    else:
        raw = ()
        for i in ct.static_iter(range(ROWS)):
            raw += (ct.full((1, BLOCK_D), 0, dtype=x.dtype),)
    return raw


def step_rows(raw, ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
              ROW_TILE: ct.Constant[bool]):
    """The ROWS (1, BLOCK_D) rows of a `step_loads` result."""
    if ROW_TILE:
        rows = ()
        for i in ct.static_iter(range(ROWS)):
            rows += (ct.extract(raw, (i, 0), shape=(1, BLOCK_D)),)
    else:
        rows = raw
    return rows


def _full_step(raw, seq_idx, out_span, wts, bias_row, xs, ids, b, t0, r0, d_blk,
               WIDTH: ct.Constant[int], ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
               HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[int],
               ROW_TILE: ct.Constant[bool], UNCHECKED: ct.Constant[bool]):
    """Tokens t0 .. t0+ROWS-1, all inside the sequence, loaded as `raw` (`step_loads`):
    outputs stored as rows r0 .. r0+ROWS-1 of out_span (out from the span's first token, so
    r0 = t0 - s0 is a multiple of ROWS); (xs, ids) carried on."""
    rows = step_rows(raw, ROWS, BLOCK_D, ROW_TILE)
    outs = ()
    for i in ct.static_iter(range(ROWS)):
        xt = rows[i].astype(ct.float32)
        idt = ct.full((1, 1), 0, dtype=ct.int32)
        if HAS_SEQ:
            idt = load_id(seq_idx, b, t0 + i)
        acc = _activate(conv_row(xs, ids, xt, idt, wts, bias_row, WIDTH, HAS_SEQ), idt,
                        HAS_SEQ, SILU)
        if ROW_TILE:
            outs += (acc.astype(out_span.dtype),)
        else:
            store_row(out_span, b, r0 + i, d_blk, acc, BLOCK_D, UNCHECKED)
        xs = shift(xs, xt, WIDTH)
        if HAS_SEQ:
            ids = shift(ids, idt, WIDTH)
    if ROW_TILE:
        ct.store(out_span, index=(b, r0 // ROWS, d_blk),
                 tile=cat_rows(outs, ROWS).reshape((1, ROWS, BLOCK_D)), allow_tma=False,
                 check_bounds=not UNCHECKED)
    return xs, ids


def _tail_step(x, seq_idx, out, wts, bias_row, xs, ids, b, t0, d_blk, seqlen,
               WIDTH: ct.Constant[int], ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
               HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[int]):
    """The sequence's last, partial step: tokens t0 .. seqlen-1 (< t0+ROWS)."""
    for i in ct.static_iter(range(ROWS)):
        t = t0 + i
        xt = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
        idt = ct.full((1, 1), 0, dtype=ct.int32)
        if t < seqlen:
            xt = load_row(x, b, t, d_blk, BLOCK_D, False).astype(ct.float32)
            if HAS_SEQ:
                idt = load_id(seq_idx, b, t)
        acc = _activate(conv_row(xs, ids, xt, idt, wts, bias_row, WIDTH, HAS_SEQ), idt,
                        HAS_SEQ, SILU)
        if t < seqlen:
            store_row(out, b, t, d_blk, acc, BLOCK_D, False)
        xs = shift(xs, xt, WIDTH)
        if HAS_SEQ:
            ids = shift(ids, idt, WIDTH)
    return xs, ids


def _final_states(x, init, seq_idx, final, b, d_blk, seqlen, WIDTH: ct.Constant[int],
                  BLOCK_D: ct.Constant[int], HAS_INIT: ct.Constant[bool],
                  HAS_SEQ: ct.Constant[bool]):
    """final[b, :, j] = e(l-(W-1)+j), masked to the last token's sequence."""
    last = ct.full((1, 1), 0, dtype=ct.int32)
    if HAS_SEQ:
        last = load_id(seq_idx, b, seqlen - 1)
    for j in ct.static_iter(range(WIDTH - 1)):
        u = seqlen - (WIDTH - 1) + j
        if u >= 0:
            val = load_row(x, b, u, d_blk, BLOCK_D, False).astype(ct.float32)
            if HAS_SEQ:
                val = ct.where(load_id(seq_idx, b, u) == last, val, 0.0)
        else:
            val = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
            if HAS_INIT:
                val = load_state_row(init, b, u + (WIDTH - 1), d_blk, BLOCK_D)
            if HAS_SEQ:
                val = ct.where(load_id(seq_idx, b, 0) == last, val, 0.0)
        store_state_row(final, b, j, d_blk, val, BLOCK_D)


def _fwd_rows(x, weight_t, bias, init, seq_idx, out, final, WIDTH: ct.Constant[int],
              span: int, ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
              HAS_BIAS: ct.Constant[bool], HAS_INIT: ct.Constant[bool],
              HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[int],
              HAS_FINAL: ct.Constant[bool], ROW_TILE: ct.Constant[bool],
              UNCHECKED: ct.Constant[bool], PREFETCH: ct.Constant[bool]):
    d_blk = ct.bid(0)
    prog = ct.bid(1)
    b = ct.bid(2)
    seqlen = x.shape[1]
    wts, bias_row = weight_rows_plain(weight_t, bias, d_blk, WIDTH, BLOCK_D, HAS_BIAS)
    s0 = prog * span
    xs, ids = halo_rows(x, init, seq_idx, b, s0, d_blk, WIDTH, BLOCK_D, HAS_INIT, HAS_SEQ)
    n_steps = ct.cdiv(ct.minimum(seqlen - s0, span), ROWS)
    # the full steps index views that start at s0: their rows r0 + i (r0 a multiple of ROWS,
    # i < ROWS) cannot carry past r0's low bits, so the compiler chains the ROWS addresses
    # off one base (with absolute rows s0 + r0 + i, s0 only known at run time, it kept one
    # 64-bit address per row: 84 registers, 80 with the views)
    x_span = x.slice(1, s0, seqlen)
    out_span = out.slice(1, s0, seqlen)
    if PREFETCH:
        nxt = no_step(x, ROWS, BLOCK_D, ROW_TILE)
        if s0 + ROWS <= seqlen:
            nxt = step_loads(x_span, b, 0, d_blk, ROWS, BLOCK_D, ROW_TILE, UNCHECKED)
    for step in range(n_steps):
        r0 = step * ROWS
        t0 = s0 + r0
        if t0 + ROWS <= seqlen:
            if PREFETCH:
                # the next full step's loads go out before this step's math
                raw = nxt
                nxt = next_step_loads(x_span, b, r0 + ROWS, d_blk, ROWS, BLOCK_D, ROW_TILE,
                                      UNCHECKED)
            else:
                raw = step_loads(x_span, b, r0, d_blk, ROWS, BLOCK_D, ROW_TILE, UNCHECKED)
            xs, ids = _full_step(raw, seq_idx, out_span, wts, bias_row, xs, ids, b, t0, r0,
                                 d_blk, WIDTH, ROWS, BLOCK_D, HAS_SEQ, SILU, ROW_TILE,
                                 UNCHECKED)
        else:
            xs, ids = _tail_step(x, seq_idx, out, wts, bias_row, xs, ids, b, t0, d_blk,
                                 seqlen, WIDTH, ROWS, BLOCK_D, HAS_SEQ, SILU)
    if HAS_FINAL:
        if prog == ct.num_blocks(1) - 1:
            _final_states(x, init, seq_idx, final, b, d_blk, seqlen, WIDTH, BLOCK_D, HAS_INIT,
                          HAS_SEQ)


causal_conv1d_fwd_rows = ct.kernel(_fwd_rows)
#: 64-bit indexing of x and out (2**31 elements or more)
causal_conv1d_fwd_rows_i64 = ct.kernel(int64_variant(_fwd_rows, ("x", "out")))
