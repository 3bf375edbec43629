"""Causal depthwise conv1d forward, bias and SiLU fused, with the final states.

For batch row b, channel c, token t, width W (see `reference.conv1d` for the definition):

    pre[t]   = bias[c] + sum_{k<W} w[c, k] * e(t-(W-1)+k) * [id(t-(W-1)+k) == id(t)]
    out[t]   = act(pre[t]) (identity or SiLU: pre * sigmoid(pre)), 0 where id(t) < 0
    final[j] = e(l-(W-1)+j) * [id(l-(W-1)+j) == id(l-1)]        (j < W-1)

e(u) is x, the initial states before token 0, zero past the end; id is seq_idx, the row's
first id before token 0 (both before token 0 from the launcher's small "head" copies, see
`causal_conv1d_common`). Accumulation in float32; out in out's dtype.

Tiles: a program owns BLOCK_D channels of one row and TILES consecutive blocks of BLOCK_L
tokens; per block it reads the W token-shifted tiles of x (`causal_conv1d_common.token_tile`:
the block plus its W-1 token halo) and writes one output tile. The program holding the last
token also writes the final states (a gather of W-1 tokens). Grid: (cdiv(dim, BLOCK_D),
cdiv(cdiv(seqlen, BLOCK_L), TILES), batch). Memory-bound: x is read once from DRAM and out
written once.
"""

import cuda.tile as ct

from ._common import int64_variant
from .causal_conv1d_common import id_tile, token_tile, weight_row


def _final_states(x, x_head, seq_idx, id_head, final, b, d_blk, seqlen,
                  WIDTH: ct.Constant[int], HALO: ct.Constant[int],
                  HEAD_FRONT: ct.Constant[int], BLOCK_D: ct.Constant[int],
                  CHANNEL_LAST: ct.Constant[bool], HAS_SEQ: ct.Constant[bool]):
    """final[b, c, j] = e(l-(W-1)+j), masked to the last token's sequence, j < W-1 (HALO is W-1
    rounded up to a power of two)."""
    j = ct.arange(HALO, dtype=ct.int32).reshape((HALO, 1))
    start = seqlen - (WIDTH - 1)
    vals = token_tile(x, x_head, b, start, d_blk, seqlen, HALO, BLOCK_D, HEAD_FRONT,
                      CHANNEL_LAST, False)
    if HAS_SEQ:
        ids = id_tile(seq_idx, id_head, b, start, seqlen, HALO, HEAD_FRONT)
        last = ct.load(seq_idx, index=(b, seqlen - 1), shape=(1, 1)).reshape((1, 1))
        vals = ct.where(ids == last, vals, 0.0)
    c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
    ct.scatter(final, (b, c, j), vals.astype(final.dtype), mask=j < WIDTH - 1)


def _fwd(x, x_head, weight_t, bias, seq_idx, id_head, out, final,
         WIDTH: ct.Constant[int], HALO: ct.Constant[int], HEAD_FRONT: ct.Constant[int],
         BLOCK_L: ct.Constant[int], BLOCK_D: ct.Constant[int], TILES: ct.Constant[int],
         CHANNEL_LAST: ct.Constant[bool], HAS_BIAS: ct.Constant[bool],
         HAS_SEQ: ct.Constant[bool], SILU: ct.Constant[bool], HAS_FINAL: ct.Constant[bool],
         SHIFT_TMA: ct.Constant[bool]):
    d_blk = ct.bid(0)
    prog_l = ct.bid(1)
    b = ct.bid(2)
    if CHANNEL_LAST:
        seqlen = x.shape[1]
    else:
        seqlen = x.shape[2]
    wts = ()
    for k in ct.static_iter(range(WIDTH)):
        wts += (weight_row(weight_t, k, d_blk, BLOCK_D),)
    bias_row = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
    if HAS_BIAS:
        bias_row = ct.load(bias, index=(d_blk,), shape=(BLOCK_D,),
                           padding_mode=ct.PaddingMode.ZERO).reshape(
                               (1, BLOCK_D)).astype(ct.float32)
    n_tiles = ct.cdiv(seqlen, BLOCK_L)
    for l_tile in range(prog_l * TILES, ct.minimum(n_tiles, prog_l * TILES + TILES)):
        l0 = l_tile * BLOCK_L
        acc = ct.full((BLOCK_L, BLOCK_D), 0.0, dtype=ct.float32) + bias_row
        own = ct.full((BLOCK_L, 1), 0, dtype=ct.int32)
        if HAS_SEQ:
            own = id_tile(seq_idx, id_head, b, l0, seqlen, BLOCK_L, HEAD_FRONT)
        for k in ct.static_iter(range(WIDTH)):
            start = l0 + k - (WIDTH - 1)
            tap = token_tile(x, x_head, b, start, d_blk, seqlen, BLOCK_L, BLOCK_D, HEAD_FRONT,
                             CHANNEL_LAST, SHIFT_TMA)
            if HAS_SEQ:
                ids = id_tile(seq_idx, id_head, b, start, seqlen, BLOCK_L, HEAD_FRONT)
                tap = ct.where(ids == own, tap, 0.0)
            acc = acc + wts[k] * tap
        if SILU:
            acc = acc / (1.0 + ct.exp(-acc))
        if HAS_SEQ:
            acc = ct.where(own >= 0, acc, 0.0)
        tile = acc.astype(out.dtype).reshape((1, BLOCK_L, BLOCK_D))
        if CHANNEL_LAST:
            ct.store(out, index=(b, l_tile, d_blk), tile=tile)
        else:
            ct.store(out, index=(b, l_tile, d_blk), tile=tile, order=(0, 2, 1))
    if HAS_FINAL:
        if prog_l == (n_tiles - 1) // TILES:
            _final_states(x, x_head, seq_idx, id_head, final, b, d_blk, seqlen, WIDTH, HALO,
                          HEAD_FRONT, BLOCK_D, CHANNEL_LAST, HAS_SEQ)


causal_conv1d_fwd = ct.kernel(_fwd)
#: 64-bit indexing of x and out (2**31 elements or more)
causal_conv1d_fwd_i64 = ct.kernel(int64_variant(_fwd, ("x", "out")))
