"""Kernel 2 of the forward pass: the sequential pass over chunks (chunk entry states).

For chunk c with tokens t (log2 decays G_t from decay_cumsum, G_last its last entry):

    h_{c+1} = 2^{G_last} * h_c + sum_t 2^{G_last - G_t} * dt_t * x_t (outer) B_t

computed as one tensor-core MMA  X^T (BLOCK_P x Q) @ (w * B) (Q x BLOCK_N).
Writes h_c (the state *entering* chunk c) for every chunk, and the final state after the last.

seq_idx: a token only contributes if it belongs to the sequence of the chunk's last token, and
the carried state is dropped when that sequence differs from the one the carry belongs to.
(Non-decreasing seq_idx makes this the exact reset of the recurrence.) Both are selects, not
multiplications by 0: a sequence that holds a NaN or Inf must not reach the next one's state
(0 * NaN is NaN), so the dropped tokens' x and B rows and the dropped carry are replaced by 0.
Without seq_idx nothing is dropped, and a bad token reaches every later state, as in the
recurrence.

Grid: (B * H, cdiv(P, BLOCK_P), cdiv(N, BLOCK_N)). The chunk loop is sequential inside a
program; independent (batch, head, p-tile, n-tile) slices run in parallel.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand


def _update(hid, carry, xt, bt, w, in_dtype, BLOCK_P: ct.Constant[int],
            BLOCK_N: ct.Constant[int], SCALE_X: ct.Constant[bool], FRESH_ACC: ct.Constant[bool]):
    """h <- carry * h + X^T (w B), one MMA."""
    # the weights go on the smaller operand: (w X)^T B == X^T (w B), one rounding either way
    if SCALE_X:
        lhs = mma_operand(xt.astype(ct.float32) * w[:, None], in_dtype).transpose()
        rhs = mma_operand(bt, in_dtype)
    else:
        lhs = mma_operand(xt.transpose(), in_dtype)
        rhs = mma_operand(bt.astype(ct.float32) * w[:, None], in_dtype)
    if FRESH_ACC:
        # the MMA does not wait for the carried state: only a multiply-add is sequential
        upd = ct.mma(lhs, rhs, ct.full((BLOCK_P, BLOCK_N), 0.0, dtype=ct.float32))
        return hid * carry[:, None] + upd
    return ct.mma(lhs, rhs, hid * carry[:, None])


def chunk_state_pass_fn(
    x,           # (B, L, H, P)
    b,           # (B, L, G, N)
    dt,          # (B, H, Lp) float32, from decay_cumsum
    cum,         # (B, H, Lp) float32, from decay_cumsum
    init,        # (B, H, P, N) float32 (ignored unless HAS_INIT)
    seq_idx,     # (B, L) int32 (ignored unless HAS_SEQ)
    states,      # (B, H, C, P, N) state dtype: entry state of each chunk
    final,       # (B, H, P, N) float32
    Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    BLOCK_N: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    HAS_INIT: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    LOAD_LATENCY: ct.Constant[int],
    SCALE_X: ct.Constant[bool],
    FRESH_ACC: ct.Constant[bool],
):
    bh, p_tile, n_tile = ct.bid(0), ct.bid(1), ct.bid(2)
    nheads = x.shape[2]
    batch = bh // nheads
    head = bh % nheads
    group = head // HEADS_PER_GROUP
    seqlen = x.shape[1]
    num_chunks = cum.shape[2] // Q

    if HAS_INIT:
        hid = ct.load(init, index=(batch, head, p_tile, n_tile), shape=(1, 1, BLOCK_P, BLOCK_N),
                      padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_P, BLOCK_N))
        hid = hid.astype(ct.float32)
    else:
        hid = ct.full((BLOCK_P, BLOCK_N), 0.0, dtype=ct.float32)
    # the sequence the carried state belongs to: the row's first one at the start
    seq_prev = ct.full((1,), 0, dtype=ct.int32)
    if HAS_SEQ:
        seq_prev = ct.load(seq_idx, index=(batch, 0), shape=(1, 1)).reshape((1,))

    for c in range(num_chunks):
        ct.store(states, index=(batch, head, c, p_tile, n_tile),
                 tile=hid.reshape((1, 1, 1, BLOCK_P, BLOCK_N)).astype(states.dtype))
        xt = ct.load(x, index=(batch, c, head, p_tile), shape=(1, Q, 1, BLOCK_P),
                     padding_mode=ct.PaddingMode.ZERO,
                     latency=LOAD_LATENCY).reshape((Q, BLOCK_P))
        bt = ct.load(b, index=(batch, c, group, n_tile), shape=(1, Q, 1, BLOCK_N),
                     padding_mode=ct.PaddingMode.ZERO,
                     latency=LOAD_LATENCY).reshape((Q, BLOCK_N))
        dtt = ct.load(dt, index=(batch, head, c), shape=(1, 1, Q)).reshape((Q,))
        g = ct.load(cum, index=(batch, head, c), shape=(1, 1, Q)).reshape((Q,))
        g_last = ct.extract(g, index=(Q - 1,), shape=(1,))
        w = dtt * ct.exp2(g_last - g)
        carry = ct.exp2(g_last)
        if HAS_SEQ:
            token = c * Q + ct.arange(Q, dtype=ct.int32)
            s = ct.load(seq_idx, index=(batch, c), shape=(1, Q),
                        padding_mode=ct.PaddingMode.ZERO).reshape((Q,))
            s_last = ct.max(ct.where(token < seqlen, s, -2147483647), axis=0, keepdims=True)
            in_last = s == s_last
            w = ct.where(in_last, w, 0.0)
            hid = ct.where(seq_prev == s_last, hid, 0.0)
            seq_prev = s_last
            if (ct.extract(s, index=(0,), shape=(1,)) != s_last).reshape(()):
                # a sequence ends inside this chunk (rare): its x and B rows are selected
                # away, which costs a pass of both tiles through registers
                xs = ct.load(x, index=(batch, c, head, p_tile), shape=(1, Q, 1, BLOCK_P),
                             padding_mode=ct.PaddingMode.ZERO).reshape((Q, BLOCK_P))
                bs = ct.load(b, index=(batch, c, group, n_tile), shape=(1, Q, 1, BLOCK_N),
                             padding_mode=ct.PaddingMode.ZERO).reshape((Q, BLOCK_N))
                xs = ct.where(in_last[:, None], xs, 0.0).astype(x.dtype)
                bs = ct.where(in_last[:, None], bs, 0.0).astype(b.dtype)
                hid = _update(hid, carry, xs, bs, w, x.dtype, BLOCK_P, BLOCK_N, SCALE_X,
                              FRESH_ACC)
            else:
                hid = _update(hid, carry, xt, bt, w, x.dtype, BLOCK_P, BLOCK_N, SCALE_X,
                              FRESH_ACC)
        else:
            hid = _update(hid, carry, xt, bt, w, x.dtype, BLOCK_P, BLOCK_N, SCALE_X, FRESH_ACC)

    ct.store(final, index=(batch, head, p_tile, n_tile),
             tile=hid.reshape((1, 1, BLOCK_P, BLOCK_N)))


chunk_state_pass = ct.kernel(chunk_state_pass_fn)
chunk_state_pass_i64 = ct.kernel(int64_variant(
    chunk_state_pass_fn, ["x", "b", "dt", "cum", "init", "seq_idx", "states", "final"]))
