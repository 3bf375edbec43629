"""Causal depthwise conv1d backward, form 1 ("streamed taps"): the math of `causal_conv1d_bwd`,

    g(t)     = dout(t) * act'(pre(t)) * keep(t),   silu'(p) = s(p) (1 + p (1 - s(p)))
    dx(u)    = sum_{s<W} w[W-1-s] g(u+s) [id(u) == id(u+s)]
               + dfinal[u-(l-(W-1))] [id(u) == id(l-1)]   for u >= l-(W-1)
    dw[k]    = sum_t g(t) e(t-(W-1)+k) M_k(t)          dbias = sum_t g(t)
    dinit[j] = the same sum at u = j-(W-1) < 0 (id(u < 0) = the row's first id)

with fewer live tiles and no per-tap branch in interior blocks.

- g is needed at the W shifts u+s of a block, s = 0 .. W-1, and pre(u+s) needs the input at
  shifts s-(W-1) .. s. The shifts are walked in order with a window of the last W input tiles:
  each step drops the oldest tile and loads one new one (kept in the input's dtype until
  used), then computes pre, g and adds w[W-1-s] g to dx. Live: the window, dx, pre, g (the
  form-0 kernel keeps all 2W-1 input and W output-gradient tiles). dw needs g(u) against the
  shifts -(W-1) .. 0, which are the window of the first step, so its products are taken there.
- dw and dbias are accumulated elementwise, as W + 1 (BLOCK_L, BLOCK_D) float32 tiles carried
  through the program's TILES blocks, and summed over the tokens once per program: the
  cross-thread reductions (shared memory and barriers) cost W + 1 per program, not per block.
- Interior blocks (not the row's first, and with every tap inside the sequence: l0 + BLOCK_L
  + W-1 <= seqlen, so that no dfinal term reaches them either) load each tap as a straight
  slice; with UNCHECKED (the launcher's promise that BLOCK_D divides dim, and tileiras 13.4+)
  their loads and the dx store skip the bounds checks. The edge blocks take the head/x/zero
  branch of `causal_conv1d_common.token_tile` per tap and add the dfinal terms; the choice
  is one program-uniform branch around the block. TILES = 1: one block per program and no
  loop (tileiras unrolls and pipelines a loop over blocks, doubling the live registers).
- STORE_TMA lets the stores use TMA; without it they are plain stores (a TMA store makes
  tileiras warp-specialize the kernel: twice the threads, mbarrier waits).
- Programs own BLOCK_D channels of one row and TILES consecutive token blocks; their partial
  dw (W, BLOCK_D) and dbias (BLOCK_D) sums go to row `b * num_blocks(1) + bid(1)` of the partials
  buffers, summed afterwards in a fixed order (no atomics). The programs of the first token
  block also write dinit. Grid: (cdiv(dim, BLOCK_D), cdiv(cdiv(seqlen, BLOCK_L), TILES), batch).
"""

import cuda.tile as ct

from ._common import int64_variant
from .causal_conv1d_common import (id_slice, id_tile_tma, raw_slice_tile, token_tile,
                                   weight_rows_plain)


def _tap(t, t_head, b, start, d_blk, seqlen, ROWS: ct.Constant[int],
         BLOCK_D: ct.Constant[int], HEAD_FRONT: ct.Constant[int],
         CHANNEL_LAST: ct.Constant[bool], SAFE: ct.Constant[bool],
         SHIFT_TMA: ct.Constant[bool], UNCHECKED: ct.Constant[bool]):
    """t's tokens start .. start+ROWS-1 as (ROWS, BLOCK_D); SAFE: any start >= -HEAD_FRONT
    (float32), else 0 <= start < seqlen (t's dtype)."""
    if SAFE:
        tile = token_tile(t, t_head, b, start, d_blk, seqlen, ROWS, BLOCK_D, HEAD_FRONT,
                          CHANNEL_LAST, False)
    else:
        tile = raw_slice_tile(t, b, start, seqlen, d_blk, ROWS, BLOCK_D, CHANNEL_LAST,
                              SHIFT_TMA, UNCHECKED)
    return tile


