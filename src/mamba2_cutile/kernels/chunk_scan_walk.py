"""The forward's state and output in one pass over chunks (`ForwardConfig.scan_walk`): the
chunk states never leave the chip.

chunk_state_pass writes the state entering every chunk, (B, H, C, P, N), as large as x at
dstate = 2 headdim in float32, and chunk_scan reads it back: a round trip through HBM on top
of x, B and C. Here a program owns one (batch, head, p-tile) slice of the state, (BLOCK_P, NP)
in registers, and walks the chunks of its run in order. For chunk c with tokens t (log2 decays
G_t from decay_cumsum, G_last its last entry) and the entering state h:

    Y   = 2^{G_t} * (C h^T)                                           carried-state term
        + (2^{G_t - G_s} * (C B^T) * M_ts * dt_s) @ X                 intra-chunk term
        + D * X                                                       skip
    Y  <- Y * silu(Z)                                                 gate, if z is given
    h  <- 2^{G_last} * h + X^T (w * B),   w_t = dt_t 2^{G_last - G_t}

with the causal mask M applied to the exponent before exp2 and the products formed as
chunk_scan forms its diagonal block (one query block of the whole chunk), and the update as
chunk_state_pass forms it (the weights on the smaller operand, a fresh accumulator), so the
outputs differ from the three-kernel forward only in where the state is rounded: here it is
an MMA operand rounded from float32, never stored in the state dtype first.

The grid is (B * H, cdiv(P, BLOCK_P), S). With S = 1 a program walks every chunk from the
initial state and writes the final state. With S > 1 (`ForwardConfig.state_segments`, where B
* H * p-tiles programs would not fill the GPU) run s walks chunks floor(C s / S) up to floor(C
(s + 1) / S) from the state entering it, H_s, which chunk_state_pass (SEG_MODE=1: the runs'
end states from zero starts, no chunk state written) and chunk_state_carry (ENTRY_ONLY: H_s,
and the final state) form before this launch, reading x and B once more instead of writing
and reading every chunk state.

With CARRY (`ForwardConfig.walk_carry`, S > 1) chunk_state_carry is folded in: program
(bh, p, s) forms H_s from the s earlier runs' end states and factors (s loads of its own
(BLOCK_P, NP) tile, with that launch's own `_carried_state`, so the same values), and the last
run's programs write the final state, which they reach by walking.

Non-finite inputs (`ForwardConfig.scan_causal` 4). The intra-chunk product multiplies masked
weights, zeros, into X, and 0 * NaN is NaN: a bad x, B or dt' at token t would reach the rows
before t of its chunk. The plain walk (FIX=False) writes one flag per program: whether its
last state is non-finite, which without seq_idx holds exactly when a term of the run's
updates, or the state entering it, is (2^G h + u stays non-finite: 0 * Inf is NaN too). The
second launch (FIX=True, the same grid) returns at once where its flag is clear; a flagged
program walks its run again, updating the state as before, and recomputes each chunk whose
x, B or decay weights hold a non-finite value (chunk_scan's `_chunk_is_bad`) in
chunk_scan's sanitizing form (`_add_key_block` with SANITIZE): the rows before the bad token
equal those of a clean run bit for bit (the same products in the same order, exact zeros
where masked), and the rows the recurrence makes non-finite are non-finite.

With FIX_INLINE (`ForwardConfig.walk_fix_inline`) the plain program itself walks its run
again in that form where its last state is non-finite: no flag is stored and there is no
second launch, which on clean input only starts programs that return at once (4-5 us timed
alone on the H100, 2026-12-07).

Not here: seq_idx (its resets and same-sequence mask), the chunk states that varlen states
read, and C B^T from chunk_cb; the plan keeps the three-kernel forward for those.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand
from .chunk_scan import _add_key_block, _chunk_is_bad, _gate, _mma_x, _skip
from .chunk_state_carry import _carried_state
from .chunk_state_pass import _nonfinite, _update


def _chunk_output(x, b, c, z, D, dt, cum, out, h, dtt, g, batch, head, group, chunk,
                  p_tile, Q: ct.Constant[int], BLOCK_P: ct.Constant[int],
                  NP: ct.Constant[int], D_MODE: ct.Constant[int], HAS_Z: ct.Constant[bool],
                  LOWP: ct.Constant[bool], LAT, SANITIZE: ct.Constant[bool]):
    """Stores the chunk's (Q, BLOCK_P) output tile from its entering state h and its (Q,)
    dt' and G (SANITIZE: the intra-chunk term in chunk_scan's causal form, which reads dt'
    and G from `dt` and `cum`); returns the loaded (x, B) tiles for the state update."""
    ZERO = ct.PaddingMode.ZERO
    c_op = mma_operand(ct.load(c, index=(batch, chunk, group, 0), shape=(1, Q, 1, NP),
                               padding_mode=ZERO, latency=LAT).reshape((Q, NP)), x.dtype)
    bt = ct.load(b, index=(batch, chunk, group, 0), shape=(1, Q, 1, NP), padding_mode=ZERO,
                 latency=LAT).reshape((Q, NP))
    xt = ct.load(x, index=(batch, chunk, head, p_tile), shape=(1, Q, 1, BLOCK_P),
                 padding_mode=ZERO, latency=LAT).reshape((Q, BLOCK_P))
    row = chunk * Q + ct.arange(Q, dtype=ct.int32)
    acc = ct.mma(c_op, mma_operand(h.transpose(), x.dtype),
                 ct.full((Q, BLOCK_P), 0.0, dtype=ct.float32))
    acc = acc * ct.exp2(g)[:, None]
    cb = ct.mma(c_op, mma_operand(bt.transpose(), x.dtype),
                ct.full((Q, Q), 0.0, dtype=ct.float32))
    if SANITIZE:
        acc = _add_key_block(acc, cb, chunk, chunk, g, row, row, x, dt, cum, batch, head,
                             p_tile, Q, BLOCK_P, False, LOWP, LAT, True)
    else:
        # chunk_scan's plain diagonal block (`_add_key_block`), its tiles loaded once here
        keep = row[:, None] >= row[None, :]
        expo = ct.where(keep, g[:, None] - g[None, :], -float("inf"))
        acc = _mma_x(acc, cb * ct.exp2(expo) * dtt[None, :], xt, LOWP, x.dtype)
    if D_MODE != 0:
        acc = _skip(acc, xt.astype(ct.float32), D, head, p_tile, BLOCK_P, D_MODE)
    if HAS_Z:
        acc = _gate(acc, z, batch, chunk, head, p_tile, Q, BLOCK_P, LAT)
    ct.store(out, index=(batch, chunk, head, p_tile),
             tile=acc.reshape((1, Q, 1, BLOCK_P)).astype(out.dtype))
    return xt, bt


def _chunk_decay(dt, cum, batch, head, chunk, Q: ct.Constant[int], LAT):
    """The chunk's (Q,) dt' and G, read from decay_cumsum's `dt` and `cum`."""
    g = ct.load(cum, index=(batch, head, chunk), shape=(1, 1, Q), latency=LAT).reshape((Q,))
    dtt = ct.load(dt, index=(batch, head, chunk), shape=(1, 1, Q), latency=LAT).reshape((Q,))
    return dtt, g


