"""Backward helper kernel: S = C B^T of every chunk and group, once, for bwd_chunk_dx (dx_cb=1).

Per batch b, chunk c (tokens cQ .. cQ+Q-1) and group g the intra-chunk score matrix

    S_ij = C_i . B_j = sum_n C[b, cQ+i, g, n] B[b, cQ+j, g, n]        (i: query, j: key token)

depends on neither the head nor the channel, yet every bwd_chunk_dx program (token block x
p-tile of one head) needs its (BQ, BQ) blocks: computed there it costs two N-deep MMAs per
block pair, repeated heads_per_group x cdiv(P, BP) times. This kernel forms each block once
(operands in the input dtype, tf32 for fp32 inputs, fp32 accumulation: the same products
bwd_chunk_dx forms, so the gradients change only in summation order) into an fp32 buffer

    cb (B, nc, G, Q, Q):  cb[b, c, g, i, j] = S_ij.

bwd_chunk_dx reads only block pairs on or below the diagonal (key blocks k <= t for y and da,
query blocks q >= t, transposed, for dx), so only those are written: blocks above the diagonal
and row blocks lying wholly past the last token are skipped, and stay unwritten. A diagonal
block is written whole (also its upper triangle, which the intra-chunk decay multiplies by 0);
tokens past L have zero B and C rows, so their entries are 0. No seq_idx masking here: the
decay L (bwd_common.intra_decay) zeroes pairs of different sequences where S is used.

Tiles: C rows (BQ, NP), B rows (BQ, NP) with NP the padded dstate (whole N per MMA); S (BQ, BQ)
with BQ = bwd_chunk_dx's BLOCK_Q. Grid: (nc * B * G, Q // BQ, Q // BQ), chunks fastest; axis 1
the row (query) block i, axis 2 the column (key) block j; programs with j > i do nothing.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand
from .bwd_common import _hint, load_rows


def chunk_cb_fn(
    b,           # (B, L, G, N)
    c,           # (B, L, G, N)
    cb,          # (B, nc, G, Q, Q) float32 out: S = C B^T per chunk and group
    Q: ct.Constant[int],
    BLOCK_Q: ct.Constant[int],
    NP: ct.Constant[int],
):
    seqlen = b.shape[1]
    ngroups = b.shape[2]
    nc = cb.shape[1]
    chunk = ct.bid(0) % nc
    bg = ct.bid(0) // nc
    batch = bg // ngroups
    group = bg % ngroups
    row = ct.bid(1)
    col = ct.bid(2)
    nbpc = Q // BLOCK_Q
    # row >= col: the lower block triangle; a row block past L would be a load wholly outside B
    if col <= row and (chunk * nbpc + row) * BLOCK_Q < seqlen:
        mm = b.dtype
        ci = mma_operand(load_rows(c, batch, chunk * nbpc + row, group, 0, BLOCK_Q, NP), mm)
        bj = mma_operand(load_rows(b, batch, chunk * nbpc + col, group, 0, BLOCK_Q, NP), mm)
        s = ct.mma(ci, bj.transpose(), ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32))
        ct.store(cb, index=(batch, chunk, group, row, col),
                 tile=s.reshape((1, 1, 1, BLOCK_Q, BLOCK_Q)))


def load_cb_block(cb, batch, chunk, group, row, col, BLOCK_Q: ct.Constant[int],
                  LAT: ct.Constant[int] = 0):
    """(BLOCK_Q, BLOCK_Q) fp32 block (row, col) of chunk `chunk`'s S = C B^T (row >= col: only
    those are written)."""
    return ct.load(cb, index=(batch, chunk, group, row, col),
                   shape=(1, 1, 1, BLOCK_Q, BLOCK_Q),
                   latency=_hint(LAT)).reshape((BLOCK_Q, BLOCK_Q))


chunk_cb = ct.kernel(chunk_cb_fn)
chunk_cb_i64 = ct.kernel(int64_variant(chunk_cb_fn, ["b", "c", "cb"]))
