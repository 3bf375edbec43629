"""Causal depthwise conv1d backward: dx, per-program partial dweight / dbias, dinitial_states.

With pre, e and id as in the forward (`causal_conv1d_fwd`), M_k(t) = [id(t-(W-1)+k) == id(t)]
and keep(t) = [id(t) >= 0]:

    g(t)     = dout(t) * act'(pre(t)) * keep(t),   silu'(p) = s(p) (1 + p (1 - s(p)))
    dx(u)    = sum_{s<W} w[W-1-s] g(u+s) [id(u) == id(u+s)]
               + dfinal[u-(l-(W-1))] [id(u) == id(l-1)]   for u >= l-(W-1)
    dw[k]    = sum_t g(t) e(t-(W-1)+k) M_k(t)          dbias = sum_t g(t)
    dinit[j] = dx(u) at u = j-(W-1) < 0, by the same formula (id(u < 0) = the row's first id)

g is needed at the W token shifts u+s of a block, so a program recomputes pre there (W*W
shifted input tiles, mostly cache hits: the block and its halo are read from DRAM once).
Programs own BLOCK_D channels of one row and TILES consecutive token blocks; each writes its
partial dw (W, BLOCK_D) and dbias (BLOCK_D) sums to row `b * num_blocks(1) + bid(1)` of the
partials buffers, summed afterwards in a fixed order (deterministic: no atomics). The
programs of the first token block (bid(1) == 0) also write dinit. Grid: (cdiv(dim, BLOCK_D),
cdiv(cdiv(seqlen, BLOCK_L), TILES), batch).
"""

import cuda.tile as ct

from ._common import int64_variant
from .causal_conv1d_common import id_tile, token_tile, weight_row


def _grad_pre(x, weight_t, bias, init, seq_idx, dout, b, start, d_blk, seqlen, first_id,
              WIDTH: ct.Constant[int], ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
              CHANNEL_LAST: ct.Constant[bool], HAS_BIAS: ct.Constant[bool],
              HAS_INIT: ct.Constant[bool], HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool],
              SHIFT_TMA: ct.Constant[bool]):
    """g(start + i) for i < ROWS as (ROWS, BLOCK_D) float32 (zero outside the sequence: dout
    is zero there)."""
    g = token_tile(dout, init, b, start, d_blk, seqlen, WIDTH, ROWS, BLOCK_D, CHANNEL_LAST,
                   False, SHIFT_TMA)
    own = ct.full((ROWS, 1), 0, dtype=ct.int32)
    if HAS_SEQ:
        own = id_tile(seq_idx, b, start, seqlen, first_id, ROWS)
    if SILU:
        pre = ct.full((ROWS, BLOCK_D), 0.0, dtype=ct.float32)
        for k in range(WIDTH):
            tap_start = start + k - (WIDTH - 1)
            tap = token_tile(x, init, b, tap_start, d_blk, seqlen, WIDTH, ROWS, BLOCK_D,
                             CHANNEL_LAST, HAS_INIT, SHIFT_TMA)
            if HAS_SEQ:
                ids = id_tile(seq_idx, b, tap_start, seqlen, first_id, ROWS)
                tap = ct.where(ids == own, tap, 0.0)
            pre = pre + weight_row(weight_t, k, d_blk, BLOCK_D) * tap
        if HAS_BIAS:
            pre = pre + ct.load(bias, index=(d_blk,), shape=(BLOCK_D,),
                                padding_mode=ct.PaddingMode.ZERO).reshape(
                                    (1, BLOCK_D)).astype(ct.float32)
        sig = 1.0 / (1.0 + ct.exp(-pre))
        g = g * (sig * (1.0 + pre * (1.0 - sig)))
    if HAS_SEQ:
        g = ct.where(own >= 0, g, 0.0)
    return g


def _input_grad(x, weight_t, bias, init, seq_idx, dout, dfinal, b, start, d_blk, seqlen,
                first_id, WIDTH: ct.Constant[int], ROWS: ct.Constant[int],
                BLOCK_D: ct.Constant[int], CHANNEL_LAST: ct.Constant[bool],
                HAS_BIAS: ct.Constant[bool], HAS_INIT: ct.Constant[bool],
                HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool],
                HAS_DFINAL: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool]):
    """de(start + i) for i < ROWS (dx for tokens >= 0, dinit before) as (ROWS, BLOCK_D)."""
    own = ct.full((ROWS, 1), 0, dtype=ct.int32)
    if HAS_SEQ:
        own = id_tile(seq_idx, b, start, seqlen, first_id, ROWS)
    acc = ct.full((ROWS, BLOCK_D), 0.0, dtype=ct.float32)
    for s in range(WIDTH):
        g = _grad_pre(x, weight_t, bias, init, seq_idx, dout, b, start + s, d_blk, seqlen,
                      first_id, WIDTH, ROWS, BLOCK_D, CHANNEL_LAST, HAS_BIAS, HAS_INIT,
                      HAS_SEQ, SILU, SHIFT_TMA)
        if HAS_SEQ:
            ids = id_tile(seq_idx, b, start + s, seqlen, first_id, ROWS)
            g = ct.where(ids == own, g, 0.0)
        acc = acc + weight_row(weight_t, WIDTH - 1 - s, d_blk, BLOCK_D) * g
    if HAS_DFINAL:
        tail = seqlen - (WIDTH - 1)
        if start + ROWS > tail:
            # dfinal[j] flows back to e(l-(W-1)+j); j outside 0..W-2 is out of bounds: zero
            j = start - tail + ct.arange(ROWS, dtype=ct.int32).reshape((ROWS, 1))
            c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
            df = ct.gather(dfinal, (b, c, j)).astype(ct.float32)
            if HAS_SEQ:
                last = ct.load(seq_idx, index=(b, seqlen - 1), shape=(1, 1)).reshape((1, 1))
                df = ct.where(own == last, df, 0.0)
            acc = acc + df
    return acc


