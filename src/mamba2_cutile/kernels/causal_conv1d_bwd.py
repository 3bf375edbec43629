"""Causal depthwise conv1d backward: dx, per-program partial dweight / dbias, dinitial_states.

With pre, e and id as in the forward (`causal_conv1d_fwd`), M_k(t) = [id(t-(W-1)+k) == id(t)]
and keep(t) = [id(t) >= 0]:

    g(t)     = dout(t) * act'(pre(t)) * keep(t),   silu'(p) = s(p) (1 + p (1 - s(p)))
    dx(u)    = sum_{s<W} w[W-1-s] g(u+s) [id(u) == id(u+s)]
               + dfinal[u-(l-(W-1))] [id(u) == id(l-1)]   for u >= l-(W-1)
    dw[k]    = sum_t g(t) e(t-(W-1)+k) M_k(t)          dbias = sum_t g(t)
    dinit[j] = the same sum at u = j-(W-1) < 0 (id(u < 0) = the row's first id)

g is needed at the W token shifts u+s of a block, so a program recomputes pre there from the
2W-1 token-shifted input tiles, each loaded once and kept on chip (the block and its halo are
read from DRAM once, the overlapping shifted loads mostly hit the cache).
Programs own BLOCK_D channels of one row and TILES consecutive token blocks; each writes its
partial dw (W, BLOCK_D) and dbias (BLOCK_D) sums to row `b * num_blocks(1) + bid(1)` of the
partials buffers, summed afterwards in a fixed order (deterministic: no atomics). The
programs of the first token block (bid(1) == 0) also write dinit. Grid: (cdiv(dim, BLOCK_D),
cdiv(cdiv(seqlen, BLOCK_L), TILES), batch).
"""

import cuda.tile as ct

from ._common import int64_variant
from .causal_conv1d_common import id_tile, token_tile, weight_row


def _block_grads(x, x_head, weight_t, bias, seq_idx, id_head, dout, dout_head, dfinal, b,
                 start, d_blk, seqlen, WIDTH: ct.Constant[int], ROWS: ct.Constant[int],
                 HEAD_FRONT: ct.Constant[int], BLOCK_D: ct.Constant[int],
                 CHANNEL_LAST: ct.Constant[bool], HAS_BIAS: ct.Constant[bool],
                 HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool],
                 HAS_DFINAL: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool]):
    """For the ROWS tokens u = start..start+ROWS-1: (de(u) as (ROWS, BLOCK_D), g(u), and the
    ROWS x W taps' products summed over the rows, as a tuple of W (1, BLOCK_D) dw rows).

    The 2W-1 shifted input tiles X[i] = e(start + i - (W-1)) are loaded once and kept (a
    compile-time tuple): pre(u + s) = sum_k w[k] X[s + k], so the W shifted g tiles cost W*W
    FMAs and no further loads."""
    xs = ()
    ids = ()
    for i in ct.static_iter(range(2 * WIDTH - 1)):
        xs += (token_tile(x, x_head, b, start + i - (WIDTH - 1), d_blk, seqlen, ROWS, BLOCK_D,
                          HEAD_FRONT, CHANNEL_LAST, SHIFT_TMA),)
        if HAS_SEQ:
            ids += (id_tile(seq_idx, id_head, b, start + i - (WIDTH - 1), seqlen, ROWS,
                            HEAD_FRONT),)
    wts = ()
    for k in ct.static_iter(range(WIDTH)):
        wts += (weight_row(weight_t, k, d_blk, BLOCK_D),)
    bias_row = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
    if HAS_BIAS:
        bias_row = ct.load(bias, index=(d_blk,), shape=(BLOCK_D,),
                           padding_mode=ct.PaddingMode.ZERO).reshape(
                               (1, BLOCK_D)).astype(ct.float32)
    gs = ()
    for s in ct.static_iter(range(WIDTH)):
        # g at u + s; its own id is ids[s + W - 1]
        g = token_tile(dout, dout_head, b, start + s, d_blk, seqlen, ROWS, BLOCK_D, HEAD_FRONT,
                       CHANNEL_LAST, SHIFT_TMA)
        if SILU:
            pre = ct.full((ROWS, BLOCK_D), 0.0, dtype=ct.float32) + bias_row
            for k in ct.static_iter(range(WIDTH)):
                tap = xs[s + k]
                if HAS_SEQ:
                    tap = ct.where(ids[s + k] == ids[s + WIDTH - 1], tap, 0.0)
                pre = pre + wts[k] * tap
            sig = 1.0 / (1.0 + ct.exp(-pre))
            g = g * (sig * (1.0 + pre * (1.0 - sig)))
        if HAS_SEQ:
            g = ct.where(ids[s + WIDTH - 1] >= 0, g, 0.0)
        gs += (g,)
    de = ct.full((ROWS, BLOCK_D), 0.0, dtype=ct.float32)
    for s in ct.static_iter(range(WIDTH)):
        g = gs[s]
        if HAS_SEQ:
            g = ct.where(ids[WIDTH - 1] == ids[s + WIDTH - 1], g, 0.0)
        de = de + wts[WIDTH - 1 - s] * g
    if HAS_DFINAL:
        tail = seqlen - (WIDTH - 1)
        if start + ROWS > tail:
            # dfinal[j] flows back to e(l-(W-1)+j); j outside 0..W-2 is out of bounds: zero
            j = start - tail + ct.arange(ROWS, dtype=ct.int32).reshape((ROWS, 1))
            c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
            df = ct.gather(dfinal, (b, c, j)).astype(ct.float32)
            if HAS_SEQ:
                last = ct.load(seq_idx, index=(b, seqlen - 1), shape=(1, 1)).reshape((1, 1))
                df = ct.where(ids[WIDTH - 1] == last, df, 0.0)
            de = de + df
    dws = ()
    for k in ct.static_iter(range(WIDTH)):
        tap = xs[k]
        if HAS_SEQ:
            tap = ct.where(ids[k] == ids[WIDTH - 1], tap, 0.0)
        dws += (ct.sum(gs[0] * tap, axis=0, keepdims=True),)
    return de, gs[0], dws


