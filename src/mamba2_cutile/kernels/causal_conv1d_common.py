"""Tile loads shared by the causal conv1d kernels: token-shifted tiles of the input, of the
output gradient and of the sequence ids.

A (batch, dim, seqlen) tensor is read in its physical order: CHANNEL_LAST ones as a
(batch, seqlen, dim) array (the layout of a slice of one in_proj output), others as
(batch, dim, seqlen); either way the tiles come back as (tokens, channels). A tap at shift r of
the block at token l0 reads tokens start = l0 + r onwards: a plain tile load of a slice of the
tensor beginning at `start` (the W shifted loads of one block overlap, so after the first they
mostly hit the cache), zero-padded past the end. Before token 0 it reads the same from the
block's "head": the tokens u = -HEAD_FRONT .. BLOCK_L-1 of the extended input e(u) (the initial
states at u = -(W-1)..-1, zeros before, zeros past the end), a small copy the launcher
prepares, so that the first block needs no gather either.

`raw_slice_tile` and `id_slice` are the branch-free loads of the streamed kernels (form 1,
`causal_conv1d_fwd_stream`, `causal_conv1d_bwd_stream`) for blocks whose taps all start inside
the sequence (0 <= start < seqlen): no run-time branch, and the tile stays in the input's
dtype until the caller converts it.
"""

import cuda.tile as ct


def _slice_tile(t, b, start, stop, d_blk, ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
                CHANNEL_LAST: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool]):
    ZERO = ct.PaddingMode.ZERO
    if CHANNEL_LAST:
        view = t.slice(axis=1, start=start, stop=stop)
        tile = ct.load(view, index=(b, 0, d_blk), shape=(1, ROWS, BLOCK_D), padding_mode=ZERO,
                       allow_tma=SHIFT_TMA)
    else:
        view = t.slice(axis=2, start=start, stop=stop)
        tile = ct.load(view, index=(b, 0, d_blk), shape=(1, ROWS, BLOCK_D), order=(0, 2, 1),
                       padding_mode=ZERO, allow_tma=SHIFT_TMA)
    return tile.reshape((ROWS, BLOCK_D)).astype(ct.float32)


def raw_slice_tile(t, b, start, stop, d_blk, ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
                   CHANNEL_LAST: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool],
                   UNCHECKED: ct.Constant[bool]):
    """t's tokens start .. start+ROWS-1 (zero past `stop`) at the channel block d_blk, as
    (ROWS, BLOCK_D) in t's dtype; 0 <= start < stop. UNCHECKED: the caller guarantees the
    whole tile lies inside t (start + ROWS <= stop, a full channel block), so the load skips
    its bounds checks (tileiras 13.4+; it refuses a padding mode on such a load)."""
    if CHANNEL_LAST:
        view = t.slice(axis=1, start=start, stop=stop)
        if UNCHECKED:
            tile = ct.load(view, index=(b, 0, d_blk), shape=(1, ROWS, BLOCK_D),
                           allow_tma=SHIFT_TMA, check_bounds=False)
        else:
            tile = ct.load(view, index=(b, 0, d_blk), shape=(1, ROWS, BLOCK_D),
                           padding_mode=ct.PaddingMode.ZERO, allow_tma=SHIFT_TMA)
    else:
        view = t.slice(axis=2, start=start, stop=stop)
        if UNCHECKED:
            tile = ct.load(view, index=(b, 0, d_blk), shape=(1, ROWS, BLOCK_D), order=(0, 2, 1),
                           allow_tma=SHIFT_TMA, check_bounds=False)
        else:
            tile = ct.load(view, index=(b, 0, d_blk), shape=(1, ROWS, BLOCK_D), order=(0, 2, 1),
                           padding_mode=ct.PaddingMode.ZERO, allow_tma=SHIFT_TMA)
    return tile.reshape((ROWS, BLOCK_D))


def id_slice(seq_idx, b, start, seqlen, ROWS: ct.Constant[int], UNCHECKED: ct.Constant[bool]):
    """seq_idx(start + i) for i < ROWS as a (ROWS, 1) int32 column, 0 past the end;
    0 <= start < seqlen (UNCHECKED: start + ROWS <= seqlen)."""
    view = seq_idx.slice(axis=1, start=start, stop=seqlen)
    if UNCHECKED:
        ids = ct.load(view, index=(b, 0), shape=(1, ROWS), check_bounds=False, allow_tma=False)
    else:
        ids = ct.load(view, index=(b, 0), shape=(1, ROWS), padding_mode=ct.PaddingMode.ZERO,
                      allow_tma=False)
    return ids.reshape((ROWS, 1))


