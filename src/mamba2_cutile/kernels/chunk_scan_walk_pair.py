"""The walk two heads a program (`ForwardConfig.walk_heads` = 2): two heads of one group share
their chunks' C and B tiles and C B^T.

chunk_scan_walk gives each (batch, head, p-tile) its own program, which loads the chunk's C
and B, (Q, N) each, and forms C B^T, (Q, Q) over N, for that head alone. Where heads share a
group (Mamba-2's one group of 24-128 heads) that is the same C, B and C B^T for every head:
with 64-channel heads and N = 128 they are two thirds of a program's loads per chunk and a
quarter of its MMA work. Here a program owns the same p-tile of two neighbouring heads of a
group, each with its own (BLOCK_P, NP) state in registers, and walks their chunks together:
per chunk one load of C and B and one C B^T, then each head's output and state update exactly
as chunk_scan_walk forms them (its `_chunk_output` and `_next_state` on the shared tiles), so
the outputs, final states and flags equal that launch's with the same BLOCK_P, bit for bit.
With 32-channel tiles the program holds as much state as a 64-channel one of
chunk_scan_walk, and the grid has as many programs.

The grid is (B * H / 2, cdiv(P, BLOCK_P), S). The runs (S > 1), their entering states (read,
or formed with CARRY), the initial and final states and the flags are chunk_scan_walk's, per
head; the fix-up launch (FIX) is chunk_scan_walk's own, one head a program, with the same
BLOCK_P and flags. Not here: CUMSUM (dt' and G come from decay_cumsum or the runs' state pass)
and FIX, which the plan leaves to chunk_scan_walk; heads per group must be even.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand
from .chunk_scan import _gate, _mma_x, _skip
from .chunk_scan_walk import _chunk_decay, _next_state
from .chunk_state_carry import _carried_state
from .chunk_state_pass import _nonfinite


def _entering_state(init, seg_entry, seg_final, seg_factor, batch, head, p_tile, seg,
                    BLOCK_P: ct.Constant[int], NP: ct.Constant[int],
                    HAS_INIT: ct.Constant[bool], SEGS: ct.Constant[int],
                    CARRY: ct.Constant[bool]):
    """The (BLOCK_P, NP) state entering run `seg` of one head, as chunk_scan_walk forms it."""
    ZERO = ct.PaddingMode.ZERO
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
    return h


def _head_output(x, z, D, out, h, c_op, cb, keep, dtt, g, batch, head, chunk, p_tile,
                 Q: ct.Constant[int], BLOCK_P: ct.Constant[int], D_MODE: ct.Constant[int],
                 HAS_Z: ct.Constant[bool], LOWP: ct.Constant[bool], LAT):
    """One head's (Q, BLOCK_P) output tile of the chunk from the shared C and C B^T, in
    chunk_scan_walk's plain form (`_chunk_output`, SANITIZE off); returns its x tile."""
    xt = ct.load(x, index=(batch, chunk, head, p_tile), shape=(1, Q, 1, BLOCK_P),
                 padding_mode=ct.PaddingMode.ZERO, latency=LAT).reshape((Q, BLOCK_P))
    acc = ct.mma(c_op, mma_operand(h.transpose(), x.dtype),
                 ct.full((Q, BLOCK_P), 0.0, dtype=ct.float32))
    acc = acc * ct.exp2(g)[:, None]
    expo = ct.where(keep, g[:, None] - g[None, :], -float("inf"))
    acc = _mma_x(acc, cb * ct.exp2(expo) * dtt[None, :], xt, LOWP, x.dtype)
    if D_MODE != 0:
        acc = _skip(acc, xt.astype(ct.float32), D, head, p_tile, BLOCK_P, D_MODE)
    if HAS_Z:
        acc = _gate(acc, z, batch, chunk, head, p_tile, Q, BLOCK_P, LAT)
    ct.store(out, index=(batch, chunk, head, p_tile),
             tile=acc.reshape((1, Q, 1, BLOCK_P)).astype(out.dtype))
    return xt


def _end_of_run(final, flags, h, batch, head, bh, p_tile, seg, BLOCK_P: ct.Constant[int],
                NP: ct.Constant[int], SEGS: ct.Constant[int], FLAG: ct.Constant[bool],
                CARRY: ct.Constant[bool]):
    """One head's flag and final state, as chunk_scan_walk writes them."""
    if FLAG:
        ct.store(flags, index=(bh, p_tile * SEGS + seg), tile=_nonfinite(h).reshape((1, 1)))
    if SEGS == 1:
        ct.store(final, index=(batch, head, p_tile, 0), tile=h.reshape((1, 1, BLOCK_P, NP)))
    elif CARRY:
        if seg == SEGS - 1:
            ct.store(final, index=(batch, head, p_tile, 0),
                     tile=h.reshape((1, 1, BLOCK_P, NP)))