def _next_state(h, xt, bt, dtt, g, in_dtype, Q: ct.Constant[int], BLOCK_P: ct.Constant[int],
                NP: ct.Constant[int], SCALE_X: ct.Constant[bool]):
    """The state leaving the chunk: 2^{G_last} h + X^T (w B), as chunk_state_pass forms it."""
    g_last = ct.extract(g, index=(Q - 1,), shape=(1,))
    none = ct.full((1, 1), 0.0, dtype=ct.float32)
    h, _ = _update(h, none, ct.exp2(g_last), xt, bt, dtt * ct.exp2(g_last - g), in_dtype,
                   BLOCK_P, NP, SCALE_X, True, False, False)
    return h


def _walk(x, b, c, z, D, dt, cum, init, seg_entry, final, out, flags, seg_final, seg_factor,
          bh, p_tile, seg,
          Q: ct.Constant[int], BLOCK_P: ct.Constant[int], NP: ct.Constant[int],
          HEADS_PER_GROUP: ct.Constant[int], D_MODE: ct.Constant[int],
          HAS_Z: ct.Constant[bool], HAS_INIT: ct.Constant[bool], LOAD_LATENCY: ct.Constant[int],
          LOWP: ct.Constant[bool], SCALE_X: ct.Constant[bool], SEGS: ct.Constant[int],
          FIX: ct.Constant[bool], CARRY: ct.Constant[bool]):
    """The run of program (bh, p_tile, seg): every chunk's output (FIX: only the bad chunks',
    causally) and the state carried through them."""
    ZERO = ct.PaddingMode.ZERO
    LAT = None if LOAD_LATENCY == 0 else LOAD_LATENCY
    nheads = x.shape[2]
    batch = bh // nheads
    head = bh % nheads
    group = head // HEADS_PER_GROUP
    num_chunks = cum.shape[2] // Q
    c_begin = seg * num_chunks // SEGS
    c_end = (seg + 1) * num_chunks // SEGS

    h = ct.full((BLOCK_P, NP), 0.0, dtype=ct.float32)
    if HAS_INIT:
        if seg == 0:
            h = ct.load(init, index=(batch, head, p_tile, 0), shape=(1, 1, BLOCK_P, NP),
                        padding_mode=ZERO).reshape((BLOCK_P, NP))
    if SEGS > 1:
        if seg > 0:
            if CARRY:
                h = _carried_state(seg_final, seg_factor, batch, head, p_tile, 0, seg, SEGS,
                                   BLOCK_P, NP, False)
            else:
                h = ct.load(seg_entry, index=(batch, head, seg, p_tile, 0),
                            shape=(1, 1, 1, BLOCK_P, NP),
                            padding_mode=ZERO).reshape((BLOCK_P, NP))
    for chunk in range(c_begin, c_end):
        if FIX:
            dtt = ct.load(dt, index=(batch, head, chunk), shape=(1, 1, Q)).reshape((Q,))
            g = ct.load(cum, index=(batch, head, chunk), shape=(1, 1, Q)).reshape((Q,))
            if _chunk_is_bad(x, b, dt, cum, batch, head, group, chunk, Q, BLOCK_P, NP) > 0.0:
                _chunk_output(x, b, c, z, D, dt, cum, out, h, dtt, g, batch, head, group,
                              chunk, p_tile, Q, BLOCK_P, NP, D_MODE, HAS_Z, LOWP, LAT, True)
            xt = ct.load(x, index=(batch, chunk, head, p_tile), shape=(1, Q, 1, BLOCK_P),
                         padding_mode=ZERO).reshape((Q, BLOCK_P))
            bt = ct.load(b, index=(batch, chunk, group, 0), shape=(1, Q, 1, NP),
                         padding_mode=ZERO).reshape((Q, NP))
        else:
            dtt, g = _chunk_decay(dt, cum, batch, head, chunk, Q, LAT)
            xt, bt = _chunk_output(x, b, c, z, D, dt, cum, out, h, dtt, g, batch, head, group,
                                   chunk, p_tile, Q, BLOCK_P, NP, D_MODE, HAS_Z, LOWP, LAT,
                                   False)
        h = _next_state(h, xt, bt, dtt, g, x.dtype, Q, BLOCK_P, NP, SCALE_X)
    if not FIX:
        if SEGS == 1:
            ct.store(final, index=(batch, head, p_tile, 0), tile=h.reshape((1, 1, BLOCK_P, NP)))
        elif CARRY:
            if seg == SEGS - 1:
                ct.store(final, index=(batch, head, p_tile, 0),
                         tile=h.reshape((1, 1, BLOCK_P, NP)))
    return h


