"""Causal depthwise conv1d forward, form 2 ("tap views", channel-last): the math of
`causal_conv1d_fwd`,

    pre[t]   = bias[c] + sum_{k<W} w[c, k] * e(t-(W-1)+k) * [id(t-(W-1)+k) == id(t)]
    out[t]   = act(pre[t]) (identity or SiLU: pre * sigmoid(pre)), 0 where id(t) < 0
    final[j] = e(l-(W-1)+j) * [id(l-(W-1)+j) == id(l-1)]        (j < W-1)

with every tap an aligned tile load. The launcher passes the input as an overlapping
(batch, W, l-(W-1), dim) view `taps` with taps[b, k, r] = x[b, r + k] (the tap axis has the
token stride), the output as its rows from token W-1 on (`out_tail[b, r] = out[b, r + W-1]`)
and the ids likewise. Output token t = r + (W-1) reads tap k at taps[b, k, r], so the program
of rows r0 .. r0+BLOCK_L-1 loads tile (b, k, r0/BLOCK_L, d_blk) of shape (1, 1, BLOCK_L,
BLOCK_D) for each k: no slice, no run-time offset, no per-tap branch; each tap a TMA-able
load (bounds past the end are the view's own: rows past l-(W-1) read zeros and are not
stored).

The first W-1 output tokens (whose taps reach before token 0: the initial states) are
computed by the programs of the first row block from the launcher's small head copy (see
`causal_conv1d_common`) and scattered. Grid: (cdiv(dim, BLOCK_D), max(1, cdiv(cdiv(l-(W-1),
BLOCK_L), TILES)), batch); the program holding the last token writes the final states.
"""

import cuda.tile as ct

from ._common import int64_variant
from .causal_conv1d_common import id_tile_tma, token_tile, weight_rows_plain
from .causal_conv1d_fwd import _final_states


def _head_tokens(x, x_head, seq_idx, id_head, out, wts, bias_row, b, d_blk, seqlen,
                 WIDTH: ct.Constant[int], HALO: ct.Constant[int], HEAD_FRONT: ct.Constant[int],
                 BLOCK_D: ct.Constant[int], HAS_SEQ: ct.Constant[bool],
                 SILU: ct.Constant[bool]):
    """out[t] for t < min(W-1, seqlen), from the head (HALO rows, scattered)."""
    own = ct.full((HALO, 1), 0, dtype=ct.int32)
    if HAS_SEQ:
        own = id_tile_tma(seq_idx, id_head, b, 0, seqlen, HALO, HEAD_FRONT, False)
    acc = ct.full((HALO, BLOCK_D), 0.0, dtype=ct.float32) + bias_row
    for k in ct.static_iter(range(WIDTH)):
        start = k - (WIDTH - 1)
        tap = token_tile(x, x_head, b, start, d_blk, seqlen, HALO, BLOCK_D, HEAD_FRONT, True,
                         False)
        if HAS_SEQ:
            ids = id_tile_tma(seq_idx, id_head, b, start, seqlen, HALO, HEAD_FRONT, False)
            tap = ct.where(ids == own, tap, 0.0)
        acc = acc + wts[k] * tap
    if SILU:
        acc = acc / (1.0 + ct.exp(-acc))
    if HAS_SEQ:
        acc = ct.where(own >= 0, acc, 0.0)
    t = ct.arange(HALO, dtype=ct.int32).reshape((HALO, 1))
    c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
    ct.scatter(out, (b, t, c), acc.astype(out.dtype), mask=(t < WIDTH - 1) & (t < seqlen))


