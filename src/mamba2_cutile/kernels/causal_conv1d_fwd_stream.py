"""Causal depthwise conv1d forward, form 1 ("streamed taps"): the math of `causal_conv1d_fwd`,

    pre[t]   = bias[c] + sum_{k<W} w[c, k] * e(t-(W-1)+k) * [id(t-(W-1)+k) == id(t)]
    out[t]   = act(pre[t]) (identity or SiLU: pre * sigmoid(pre)), 0 where id(t) < 0
    final[j] = e(l-(W-1)+j) * [id(l-(W-1)+j) == id(l-1)]        (j < W-1)

with a layout of the work meant for a memory-bound kernel on many small programs.

- Interior blocks (neither the row's first nor its last, partial, one) issue their W tap loads
  as straight-line code: tap k is a load of the slice starting at l0 + k - (W-1) (>= 1, as
  BLOCK_L >= 8 > W-1); no per-tap branch, so the compiler can issue all W loads before the
  first is used (bytes in flight), and each tap stays in the input's dtype until it is
  multiplied in (one float32 accumulator live, the taps converted late). With UNCHECKED (the
  launcher's promise that BLOCK_D divides dim, and tileiras 13.4+) their loads and the store
  skip the bounds checks: every tile of an interior block lies inside the tensors.
- The edge blocks (the row's first, whose taps reach before token 0, and its last) take the
  per-tap head/x/zero branch of `causal_conv1d_common.token_tile`, as one program-uniform
  branch around the whole block.
- STORE_TMA lets the output store use TMA (else a plain store: a TMA store can make tileiras
  warp-specialize the kernel, twice the threads).
- Grid: (cdiv(dim, BLOCK_D), cdiv(cdiv(seqlen, BLOCK_L), TILES), batch); the program holding
  the last token writes the final states (`causal_conv1d_fwd._final_states`).
"""

import cuda.tile as ct

from ._common import int64_variant
from .causal_conv1d_common import (id_slice, id_tile_tma, raw_slice_tile, token_tile,
                                   weight_rows_plain)
from .causal_conv1d_fwd import _final_states


def _ids(seq_idx, id_head, b, start, seqlen, ROWS: ct.Constant[int],
         HEAD_FRONT: ct.Constant[int], SAFE: ct.Constant[bool], UNCHECKED: ct.Constant[bool]):
    if SAFE:
        ids = id_tile_tma(seq_idx, id_head, b, start, seqlen, ROWS, HEAD_FRONT, False)
    else:
        ids = id_slice(seq_idx, b, start, seqlen, ROWS, UNCHECKED)
    return ids


def _block_pre(x, x_head, seq_idx, id_head, wts, bias_row, b, l0, d_blk, seqlen,
               WIDTH: ct.Constant[int], HEAD_FRONT: ct.Constant[int],
               BLOCK_L: ct.Constant[int], BLOCK_D: ct.Constant[int],
               CHANNEL_LAST: ct.Constant[bool], HAS_SEQ: ct.Constant[bool],
               SAFE: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool],
               UNCHECKED: ct.Constant[bool]):
    """(pre of the BLOCK_L tokens from l0 as (BLOCK_L, BLOCK_D) float32, their ids (BLOCK_L,
    1)). SAFE: an edge block (taps from the head before token 0, zeros past the end)."""
    taps = ()
    for k in ct.static_iter(range(WIDTH)):
        start = l0 + k - (WIDTH - 1)
        if SAFE:
            taps += (token_tile(x, x_head, b, start, d_blk, seqlen, BLOCK_L, BLOCK_D,
                                HEAD_FRONT, CHANNEL_LAST, False),)
        else:
            taps += (raw_slice_tile(x, b, start, seqlen, d_blk, BLOCK_L, BLOCK_D, CHANNEL_LAST,
                                    SHIFT_TMA, UNCHECKED),)
    own = ct.full((BLOCK_L, 1), 0, dtype=ct.int32)
    if HAS_SEQ:
        own = _ids(seq_idx, id_head, b, l0, seqlen, BLOCK_L, HEAD_FRONT, SAFE, UNCHECKED)
    acc = ct.full((BLOCK_L, BLOCK_D), 0.0, dtype=ct.float32) + bias_row
    for k in ct.static_iter(range(WIDTH)):
        tap = taps[k].astype(ct.float32)
        if HAS_SEQ:
            if k < WIDTH - 1:
                ids = _ids(seq_idx, id_head, b, l0 + k - (WIDTH - 1), seqlen, BLOCK_L,
                           HEAD_FRONT, SAFE, UNCHECKED)
                tap = ct.where(ids == own, tap, 0.0)
        acc = acc + wts[k] * tap
    return acc, own


