"""Tile loads shared by the causal conv1d kernels: a token-shifted tile of the input and of the
sequence ids.

x is read in its physical order: CHANNEL_LAST x is a (batch, seqlen, dim) array (the layout
of a slice of one in_proj output), otherwise a (batch, dim, seqlen) one; either way the tiles
come back as (tokens, channels). A tap at shift r reads the tokens start = l0 + r onwards. Where
that range starts inside the sequence, it is a plain tile load of a slice of x beginning at
`start` (no gather; the W shifted loads of one block overlap, so after the first they mostly
hit the cache). Otherwise (the first block's taps reach the initial states at negative tokens;
the backward's forward taps can start past the end) it is a gather, bounds-checked, with the
initial states e(u) = init[b, c, W-1+u] for u < 0.
"""

import cuda.tile as ct


def token_tile(x, init, b, start, d_blk, seqlen, WIDTH: ct.Constant[int],
               ROWS: ct.Constant[int], BLOCK_D: ct.Constant[int],
               CHANNEL_LAST: ct.Constant[bool], HAS_INIT: ct.Constant[bool],
               SHIFT_TMA: ct.Constant[bool]):
    """e(start + i) for i < ROWS at the BLOCK_D channels of block d_blk, as (ROWS, BLOCK_D)
    float32: x inside the sequence, init before it (zero without HAS_INIT), zero past it."""
    ZERO = ct.PaddingMode.ZERO
    if start >= 0 and start < seqlen:
        if CHANNEL_LAST:
            view = x.slice(axis=1, start=start, stop=seqlen)
            t = ct.load(view, index=(b, 0, d_blk), shape=(1, ROWS, BLOCK_D), padding_mode=ZERO,
                        allow_tma=SHIFT_TMA)
        else:
            view = x.slice(axis=2, start=start, stop=seqlen)
            t = ct.load(view, index=(b, 0, d_blk), shape=(1, ROWS, BLOCK_D), order=(0, 2, 1),
                        padding_mode=ZERO, allow_tma=SHIFT_TMA)
        tile = t.reshape((ROWS, BLOCK_D)).astype(ct.float32)
    else:
        u = start + ct.arange(ROWS, dtype=ct.int32).reshape((ROWS, 1))
        c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((1, BLOCK_D))
        if CHANNEL_LAST:
            tile = ct.gather(x, (b, u, c)).astype(ct.float32)
        else:
            tile = ct.gather(x, (b, c, u)).astype(ct.float32)
        if HAS_INIT:
            # negative u + W-1 (below the initial states) is out of bounds: zero
            tile = tile + ct.gather(init, (b, c, u + (WIDTH - 1)), mask=u < 0).astype(ct.float32)
    return tile


def id_tile(seq_idx, b, start, seqlen, first_id, ROWS: ct.Constant[int]):
    """id(start + i) for i < ROWS as a (ROWS, 1) int32 column: seq_idx inside the sequence,
    first_id (the row's first id, which owns the initial states) before it, 0 past it (those
    tokens have zero input and zero output gradient, so their id never matters)."""
    if start >= 0 and start < seqlen:
        view = seq_idx.slice(axis=1, start=start, stop=seqlen)
        ids = ct.load(view, index=(b, 0), shape=(1, ROWS), padding_mode=ct.PaddingMode.ZERO)
        col = ids.reshape((ROWS, 1))
    else:
        u = start + ct.arange(ROWS, dtype=ct.int32).reshape((ROWS, 1))
        col = ct.where(u < 0, first_id, ct.gather(seq_idx, (b, u)))
    return col


def weight_row(weight_t, k, d_blk, BLOCK_D: ct.Constant[int]):
    """Tap k's weights of the channel block as a (1, BLOCK_D) float32 row (weight_t is the
    (width, dim) transpose of the weight)."""
    return ct.load(weight_t, index=(k, d_blk), shape=(1, BLOCK_D),
                   padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