def _ids(seq_idx, id_head, b, start, seqlen, ROWS: ct.Constant[int],
         HEAD_FRONT: ct.Constant[int], SAFE: ct.Constant[bool], UNCHECKED: ct.Constant[bool]):
    if SAFE:
        ids = id_tile_tma(seq_idx, id_head, b, start, seqlen, ROWS, HEAD_FRONT, False)
    else:
        ids = id_slice(seq_idx, b, start, seqlen, ROWS, UNCHECKED)
    return ids


def _stream_grads(x, x_head, wts, bias_row, seq_idx, id_head, dout, dout_head, dfinal, b,
                  start, d_blk, seqlen, WIDTH: ct.Constant[int], ROWS: ct.Constant[int],
                  HEAD_FRONT: ct.Constant[int], BLOCK_D: ct.Constant[int],
                  CHANNEL_LAST: ct.Constant[bool], HAS_SEQ: ct.Constant[bool],
                  SILU: ct.Constant[bool], HAS_DFINAL: ct.Constant[bool],
                  SAFE: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool],
                  WANT_DW: ct.Constant[bool], UNCHECKED: ct.Constant[bool]):
    """For the ROWS tokens u = start..start+ROWS-1: (de(u) as (ROWS, BLOCK_D) float32, g(u),
    and (WANT_DW) the W dw products g(u) e(u-(W-1)+k) M_k(u) as a tuple of (ROWS, BLOCK_D)
    tiles, else an empty tuple)."""
    ids = ()
    if HAS_SEQ:
        # ids[i] = id(u + i - (W-1)), i < 2W-1: small (ROWS, 1) columns, all kept
        for i in ct.static_iter(range(2 * WIDTH - 1)):
            ids += (_ids(seq_idx, id_head, b, start + i - (WIDTH - 1), seqlen, ROWS,
                         HEAD_FRONT, SAFE, UNCHECKED),)
    win = ()
    for k in ct.static_iter(range(WIDTH)):
        win += (_tap(x, x_head, b, start + k - (WIDTH - 1), d_blk, seqlen, ROWS, BLOCK_D,
                     HEAD_FRONT, CHANNEL_LAST, SAFE, SHIFT_TMA, UNCHECKED),)
    de = ct.full((ROWS, BLOCK_D), 0.0, dtype=ct.float32)
    g0 = ct.full((ROWS, BLOCK_D), 0.0, dtype=ct.float32)
    dws = ()
    for s in ct.static_iter(range(WIDTH)):
        # the window holds e(u + s + k - (W-1)), k < W; g at u + s, whose id is ids[s + W-1]
        if SILU:
            if s > 0:
                moved = ()
                for k in ct.static_iter(range(1, WIDTH)):
                    moved += (win[k],)
                win = moved + (_tap(x, x_head, b, start + s, d_blk, seqlen, ROWS, BLOCK_D,
                                    HEAD_FRONT, CHANNEL_LAST, SAFE, SHIFT_TMA, UNCHECKED),)
        g = _tap(dout, dout_head, b, start + s, d_blk, seqlen, ROWS, BLOCK_D, HEAD_FRONT,
                 CHANNEL_LAST, SAFE, SHIFT_TMA, UNCHECKED).astype(ct.float32)
        if SILU:
            pre = ct.full((ROWS, BLOCK_D), 0.0, dtype=ct.float32) + bias_row
            for k in ct.static_iter(range(WIDTH)):
                tap = win[k].astype(ct.float32)
                if HAS_SEQ:
                    tap = ct.where(ids[s + k] == ids[s + WIDTH - 1], tap, 0.0)
                pre = pre + wts[k] * tap
            sig = 1.0 / (1.0 + ct.exp(-pre))
            g = g * (sig * (1.0 + pre * (1.0 - sig)))
        if HAS_SEQ:
            g = ct.where(ids[s + WIDTH - 1] >= 0, g, 0.0)
        if s == 0:
            g0 = g
            if WANT_DW:
                for k in ct.static_iter(range(WIDTH)):
                    tap = win[k].astype(ct.float32)
                    if HAS_SEQ:
                        tap = ct.where(ids[k] == ids[WIDTH - 1], tap, 0.0)
                    dws += (g * tap,)
        if HAS_SEQ:
            g = ct.where(ids[WIDTH - 1] == ids[s + WIDTH - 1], g, 0.0)
        de = de + wts[WIDTH - 1 - s] * g
    if HAS_DFINAL:
        if SAFE:
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
    return de, g0, dws