def _bwd(x, x_head, weight_t, bias, seq_idx, id_head, dout, dout_head, dfinal, dx, dw_part,
         db_part, dinit, WIDTH: ct.Constant[int], WIDTH_PAD: ct.Constant[int],
         HALO: ct.Constant[int], HEAD_FRONT: ct.Constant[int], BLOCK_L: ct.Constant[int],
         BLOCK_D: ct.Constant[int], TILES: ct.Constant[int],
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
    tap_row = ct.arange(WIDTH_PAD, dtype=ct.int32).reshape((WIDTH_PAD, 1))
    dw_acc = ct.full((WIDTH_PAD, BLOCK_D), 0.0, dtype=ct.float32)
    db_acc = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
    n_tiles = ct.cdiv(seqlen, BLOCK_L)
    # a run-time trip count: the loop stays a loop (its body is large)
    for l_tile in range(prog_l * TILES, ct.minimum(n_tiles, prog_l * TILES + TILES)):
        l0 = l_tile * BLOCK_L
        de, g, dws = _block_grads(x, x_head, weight_t, bias, seq_idx, id_head, dout, dout_head,
                                  dfinal, b, l0, d_blk, seqlen, WIDTH, BLOCK_L, HEAD_FRONT,
                                  BLOCK_D, CHANNEL_LAST, HAS_BIAS, HAS_SEQ, SILU, HAS_DFINAL,
                                  SHIFT_TMA)
        tile = de.astype(dx.dtype).reshape((1, BLOCK_L, BLOCK_D))
        if CHANNEL_LAST:
            ct.store(dx, index=(b, l_tile, d_blk), tile=tile)
        else:
            ct.store(dx, index=(b, l_tile, d_blk), tile=tile, order=(0, 2, 1))
        db_acc = db_acc + ct.sum(g, axis=0, keepdims=True)
        for k in ct.static_iter(range(WIDTH)):
            dw_acc = dw_acc + ct.where(tap_row == k, dws[k], 0.0)
    part = b * ct.num_blocks(1) + prog_l
    ct.store(dw_part, index=(part, 0, d_blk), tile=dw_acc.reshape((1, WIDTH_PAD, BLOCK_D)))
    ct.store(db_part, index=(part, d_blk), tile=db_acc)
    if HAS_INIT:
        if prog_l == 0:
            di, g_unused, dw_unused = _block_grads(
                x, x_head, weight_t, bias, seq_idx, id_head, dout, dout_head, dfinal, b,
                1 - WIDTH, d_blk, seqlen, WIDTH, HALO, HEAD_FRONT, BLOCK_D, CHANNEL_LAST,
                HAS_BIAS, HAS_SEQ, SILU, HAS_DFINAL, False)
            j = ct.arange(HALO, dtype=ct.int32).reshape((HALO, 1))
            c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
            ct.scatter(dinit, (b, c, j), di.astype(dinit.dtype), mask=j < WIDTH - 1)


causal_conv1d_bwd = ct.kernel(_bwd)
#: 64-bit indexing of x, dout and dx (2**31 elements or more)
causal_conv1d_bwd_i64 = ct.kernel(int64_variant(_bwd, ("x", "dout", "dx")))
