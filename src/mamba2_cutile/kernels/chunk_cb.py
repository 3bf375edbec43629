"""Kernel 2c of the forward pass (only with `ForwardConfig.scan_cb`): C B^T of every chunk and
group, once, for chunk_scan.

Per batch b, chunk c (tokens cQ .. cQ+Q-1) and group g the intra-chunk score matrix

    S_ij = C_i . B_j = sum_n C[b, cQ+i, g, n] B[b, cQ+j, g, n]        (i: query, j: key token)

depends on neither the head nor the channel, yet each chunk_scan tile (a query block x p-tile
of one head) forms the blocks S[i-block, k-block] of its key blocks by N-deep MMAs: at 80 heads
in one group the same blocks are formed 80 x cdiv(P, BLOCK_P) times. Here each block is formed
once (operands in the input dtype, tf32 for fp32 inputs, fp32 accumulation: the products
chunk_scan forms itself, so outputs change only in the order of the N-deep sum's partial
tiles) into

    cb (B, nc, G, Q, Q) float32:  cb[b, c, g, i, j] = S_ij

chunk_scan reads blocks on or below the diagonal only (key block <= query block), so only
those are written; row blocks lying wholly past the last token are skipped too. A diagonal
block is written whole (its upper triangle is masked where it is used); tokens past L have
zero B and C rows, so their entries are 0. No seq_idx masking here: chunk_scan's mask drops
pairs of different sequences where S is used. A NaN/Inf in B or C stays in its row or column
of S, as in the MMAs chunk_scan would form.

Tiles: C rows (BLOCK_Q, NP), B rows (BLOCK_Q, NP), NP the padded dstate (the whole of it per
MMA); S blocks (BLOCK_Q, BLOCK_Q), BLOCK_Q = chunk_scan's. Grid: (nc * B * G, Q // BLOCK_Q,
Q // BLOCK_Q), chunks fastest; axis 1 the query block, axis 2 the key block.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand


def _rows(t, batch, blk, group, BLOCK_Q: ct.Constant[int], NP: ct.Constant[int]):
    return ct.load(t, index=(batch, blk, group, 0), shape=(1, BLOCK_Q, 1, NP),
                   padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_Q, NP))


def chunk_cb_fn(
    b,           # (B, L, G, N)
    c,           # (B, L, G, N)
    cb,          # (B, nc, G, Q, Q) float32 out
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
    # a row block wholly past L would be a load wholly outside B and C
    if col <= row and (chunk * nbpc + row) * BLOCK_Q < seqlen:
        ci = mma_operand(_rows(c, batch, chunk * nbpc + row, group, BLOCK_Q, NP), b.dtype)
        bj = mma_operand(_rows(b, batch, chunk * nbpc + col, group, BLOCK_Q, NP), b.dtype)
        s = ct.mma(ci, bj.transpose(), ct.full((BLOCK_Q, BLOCK_Q), 0.0, dtype=ct.float32))
        ct.store(cb, index=(batch, chunk, group, row, col),
                 tile=s.reshape((1, 1, 1, BLOCK_Q, BLOCK_Q)))


chunk_cb = ct.kernel(chunk_cb_fn)
chunk_cb_i64 = ct.kernel(int64_variant(chunk_cb_fn, ["b", "c", "cb"]))
