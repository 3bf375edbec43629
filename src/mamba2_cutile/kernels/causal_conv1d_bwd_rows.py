"""Causal depthwise conv1d backward, form 3 ("row streaming", channel-last x): the math of
`causal_conv1d_bwd`,

    g(t)     = dout(t) * act'(pre(t)) * [id(t) >= 0],   silu'(p) = s(p) (1 + p (1 - s(p)))
    dx(u)    = sum_{s<W} w[W-1-s] g(u+s) [id(u) == id(u+s)]
               + dfinal[u-(l-(W-1))] [id(u) == id(l-1)]   for u >= l-(W-1)
    dw[k]    = sum_t g(t) e(t-(W-1)+k) [id(t-(W-1)+k) == id(t)]          dbias = sum_t g(t)
    dinit[j] = dx(u) at u = j-(W-1) < 0 (id(u < 0) = the row's first id)

(pre from `causal_conv1d_fwd_rows.conv_row`, recomputed from x), with every row of x and dout
read once, as in the forward of this form.

- A program owns BLOCK_D channels of one batch row and the dx rows u = s0 .. s0+span-1. It
  walks the tokens t = u + (W-1) in order, ROWS per unrolled step: per token it loads x(t) and
  dout(t), forms pre(t) from the W-1 input rows it carries (tokens t-(W-1)..t-1, float32),
  g(t), adds the dw/dbias terms of g(t), and finishes dx(t-(W-1)), whose last term was g(t),
  from the W-1 carried g rows. Carried: W-1 input rows, W-1 g rows, their ids, W + 1 dw/dbias
  accumulators, all (1, BLOCK_D) (or (1, 1) ids) tiles of one layout: elementwise, no
  shuffles; the partial sums stay per channel, so there is no cross-thread reduction at all.
- Before its first dx row a program warms up on the W-1 tokens s0 .. s0+W-2 (their g rows;
  the W-1 input rows before s0 are the halo, re-read per span, or the initial states / zeros
  at s0 = 0), and past its last dx row it has read W-1 tokens of the next span (lookahead,
  also re-read; their g terms belong to the next span's dw/dbias and are left out here).
- Full steps (every token of the step, lookahead included, inside the sequence) are
  straight-line code; with UNCHECKED (BLOCK_D divides dim, tileiras 13.4+) their loads and
  stores skip the bounds checks. ROW_TILE = 1 loads a step's x and dout as (ROWS, BLOCK_D)
  slices and stores dx as one (ROWS, BLOCK_D) tile (`ct.extract` / `ct.cat`); 0: one row
  load and store per token. PREFETCH: the next full step's x and dout loads are issued
  before the current step's math (as in the forward). Steps near the sequence end branch
  per token on t < seqlen and add the dfinal terms.
- SILU: 0 no activation, 1 SiLU in IEEE float32, 2 through the approximate exp2 and
  reciprocal (16-bit inputs; see `causal_conv1d_fwd_rows`).
- Partial sums: dw (W, BLOCK_D) and dbias (BLOCK_D) of the program's tokens t in
  [s0, s0+span) go to row `b * num_blocks(1) + bid(1)` of the partial buffers, summed
  afterwards in a fixed order (deterministic, no atomics); the programs of the first span
  write dinit. Grid: (cdiv(dim, BLOCK_D), cdiv(seqlen, span), batch); `span` is a run-time
  int32, any multiple of ROWS that is at least W-1 (one compile for every span: the lookahead
  select above needs only that a span's last step ends at s0+span). The full steps index
  views that start at s0 (dx) and s0+W-1 (x, dout). sm_90 registers (bf16, bias + SiLU,
  width 4, BLOCK_D 128, ROWS 8, CPU compile): 82, 6 CTAs per SM (77 at a compile-time span;
  88 at the run-time span with absolute row indices, 5 per SM).
"""

import cuda.tile as ct