def _store_dx(dx, de, b, l_tile, d_blk, BLOCK_L: ct.Constant[int], BLOCK_D: ct.Constant[int],
              CHANNEL_LAST: ct.Constant[bool], UNCHECKED: ct.Constant[bool],
              STORE_TMA: ct.Constant[bool]):
    tile = de.astype(dx.dtype).reshape((1, BLOCK_L, BLOCK_D))
    if CHANNEL_LAST:
        ct.store(dx, index=(b, l_tile, d_blk), tile=tile, check_bounds=not UNCHECKED,
                 allow_tma=STORE_TMA)
    else:
        ct.store(dx, index=(b, l_tile, d_blk), tile=tile, order=(0, 2, 1),
                 check_bounds=not UNCHECKED, allow_tma=STORE_TMA)


def _block_step(x, x_head, wts, bias_row, seq_idx, id_head, dout, dout_head, dfinal, dx,
                dw_accs, db_acc, b, l_tile, d_blk, seqlen, WIDTH: ct.Constant[int],
                HEAD_FRONT: ct.Constant[int], BLOCK_L: ct.Constant[int],
                BLOCK_D: ct.Constant[int], CHANNEL_LAST: ct.Constant[bool],
                HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool],
                HAS_DFINAL: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool],
                UNCHECKED: ct.Constant[bool], STORE_TMA: ct.Constant[bool]):
    """Token block l_tile: dx stored, (dw_accs, db_acc) + its dw products and g returned."""
    l0 = l_tile * BLOCK_L
    edge = (l_tile == 0) | (l0 + (BLOCK_L + WIDTH - 1) > seqlen)
    if edge:
        de, g, dws = _stream_grads(x, x_head, wts, bias_row, seq_idx, id_head, dout,
                                   dout_head, dfinal, b, l0, d_blk, seqlen, WIDTH, BLOCK_L,
                                   HEAD_FRONT, BLOCK_D, CHANNEL_LAST, HAS_SEQ, SILU,
                                   HAS_DFINAL, True, False, True, False)
        _store_dx(dx, de, b, l_tile, d_blk, BLOCK_L, BLOCK_D, CHANNEL_LAST, False, STORE_TMA)
    else:
        de, g, dws = _stream_grads(x, x_head, wts, bias_row, seq_idx, id_head, dout,
                                   dout_head, dfinal, b, l0, d_blk, seqlen, WIDTH, BLOCK_L,
                                   HEAD_FRONT, BLOCK_D, CHANNEL_LAST, HAS_SEQ, SILU,
                                   HAS_DFINAL, False, SHIFT_TMA, True, UNCHECKED)
        _store_dx(dx, de, b, l_tile, d_blk, BLOCK_L, BLOCK_D, CHANNEL_LAST, UNCHECKED,
                  STORE_TMA)
    db_acc = db_acc + g
    summed = ()
    for k in ct.static_iter(range(WIDTH)):
        summed += (dw_accs[k] + dws[k],)
    dw_accs = summed
    return dw_accs, db_acc