def chunk_scan_walk_pair_fn(
    x, b, c, z, D, dt, cum, init, seg_entry, final, out, flags, dt_raw, A, dt_bias,
    dt_lo: float,
    dt_hi: float,
    seg_final, seg_factor,
    Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    D_MODE: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_INIT: ct.Constant[bool],
    LOAD_LATENCY: ct.Constant[int],
    LOWP: ct.Constant[bool],
    SCALE_X: ct.Constant[bool],
    SEGS: ct.Constant[int],
    FLAG: ct.Constant[bool],
    FIX: ct.Constant[bool],
    CUMSUM: ct.Constant[bool],
    HAS_BIAS: ct.Constant[bool],
    SOFTPLUS: ct.Constant[bool],
    CARRY: ct.Constant[bool],
):
    """chunk_scan_walk_fn's arguments, in its order (the plan passes the same tuple); FIX and
    CUMSUM must be off. Program (pair, p_tile, seg) walks heads 2 j and 2 j + 1 of batch
    pair // (H / 2), j = pair % (H / 2)."""
    ct.static_assert(not FIX and not CUMSUM, "chunk_scan_walk_pair: no FIX, no CUMSUM")
    ZERO = ct.PaddingMode.ZERO
    LAT = None if LOAD_LATENCY == 0 else LOAD_LATENCY
    pb, p_tile, seg = ct.bid(0), ct.bid(1), ct.bid(2)
    nheads = x.shape[2]
    pairs = nheads // 2
    batch = pb // pairs
    head0 = (pb % pairs) * 2
    head1 = head0 + 1
    group = head0 // HEADS_PER_GROUP
    num_chunks = cum.shape[2] // Q
    c_begin = seg * num_chunks // SEGS
    c_end = (seg + 1) * num_chunks // SEGS
    h0 = _entering_state(init, seg_entry, seg_final, seg_factor, batch, head0, p_tile, seg,
                         BLOCK_P, NP, HAS_INIT, SEGS, CARRY)
    h1 = _entering_state(init, seg_entry, seg_final, seg_factor, batch, head1, p_tile, seg,
                         BLOCK_P, NP, HAS_INIT, SEGS, CARRY)
    row = ct.arange(Q, dtype=ct.int32)
    keep = row[:, None] >= row[None, :]
    for chunk in range(c_begin, c_end):
        # one load of the group's C and B and one C B^T for both heads
        c_op = mma_operand(ct.load(c, index=(batch, chunk, group, 0), shape=(1, Q, 1, NP),
                                   padding_mode=ZERO, latency=LAT).reshape((Q, NP)), x.dtype)
        bt = ct.load(b, index=(batch, chunk, group, 0), shape=(1, Q, 1, NP),
                     padding_mode=ZERO, latency=LAT).reshape((Q, NP))
        cb = ct.mma(c_op, mma_operand(bt.transpose(), x.dtype),
                    ct.full((Q, Q), 0.0, dtype=ct.float32))
        dt0, g0 = _chunk_decay(dt, cum, dt_raw, A, dt_bias, dt_lo, dt_hi, batch, head0, chunk,
                               p_tile, Q, LAT, False, HAS_BIAS, SOFTPLUS, FLAG)
        x0 = _head_output(x, z, D, out, h0, c_op, cb, keep, dt0, g0, batch, head0, chunk,
                          p_tile, Q, BLOCK_P, D_MODE, HAS_Z, LOWP, LAT)
        h0 = _next_state(h0, x0, bt, dt0, g0, x.dtype, Q, BLOCK_P, NP, SCALE_X)
        dt1, g1 = _chunk_decay(dt, cum, dt_raw, A, dt_bias, dt_lo, dt_hi, batch, head1, chunk,
                               p_tile, Q, LAT, False, HAS_BIAS, SOFTPLUS, FLAG)
        x1 = _head_output(x, z, D, out, h1, c_op, cb, keep, dt1, g1, batch, head1, chunk,
                          p_tile, Q, BLOCK_P, D_MODE, HAS_Z, LOWP, LAT)
        h1 = _next_state(h1, x1, bt, dt1, g1, x.dtype, Q, BLOCK_P, NP, SCALE_X)
    _end_of_run(final, flags, h0, batch, head0, batch * nheads + head0, p_tile, seg, BLOCK_P,
                NP, SEGS, FLAG, CARRY)
    _end_of_run(final, flags, h1, batch, head1, batch * nheads + head1, p_tile, seg, BLOCK_P,
                NP, SEGS, FLAG, CARRY)


chunk_scan_walk_pair = ct.kernel(chunk_scan_walk_pair_fn)
chunk_scan_walk_pair_i64 = ct.kernel(int64_variant(
    chunk_scan_walk_pair_fn, ["x", "b", "c", "z", "D", "dt", "cum", "init", "seg_entry",
                              "final", "out", "flags", "dt_raw", "A", "dt_bias", "seg_final",
                              "seg_factor"]))