def token_tile(x, head, b, start, d_blk, seqlen, ROWS: ct.Constant[int],
               BLOCK_D: ct.Constant[int], HEAD_FRONT: ct.Constant[int],
               CHANNEL_LAST: ct.Constant[bool], SHIFT_TMA: ct.Constant[bool]):
    """e(start + i) for i < ROWS at the BLOCK_D channels of block d_blk, as (ROWS, BLOCK_D)
    float32; start >= -HEAD_FRONT, and start + ROWS <= the head's length when start < 0."""
    if start < 0:
        if CHANNEL_LAST:
            head_len = head.shape[1]
        else:
            head_len = head.shape[2]
        tile = _slice_tile(head, b, start + HEAD_FRONT, head_len, d_blk, ROWS, BLOCK_D,
                           CHANNEL_LAST, SHIFT_TMA)
    elif start < seqlen:
        tile = _slice_tile(x, b, start, seqlen, d_blk, ROWS, BLOCK_D, CHANNEL_LAST, SHIFT_TMA)
    else:
        tile = ct.full((ROWS, BLOCK_D), 0.0, dtype=ct.float32)
    return tile


def id_tile(seq_idx, id_head, b, start, seqlen, ROWS: ct.Constant[int],
            HEAD_FRONT: ct.Constant[int]):
    """`id_tile_tma` with TMA allowed (the form-0 kernels)."""
    return id_tile_tma(seq_idx, id_head, b, start, seqlen, ROWS, HEAD_FRONT, True)


def id_tile_tma(seq_idx, id_head, b, start, seqlen, ROWS: ct.Constant[int],
                HEAD_FRONT: ct.Constant[int], ID_TMA: ct.Constant[bool]):
    """id(start + i) for i < ROWS as a (ROWS, 1) int32 column: seq_idx inside the sequence,
    the row's first id before it (from id_head, laid out like the input's head), 0 past it
    (those tokens have zero input and zero output gradient, so their id never matters).
    ID_TMA=False keeps these small loads off TMA (see `weight_rows_plain`)."""
    ZERO = ct.PaddingMode.ZERO
    if start < 0:
        view = id_head.slice(axis=1, start=start + HEAD_FRONT, stop=id_head.shape[1])
        ids = ct.load(view, index=(b, 0), shape=(1, ROWS), padding_mode=ZERO,
                      allow_tma=ID_TMA)
    elif start < seqlen:
        view = seq_idx.slice(axis=1, start=start, stop=seqlen)
        ids = ct.load(view, index=(b, 0), shape=(1, ROWS), padding_mode=ZERO,
                      allow_tma=ID_TMA)
    else:
        ids = ct.full((1, ROWS), 0, dtype=ct.int32)
    return ids.reshape((ROWS, 1))


def weight_row(weight_t, k, d_blk, BLOCK_D: ct.Constant[int]):
    """Tap k's weights of the channel block as a (1, BLOCK_D) float32 row (weight_t is the
    (width, dim) transpose of the weight)."""
    return ct.load(weight_t, index=(k, d_blk), shape=(1, BLOCK_D),
                   padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)


def weight_rows_plain(weight_t, bias, d_blk, WIDTH: ct.Constant[int], BLOCK_D: ct.Constant[int],
                      HAS_BIAS: ct.Constant[bool]):
    """(the W weight rows as in `weight_row`, the bias row (zeros without bias)), all (1,
    BLOCK_D) float32, by plain loads: a TMA load of these few bytes would make the compiler
    add a producer warp group (twice the threads, mbarrier waits) to a kernel that needs
    none."""
    ZERO = ct.PaddingMode.ZERO
    wts = ()
    for k in ct.static_iter(range(WIDTH)):
        wts += (ct.load(weight_t, index=(k, d_blk), shape=(1, BLOCK_D), padding_mode=ZERO,
                        allow_tma=False).astype(ct.float32),)
    bias_row = ct.full((1, BLOCK_D), 0.0, dtype=ct.float32)
    if HAS_BIAS:
        bias_row = ct.load(bias, index=(d_blk,), shape=(BLOCK_D,), padding_mode=ZERO,
                           allow_tma=False).reshape((1, BLOCK_D)).astype(ct.float32)
    return wts, bias_row