def _store_out(out, acc, own, b, l_tile, d_blk, BLOCK_L: ct.Constant[int],
               BLOCK_D: ct.Constant[int], CHANNEL_LAST: ct.Constant[bool],
               HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool],
               UNCHECKED: ct.Constant[bool], STORE_TMA: ct.Constant[bool]):
    if SILU:
        acc = acc / (1.0 + ct.exp(-acc))
    if HAS_SEQ:
        acc = ct.where(own >= 0, acc, 0.0)
    tile = acc.astype(out.dtype).reshape((1, BLOCK_L, BLOCK_D))
    if CHANNEL_LAST:
        ct.store(out, index=(b, l_tile, d_blk), tile=tile, check_bounds=not UNCHECKED,
                 allow_tma=STORE_TMA)
    else:
        ct.store(out, index=(b, l_tile, d_blk), tile=tile, order=(0, 2, 1),
                 check_bounds=not UNCHECKED, allow_tma=STORE_TMA)


def _block(x, x_head, seq_idx, id_head, out, wts, bias_row, b, l_tile, d_blk, seqlen,
           WIDTH: ct.Constant[int], HEAD_FRONT: ct.Constant[int], BLOCK_L: ct.Constant[int],
           BLOCK_D: ct.Constant[int], CHANNEL_LAST: ct.Constant[bool],
           HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool],
           UNCHECKED: ct.Constant[bool], STORE_TMA: ct.Constant[bool]):
    """Token block l_tile: out computed and stored (edge blocks through the safe loads)."""
    l0 = l_tile * BLOCK_L
    if (l_tile == 0) | (l0 + BLOCK_L > seqlen):
        acc, own = _block_pre(x, x_head, seq_idx, id_head, wts, bias_row, b, l0, d_blk,
                              seqlen, WIDTH, HEAD_FRONT, BLOCK_L, BLOCK_D, CHANNEL_LAST,
                              HAS_SEQ, True, False, False)
        _store_out(out, acc, own, b, l_tile, d_blk, BLOCK_L, BLOCK_D, CHANNEL_LAST,
                   HAS_SEQ, SILU, False, STORE_TMA)
    else:
        acc, own = _block_pre(x, x_head, seq_idx, id_head, wts, bias_row, b, l0, d_blk,
                              seqlen, WIDTH, HEAD_FRONT, BLOCK_L, BLOCK_D, CHANNEL_LAST,
                              HAS_SEQ, False, SHIFT_TMA, UNCHECKED)
        _store_out(out, acc, own, b, l_tile, d_blk, BLOCK_L, BLOCK_D, CHANNEL_LAST,
                   HAS_SEQ, SILU, UNCHECKED, STORE_TMA)


def _fwd_stream(x, x_head, weight_t, bias, seq_idx, id_head, out, final,
                WIDTH: ct.Constant[int], HALO: ct.Constant[int], HEAD_FRONT: ct.Constant[int],
                BLOCK_L: ct.Constant[int], BLOCK_D: ct.Constant[int], TILES: ct.Constant[int],
                CHANNEL_LAST: ct.Constant[bool], HAS_BIAS: ct.Constant[bool],
                HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool],
                HAS_FINAL: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool],
                UNCHECKED: ct.Constant[bool], STORE_TMA: ct.Constant[bool]):
    d_blk = ct.bid(0)
    prog_l = ct.bid(1)
    b = ct.bid(2)
    if CHANNEL_LAST:
        seqlen = x.shape[1]
    else:
        seqlen = x.shape[2]
    wts, bias_row = weight_rows_plain(weight_t, bias, d_blk, WIDTH, BLOCK_D, HAS_BIAS)
    n_tiles = ct.cdiv(seqlen, BLOCK_L)
    if TILES == 1:
        # one block per program: no loop (tileiras unrolls and pipelines a loop over blocks)
        _block(x, x_head, seq_idx, id_head, out, wts, bias_row, b, prog_l, d_blk, seqlen,
               WIDTH, HEAD_FRONT, BLOCK_L, BLOCK_D, CHANNEL_LAST, HAS_SEQ, SILU, SHIFT_TMA,
               UNCHECKED, STORE_TMA)
    else:
        for l_tile in range(prog_l * TILES, ct.minimum(n_tiles, prog_l * TILES + TILES)):
            _block(x, x_head, seq_idx, id_head, out, wts, bias_row, b, l_tile, d_blk, seqlen,
                   WIDTH, HEAD_FRONT, BLOCK_L, BLOCK_D, CHANNEL_LAST, HAS_SEQ, SILU,
                   SHIFT_TMA, UNCHECKED, STORE_TMA)
    if HAS_FINAL:
        if prog_l == (n_tiles - 1) // TILES:
            _final_states(x, x_head, seq_idx, id_head, final, b, d_blk, seqlen, WIDTH, HALO,
                          HEAD_FRONT, BLOCK_D, CHANNEL_LAST, HAS_SEQ)


causal_conv1d_fwd_stream = ct.kernel(_fwd_stream)
#: 64-bit indexing of x and out (2**31 elements or more)
causal_conv1d_fwd_stream_i64 = ct.kernel(int64_variant(_fwd_stream, ("x", "out")))