from ._common import int64_variant
from .causal_conv1d_common import weight_rows_plain
from .causal_conv1d_fwd_rows import (cat_rows, conv_row, halo_rows, load_id, load_row,
                                     load_state_row, next_step_loads, no_step, shift, sigmoid,
                                     step_loads,
                                     step_rows, store_row, store_state_row)


def _grad_row(xs, ids, xt, idt, dot, wts, bias_row, WIDTH: ct.Constant[int],
              HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[int]):
    """g(t) as (1, BLOCK_D) float32 (xt, dot: x(t), dout(t) in float32)."""
    g = dot
    if SILU:
        pre = conv_row(xs, ids, xt, idt, wts, bias_row, WIDTH, HAS_SEQ)
        sig = sigmoid(pre, SILU)
        g = g * (sig * (1.0 + pre * (1.0 - sig)))
    if HAS_SEQ:
        g = ct.where(idt >= 0, g, 0.0)
    return g


def _accumulate(dws, db, xs, ids, xt, idt, g, WIDTH: ct.Constant[int],
                HAS_SEQ: ct.Constant[bool]):
    """(dws, db) + the dw / dbias terms of g(t)."""
    summed = ()
    for k in ct.static_iter(range(WIDTH - 1)):
        tap = xs[k]
        if HAS_SEQ:
            tap = ct.where(ids[k] == idt, tap, 0.0)
        summed += (dws[k] + g * tap,)
    summed += (dws[WIDTH - 1] + g * xt,)
    return summed, db + g


def _dx_row(gs, ids, g, idt, wts, WIDTH: ct.Constant[int], HAS_SEQ: ct.Constant[bool]):
    """dx(u) for u = t-(W-1) without the dfinal term: gs[s] = g(u+s), s < W-1, g = g(t)."""
    de = ct.full(g.shape, 0.0, dtype=ct.float32)
    for s in ct.static_iter(range(WIDTH - 1)):
        term = gs[s]
        if HAS_SEQ:
            if s > 0:
                term = ct.where(ids[0] == ids[s], term, 0.0)
        de = de + wts[WIDTH - 1 - s] * term
    if HAS_SEQ:
        g = ct.where(ids[0] == idt, g, 0.0)
    return de + wts[0] * g


def _dfinal_term(dfinal, seq_idx, b, u, d_blk, seqlen, id_u, WIDTH: ct.Constant[int],
                 BLOCK_D: ct.Constant[int], HAS_SEQ: ct.Constant[bool]):
    """dfinal[u-(l-(W-1))] [id(u) == id(l-1)] for seqlen-(W-1) <= u (u < seqlen)."""
    df = load_state_row(dfinal, b, u - (seqlen - (WIDTH - 1)), d_blk, BLOCK_D)
    if HAS_SEQ:
        df = ct.where(id_u == load_id(seq_idx, b, seqlen - 1), df, 0.0)
    return df


def _token(x, dout, seq_idx, b, t, d_blk, seqlen, BLOCK_D: ct.Constant[int],
           HAS_SEQ: ct.Constant[bool]):
    """(x(t), dout(t) as (1, BLOCK_D) float32, id(t) (1, 1)); zeros (and id 0) past the end."""
    xt = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
    dot = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
    idt = ct.full((1, 1), 0, dtype=ct.int32)
    if t < seqlen:
        xt = load_row(x, b, t, d_blk, BLOCK_D, False).astype(ct.float32)
        dot = load_row(dout, b, t, d_blk, BLOCK_D, False).astype(ct.float32)
        if HAS_SEQ:
            idt = load_id(seq_idx, b, t)
    return xt, dot, idt