def _rows(taps, id_taps, out_tail, wts, bias_row, b, r_tile, d_blk,
          WIDTH: ct.Constant[int], BLOCK_L: ct.Constant[int], BLOCK_D: ct.Constant[int],
          HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool]):
    """out_tail rows r_tile*BLOCK_L .. +BLOCK_L-1 (tokens from (W-1) + r_tile*BLOCK_L)."""
    loaded = ()
    for k in ct.static_iter(range(WIDTH)):
        loaded += (ct.load(taps, index=(b, k, r_tile, d_blk), shape=(1, 1, BLOCK_L, BLOCK_D),
                           padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_L, BLOCK_D)),)
    own = ct.full((BLOCK_L, 1), 0, dtype=ct.int32)
    if HAS_SEQ:
        own = ct.load(id_taps, index=(b, WIDTH - 1, r_tile), shape=(1, 1, BLOCK_L),
                      padding_mode=ct.PaddingMode.ZERO, allow_tma=False).reshape((BLOCK_L, 1))
    acc = ct.full((BLOCK_L, BLOCK_D), 0.0, dtype=ct.float32) + bias_row
    for k in ct.static_iter(range(WIDTH)):
        tap = loaded[k].astype(ct.float32)
        if HAS_SEQ:
            if k < WIDTH - 1:
                ids = ct.load(id_taps, index=(b, k, r_tile), shape=(1, 1, BLOCK_L),
                              padding_mode=ct.PaddingMode.ZERO,
                              allow_tma=False).reshape((BLOCK_L, 1))
                tap = ct.where(ids == own, tap, 0.0)
        acc = acc + wts[k] * tap
    if SILU:
        acc = acc / (1.0 + ct.exp(-acc))
    if HAS_SEQ:
        acc = ct.where(own >= 0, acc, 0.0)
    ct.store(out_tail, index=(b, r_tile, d_blk),
             tile=acc.astype(out_tail.dtype).reshape((1, BLOCK_L, BLOCK_D)))


def _fwd_taps(x, x_head, taps, weight_t, bias, seq_idx, id_head, id_taps, out, out_tail, final,
              WIDTH: ct.Constant[int], HALO: ct.Constant[int], HEAD_FRONT: ct.Constant[int],
              BLOCK_L: ct.Constant[int], BLOCK_D: ct.Constant[int], TILES: ct.Constant[int],
              HAS_BIAS: ct.Constant[bool], HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool],
              HAS_FINAL: ct.Constant[bool]):
    d_blk = ct.bid(0)
    prog_l = ct.bid(1)
    b = ct.bid(2)
    seqlen = x.shape[1]
    wts, bias_row = weight_rows_plain(weight_t, bias, d_blk, WIDTH, BLOCK_D, HAS_BIAS)
    if prog_l == 0:
        _head_tokens(x, x_head, seq_idx, id_head, out, wts, bias_row, b, d_blk, seqlen, WIDTH,
                     HALO, HEAD_FRONT, BLOCK_D, HAS_SEQ, SILU)
    n_rows = taps.shape[2]
    n_tiles = ct.cdiv(n_rows, BLOCK_L)
    if TILES == 1:
        if prog_l < n_tiles:
            _rows(taps, id_taps, out_tail, wts, bias_row, b, prog_l, d_blk, WIDTH, BLOCK_L,
                  BLOCK_D, HAS_SEQ, SILU)
    else:
        for r_tile in range(prog_l * TILES, ct.minimum(n_tiles, prog_l * TILES + TILES)):
            _rows(taps, id_taps, out_tail, wts, bias_row, b, r_tile, d_blk, WIDTH, BLOCK_L,
                  BLOCK_D, HAS_SEQ, SILU)
    if HAS_FINAL:
        if prog_l == ct.maximum(n_tiles - 1, 0) // TILES:
            _final_states(x, x_head, seq_idx, id_head, final, b, d_blk, seqlen, WIDTH, HALO,
                          HEAD_FRONT, BLOCK_D, True, HAS_SEQ)


causal_conv1d_fwd_taps = ct.kernel(_fwd_taps)
#: 64-bit indexing of x, its tap view and out (2**31 elements or more)
causal_conv1d_fwd_taps_i64 = ct.kernel(int64_variant(_fwd_taps, ("x", "taps", "out",
                                                                 "out_tail")))