def _bwd(x, weight_t, bias, init, seq_idx, dout, dfinal, dx, dw_part, db_part, dinit,
         WIDTH: ct.Constant[int], WIDTH_PAD: ct.Constant[int], HALO: ct.Constant[int],
         BLOCK_L: ct.Constant[int], BLOCK_D: ct.Constant[int], TILES: ct.Constant[int],
         CHANNEL_LAST: ct.Constant[bool], HAS_BIAS: ct.Constant[bool],
         HAS_INIT: ct.Constant[bool], HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool],
         HAS_DFINAL: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool]):
    d_blk = ct.bid(0)
    prog_l = ct.bid(1)
    b = ct.bid(2)
    if CHANNEL_LAST:
        seqlen = x.shape[1]
    else:
        seqlen = x.shape[2]
    first_id = 0
    if HAS_SEQ:
        first_id = ct.load(seq_idx, index=(b, 0), shape=(1, 1)).item()
    tap_row = ct.arange(WIDTH_PAD, dtype=ct.int32).reshape((WIDTH_PAD, 1))
    dw_acc = ct.full((WIDTH_PAD, BLOCK_D), 0.0, dtype=ct.float32)
    db_acc = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
    for i in range(TILES):
        l_tile = prog_l * TILES + i
        l0 = l_tile * BLOCK_L
        if l0 < seqlen:
            de = _input_grad(x, weight_t, bias, init, seq_idx, dout, dfinal, b, l0, d_blk,
                             seqlen, first_id, WIDTH, BLOCK_L, BLOCK_D, CHANNEL_LAST, HAS_BIAS,
                             HAS_INIT, HAS_SEQ, SILU, HAS_DFINAL, SHIFT_TMA)
            tile = de.astype(dx.dtype).reshape((1, BLOCK_L, BLOCK_D))
            if CHANNEL_LAST:
                ct.store(dx, index=(b, l_tile, d_blk), tile=tile)
            else:
                ct.store(dx, index=(b, l_tile, d_blk), tile=tile, order=(0, 2, 1))
            g = _grad_pre(x, weight_t, bias, init, seq_idx, dout, b, l0, d_blk, seqlen,
                          first_id, WIDTH, BLOCK_L, BLOCK_D, CHANNEL_LAST, HAS_BIAS, HAS_INIT,
                          HAS_SEQ, SILU, SHIFT_TMA)
            db_acc = db_acc + ct.sum(g, axis=0, keepdims=True)
            own = ct.full((BLOCK_L, 1), 0, dtype=ct.int32)
            if HAS_SEQ:
                own = id_tile(seq_idx, b, l0, seqlen, first_id, BLOCK_L)
            for k in range(WIDTH):
                start = l0 + k - (WIDTH - 1)
                tap = token_tile(x, init, b, start, d_blk, seqlen, WIDTH, BLOCK_L, BLOCK_D,
                                 CHANNEL_LAST, HAS_INIT, SHIFT_TMA)
                if HAS_SEQ:
                    ids = id_tile(seq_idx, b, start, seqlen, first_id, BLOCK_L)
                    tap = ct.where(ids == own, tap, 0.0)
                col = ct.sum(g * tap, axis=0, keepdims=True)
                dw_acc = dw_acc + ct.where(tap_row == k, col, 0.0)
    part = b * ct.num_blocks(1) + prog_l
    ct.store(dw_part, index=(part, 0, d_blk), tile=dw_acc.reshape((1, WIDTH_PAD, BLOCK_D)))
    ct.store(db_part, index=(part, d_blk), tile=db_acc)
    if HAS_INIT:
        if prog_l == 0:
            di = _input_grad(x, weight_t, bias, init, seq_idx, dout, dfinal, b, 1 - WIDTH,
                             d_blk, seqlen, first_id, WIDTH, HALO, BLOCK_D, CHANNEL_LAST,
                             HAS_BIAS, HAS_INIT, HAS_SEQ, SILU, HAS_DFINAL, False)
            j = ct.arange(HALO, dtype=ct.int32).reshape((HALO, 1))
            c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
            ct.scatter(dinit, (b, c, j), di.astype(dinit.dtype), mask=j < WIDTH - 1)


causal_conv1d_bwd = ct.kernel(_bwd)
#: 64-bit indexing of x, dout and dx (2**31 elements or more)
causal_conv1d_bwd_i64 = ct.kernel(int64_variant(_bwd, ("x", "dout", "dx")))