def _bwd_stream(x, x_head, weight_t, bias, seq_idx, id_head, dout, dout_head, dfinal, dx,
                dw_part, db_part, dinit, WIDTH: ct.Constant[int], WIDTH_PAD: ct.Constant[int],
                HALO: ct.Constant[int], HEAD_FRONT: ct.Constant[int],
                BLOCK_L: ct.Constant[int], BLOCK_D: ct.Constant[int], TILES: ct.Constant[int],
                CHANNEL_LAST: ct.Constant[bool], HAS_BIAS: ct.Constant[bool],
                HAS_INIT: ct.Constant[bool], HAS_SEQ: ct.Constant[bool],
                SILU: ct.Constant[bool], HAS_DFINAL: ct.Constant[bool],
                SHIFT_TMA: ct.Constant[bool], UNCHECKED: ct.Constant[bool],
                STORE_TMA: ct.Constant[bool]):
    d_blk = ct.bid(0)
    prog_l = ct.bid(1)
    b = ct.bid(2)
    if CHANNEL_LAST:
        seqlen = x.shape[1]
    else:
        seqlen = x.shape[2]
    wts, bias_row = weight_rows_plain(weight_t, bias, d_blk, WIDTH, BLOCK_D, HAS_BIAS)
    dw_accs = ()
    for k in ct.static_iter(range(WIDTH)):
        dw_accs += (ct.full((BLOCK_L, BLOCK_D), 0.0, dtype=ct.float32),)
    db_acc = ct.full((BLOCK_L, BLOCK_D), 0.0, dtype=ct.float32)
    n_tiles = ct.cdiv(seqlen, BLOCK_L)
    if TILES == 1:
        # one block per program: no loop (a loop over blocks is unrolled and pipelined by
        # tileiras, doubling the live registers)
        dw_accs, db_acc = _block_step(
            x, x_head, wts, bias_row, seq_idx, id_head, dout, dout_head, dfinal, dx, dw_accs,
            db_acc, b, prog_l, d_blk, seqlen, WIDTH, HEAD_FRONT, BLOCK_L, BLOCK_D,
            CHANNEL_LAST, HAS_SEQ, SILU, HAS_DFINAL, SHIFT_TMA, UNCHECKED, STORE_TMA)
    else:
        for l_tile in range(prog_l * TILES, ct.minimum(n_tiles, prog_l * TILES + TILES)):
            dw_accs, db_acc = _block_step(
                x, x_head, wts, bias_row, seq_idx, id_head, dout, dout_head, dfinal, dx,
                dw_accs, db_acc, b, l_tile, d_blk, seqlen, WIDTH, HEAD_FRONT, BLOCK_L, BLOCK_D,
                CHANNEL_LAST, HAS_SEQ, SILU, HAS_DFINAL, SHIFT_TMA, UNCHECKED, STORE_TMA)
    tap_row = ct.arange(WIDTH_PAD, dtype=ct.int32).reshape((WIDTH_PAD, 1))
    dw_acc = ct.full((WIDTH_PAD, BLOCK_D), 0.0, dtype=ct.float32)
    for k in ct.static_iter(range(WIDTH)):
        dw_acc = dw_acc + ct.where(tap_row == k, ct.sum(dw_accs[k], axis=0, keepdims=True), 0.0)
    db_acc = ct.sum(db_acc, axis=0, keepdims=True)
    part = b * ct.num_blocks(1) + prog_l
    ct.store(dw_part, index=(part, 0, d_blk), tile=dw_acc.reshape((1, WIDTH_PAD, BLOCK_D)),
             allow_tma=STORE_TMA)
    ct.store(db_part, index=(part, d_blk), tile=db_acc, allow_tma=STORE_TMA)
    if HAS_INIT:
        if prog_l == 0:
            di, g_unused, dw_unused = _stream_grads(
                x, x_head, wts, bias_row, seq_idx, id_head, dout, dout_head, dfinal, b,
                1 - WIDTH, d_blk, seqlen, WIDTH, HALO, HEAD_FRONT, BLOCK_D, CHANNEL_LAST,
                HAS_SEQ, SILU, HAS_DFINAL, True, False, False, False)
            j = ct.arange(HALO, dtype=ct.int32).reshape((HALO, 1))
            c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
            ct.scatter(dinit, (b, c, j), di.astype(dinit.dtype), mask=j < WIDTH - 1)


causal_conv1d_bwd_stream = ct.kernel(_bwd_stream)
#: 64-bit indexing of x, dout and dx (2**31 elements or more)
causal_conv1d_bwd_stream_i64 = ct.kernel(int64_variant(_bwd_stream, ("x", "dout", "dx")))