def _full_step(xraw, draw, seq_idx, dx_span, wts, bias_row, xs, ids, gs, dws, db, b, t0,
               r0, d_blk, s_end, WIDTH: ct.Constant[int], ROWS: ct.Constant[int],
               BLOCK_D: ct.Constant[int], HAS_SEQ: ct.Constant[bool],
               SILU: ct.Constant[int], ROW_TILE: ct.Constant[bool],
               UNCHECKED: ct.Constant[bool]):
    """dx rows t0 .. t0+ROWS-1 (tokens t0+W-1 .. t0+ROWS+W-2 all inside the sequence, loaded
    as xraw / draw, see `causal_conv1d_fwd_rows.step_loads`), stored as rows r0 .. r0+ROWS-1
    of dx_span (dx from the span's first row: r0 = t0 - s0, a multiple of ROWS)."""
    xr = step_rows(xraw, ROWS, BLOCK_D, ROW_TILE)
    dr = step_rows(draw, ROWS, BLOCK_D, ROW_TILE)
    outs = ()
    for i in ct.static_iter(range(ROWS)):
        t = t0 + (WIDTH - 1) + i
        xt = xr[i].astype(ct.float32)
        dot = dr[i].astype(ct.float32)
        idt = ct.full((1, 1), 0, dtype=ct.int32)
        if HAS_SEQ:
            idt = load_id(seq_idx, b, t)
        g = _grad_row(xs, ids, xt, idt, dot, wts, bias_row, WIDTH, HAS_SEQ, SILU)
        de = _dx_row(gs, ids, g, idt, wts, WIDTH, HAS_SEQ)
        if ROW_TILE:
            outs += (de.astype(dx_span.dtype),)
        else:
            store_row(dx_span, b, r0 + i, d_blk, de, BLOCK_D, UNCHECKED)
        gw = g
        if i >= ROWS - (WIDTH - 1):
            # lookahead past the span holds the next program's terms: a select, not a branch
            # (straight-line code keeps the step's loads and math free to interleave)
            gw = ct.where(ct.full((1, 1), t, dtype=ct.int32) < s_end, g, 0.0)
        dws, db = _accumulate(dws, db, xs, ids, xt, idt, gw, WIDTH, HAS_SEQ)
        xs = shift(xs, xt, WIDTH)
        gs = shift(gs, g, WIDTH)
        if HAS_SEQ:
            ids = shift(ids, idt, WIDTH)
    if ROW_TILE:
        ct.store(dx_span, index=(b, r0 // ROWS, d_blk),
                 tile=cat_rows(outs, ROWS).reshape((1, ROWS, BLOCK_D)), allow_tma=False,
                 check_bounds=not UNCHECKED)
    return xs, ids, gs, dws, db


def _edge_step(x, seq_idx, dout, dfinal, dx, wts, bias_row, xs, ids, gs, dws, db, b, t0,
               d_blk, s_end, seqlen, WIDTH: ct.Constant[int], ROWS: ct.Constant[int],
               BLOCK_D: ct.Constant[int], HAS_SEQ: ct.Constant[bool],
               SILU: ct.Constant[int], HAS_DFINAL: ct.Constant[bool]):
    """dx rows t0 .. min(t0+ROWS, seqlen)-1 near the sequence end: per-token bounds, the
    dfinal terms."""
    for i in ct.static_iter(range(ROWS)):
        u = t0 + i
        t = u + (WIDTH - 1)
        xt, dot, idt = _token(x, dout, seq_idx, b, t, d_blk, seqlen, BLOCK_D, HAS_SEQ)
        g = _grad_row(xs, ids, xt, idt, dot, wts, bias_row, WIDTH, HAS_SEQ, SILU)
        if u < seqlen:
            de = _dx_row(gs, ids, g, idt, wts, WIDTH, HAS_SEQ)
            if HAS_DFINAL:
                if u >= seqlen - (WIDTH - 1):
                    id_u = ct.full((1, 1), 0, dtype=ct.int32)
                    if HAS_SEQ:
                        id_u = ids[0]
                    de = de + _dfinal_term(dfinal, seq_idx, b, u, d_blk, seqlen, id_u, WIDTH,
                                           BLOCK_D, HAS_SEQ)
            store_row(dx, b, u, d_blk, de, BLOCK_D, False)
        if t < s_end:
            dws, db = _accumulate(dws, db, xs, ids, xt, idt, g, WIDTH, HAS_SEQ)
        xs = shift(xs, xt, WIDTH)
        gs = shift(gs, g, WIDTH)
        if HAS_SEQ:
            ids = shift(ids, idt, WIDTH)
    return xs, ids, gs, dws, db


def _dinit(dinit, dfinal, seq_idx, gs, ids, wts, b, d_blk, seqlen, WIDTH: ct.Constant[int],
           BLOCK_D: ct.Constant[int], HAS_SEQ: ct.Constant[bool],
           HAS_DFINAL: ct.Constant[bool]):
    """dinit[j] = dx(j-(W-1)), from gs = g(0 .. W-2) and ids = id(0 .. W-2) (id(u < 0) =
    id(0))."""
    for j in ct.static_iter(range(WIDTH - 1)):
        # dx(u), u = j-(W-1): the terms s >= W-1-j reach g(u+s) = gs[u+s], u+s = 0 .. j
        de = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
        for s in ct.static_iter(range(WIDTH - 1 - j, WIDTH)):
            term = gs[j - (WIDTH - 1) + s]
            if HAS_SEQ:
                term = ct.where(ids[0] == ids[j - (WIDTH - 1) + s], term, 0.0)
            de = de + wts[WIDTH - 1 - s] * term
        if HAS_DFINAL:
            if j >= seqlen:       # u >= l-(W-1): dfinal[j - l] flows back to the state
                id_u = ct.full((1, 1), 0, dtype=ct.int32)
                if HAS_SEQ:
                    id_u = ids[0]
                de = de + _dfinal_term(dfinal, seq_idx, b, j - (WIDTH - 1), d_blk, seqlen,
                                       id_u, WIDTH, BLOCK_D, HAS_SEQ)
        store_state_row(dinit, b, j, d_blk, de, BLOCK_D)


def _bwd_rows(x, weight_t, bias, init, seq_idx, dout, dfinal, dx, dw_part, db_part, dinit,
              WIDTH: ct.Constant[int], span: int, ROWS: ct.Constant[int],
              BLOCK_D: ct.Constant[int], HAS_BIAS: ct.Constant[bool],
              HAS_INIT: ct.Constant[bool], HAS_SEQ: ct.Constant[bool],
              SILU: ct.Constant[int], HAS_DFINAL: ct.Constant[bool],
              ROW_TILE: ct.Constant[bool], UNCHECKED: ct.Constant[bool],
              PREFETCH: ct.Constant[bool]):
    d_blk = ct.bid(0)
    prog = ct.bid(1)
    b = ct.bid(2)
    seqlen = x.shape[1]
    wts, bias_row = weight_rows_plain(weight_t, bias, d_blk, WIDTH, BLOCK_D, HAS_BIAS)
    s0 = prog * span
    s_end = s0 + span
    xs, ids = halo_rows(x, init, seq_idx, b, s0, d_blk, WIDTH, BLOCK_D, HAS_INIT, HAS_SEQ)
    zero = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
    gs = ()
    for j in ct.static_iter(range(WIDTH - 1)):
        gs += (zero,)
    dws = ()
    for k in ct.static_iter(range(WIDTH)):
        dws += (zero,)
    db = zero
    # warm-up: g(s0 .. s0+W-2), no dx row finished yet
    for j in ct.static_iter(range(WIDTH - 1)):
        xt, dot, idt = _token(x, dout, seq_idx, b, s0 + j, d_blk, seqlen, BLOCK_D, HAS_SEQ)
        g = _grad_row(xs, ids, xt, idt, dot, wts, bias_row, WIDTH, HAS_SEQ, SILU)
        dws, db = _accumulate(dws, db, xs, ids, xt, idt, g, WIDTH, HAS_SEQ)
        xs = shift(xs, xt, WIDTH)
        gs = shift(gs, g, WIDTH)
        if HAS_SEQ:
            ids = shift(ids, idt, WIDTH)
    if HAS_INIT:
        if prog == 0:
            _dinit(dinit, dfinal, seq_idx, gs, ids, wts, b, d_blk, seqlen, WIDTH, BLOCK_D,
                   HAS_SEQ, HAS_DFINAL)
    n_steps = ct.cdiv(ct.minimum(seqlen - s0, span), ROWS)
    # the full steps index views from the span's start (dx) and from its first lookahead
    # token (x, dout: the tokens of dx row u are read at u + W-1), at rows r0 + i with r0 a
    # multiple of ROWS: the compiler then chains each step's ROWS addresses off one base
    # (absolute rows kept one 64-bit address per row: 88 registers against 82). A span
    # whose lookahead start lies past the end has no full step: its view is never read.
    ahead = ct.minimum(s0 + (WIDTH - 1), seqlen - 1)
    x_ahead = x.slice(1, ahead, seqlen)
    dout_ahead = dout.slice(1, ahead, seqlen)
    dx_span = dx.slice(1, s0, seqlen)
    if PREFETCH:
        xnxt = no_step(x, ROWS, BLOCK_D, ROW_TILE)
        dnxt = no_step(dout, ROWS, BLOCK_D, ROW_TILE)
        if s0 + (ROWS + WIDTH - 1) <= seqlen:
            xnxt = step_loads(x_ahead, b, 0, d_blk, ROWS, BLOCK_D, ROW_TILE, UNCHECKED)
            dnxt = step_loads(dout_ahead, b, 0, d_blk, ROWS, BLOCK_D, ROW_TILE, UNCHECKED)
    for step in range(n_steps):
        r0 = step * ROWS
        t0 = s0 + r0
        if t0 + (ROWS + WIDTH - 1) <= seqlen:
            if PREFETCH:
                # the next full step's loads go out before this step's math
                xraw = xnxt
                draw = dnxt
                xnxt = next_step_loads(x_ahead, b, r0 + ROWS, d_blk, ROWS, BLOCK_D, ROW_TILE,
                                       UNCHECKED)
                dnxt = next_step_loads(dout_ahead, b, r0 + ROWS, d_blk, ROWS, BLOCK_D,
                                       ROW_TILE, UNCHECKED)
            else:
                xraw = step_loads(x_ahead, b, r0, d_blk, ROWS, BLOCK_D, ROW_TILE, UNCHECKED)
                draw = step_loads(dout_ahead, b, r0, d_blk, ROWS, BLOCK_D, ROW_TILE,
                                  UNCHECKED)
            xs, ids, gs, dws, db = _full_step(
                xraw, draw, seq_idx, dx_span, wts, bias_row, xs, ids, gs, dws, db, b, t0, r0,
                d_blk, s_end, WIDTH, ROWS, BLOCK_D, HAS_SEQ, SILU, ROW_TILE, UNCHECKED)
        else:
            xs, ids, gs, dws, db = _edge_step(
                x, seq_idx, dout, dfinal, dx, wts, bias_row, xs, ids, gs, dws, db, b, t0,
                d_blk, s_end, seqlen, WIDTH, ROWS, BLOCK_D, HAS_SEQ, SILU, HAS_DFINAL)
    part = b * ct.num_blocks(1) + prog
    for k in ct.static_iter(range(WIDTH)):
        ct.store(dw_part, index=(part, k, d_blk), tile=dws[k].reshape((1, 1, BLOCK_D)),
                 allow_tma=False)
    ct.store(db_part, index=(part, d_blk), tile=db, allow_tma=False)


causal_conv1d_bwd_rows = ct.kernel(_bwd_rows)
#: 64-bit indexing of x, dout and dx (2**31 elements or more)
causal_conv1d_bwd_rows_i64 = ct.kernel(int64_variant(_bwd_rows, ("x", "dout", "dx")))