def chunk_scan_walk_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N)
    c,           # (B, L, G, N)
    z,           # (B, L, H, P) (ignored unless HAS_Z)
    D,           # (H,) or (H, P) float32 per D_MODE
    dt,          # (B, H, Lp) float32, from decay_cumsum
    cum,         # (B, H, Lp) float32, from decay_cumsum
    init,        # (B, H, P, N) float32 (ignored unless HAS_INIT)
    seg_entry,   # (B, H, SEGS, P, N) float32: the state entering each run (read if SEGS > 1)
    final,       # (B, H, P, N) float32: written with SEGS == 1 or CARRY (else
                 # chunk_state_carry's)
    out,         # (B, L, H, P)
    flags,       # (B * H, cdiv(P, BLOCK_P) * SEGS) float32: 1.0 where the run's last state
                 # is non-finite (written if FLAG and not FIX_INLINE, read if FIX)
    seg_final,   # (B, H, SEGS, P, N) float32: the runs' end states E_r (read if CARRY)
    seg_factor,  # (B, H, SEGS) float32: their end factors F_r (read if CARRY)
    Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int],         # the padded dstate: the state tile's width
    HEADS_PER_GROUP: ct.Constant[int],
    D_MODE: ct.Constant[int],     # 0: no D, 1: per head, 2: per (head, channel)
    HAS_Z: ct.Constant[bool],
    HAS_INIT: ct.Constant[bool],
    LOAD_LATENCY: ct.Constant[int],
    LOWP: ct.Constant[bool],      # the (C B^T) X MMA in the input dtype instead of tf32
    SCALE_X: ct.Constant[bool],   # the update's decay weights on X (else on B)
    SEGS: ct.Constant[int],
    FLAG: ct.Constant[bool],      # the plain walk writes its flag (scan_causal 4)
    FIX: ct.Constant[bool],       # the second launch: flagged runs' bad chunks, causally
    CARRY: ct.Constant[bool],     # SEGS > 1: H_s formed here from seg_final and seg_factor
                                  # (no chunk_state_carry launch; the last run writes final)
    FIX_INLINE: ct.Constant[bool],  # FLAG: a program whose last state is non-finite walks
                                    # its run again itself (FIX), no flag and no second launch
):
    bh, p_tile, seg = ct.bid(0), ct.bid(1), ct.bid(2)
    if FIX:
        if ct.load(flags, index=(bh, p_tile * SEGS + seg), shape=(1, 1)).reshape(()) > 0.0:
            _walk(x, b, c, z, D, dt, cum, init, seg_entry, final, out, flags, seg_final,
                  seg_factor, bh, p_tile, seg, Q, BLOCK_P, NP, HEADS_PER_GROUP, D_MODE, HAS_Z,
                  HAS_INIT, LOAD_LATENCY, LOWP, SCALE_X, SEGS, True, CARRY)
    else:
        h = _walk(x, b, c, z, D, dt, cum, init, seg_entry, final, out, flags, seg_final,
                  seg_factor, bh, p_tile, seg, Q, BLOCK_P, NP, HEADS_PER_GROUP, D_MODE, HAS_Z,
                  HAS_INIT, LOAD_LATENCY, LOWP, SCALE_X, SEGS, False, CARRY)
        if FLAG:
            bad = _nonfinite(h)
            if FIX_INLINE:
                if bad.reshape(()) > 0.0:
                    _walk(x, b, c, z, D, dt, cum, init, seg_entry, final, out, flags,
                          seg_final, seg_factor, bh, p_tile, seg, Q, BLOCK_P, NP,
                          HEADS_PER_GROUP, D_MODE, HAS_Z, HAS_INIT, LOAD_LATENCY, LOWP,
                          SCALE_X, SEGS, True, CARRY)
            else:
                ct.store(flags, index=(bh, p_tile * SEGS + seg), tile=bad.reshape((1, 1)))


chunk_scan_walk = ct.kernel(chunk_scan_walk_fn)
chunk_scan_walk_i64 = ct.kernel(int64_variant(
    chunk_scan_walk_fn, ["x", "b", "c", "z", "D", "dt", "cum", "init", "seg_entry", "final",
                         "out", "flags", "seg_final", "seg_factor"]))
