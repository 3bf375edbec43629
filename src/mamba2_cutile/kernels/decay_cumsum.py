"""Kernel 1 of the forward pass: per-chunk cumulative decay, in log2 space.

    dt'_t  = clamp(softplus?(dt_t + dt_bias), lo, hi)      (0 for padding tokens t >= L)
    G_t    = sum_{s <= t, s in chunk} a_s,   a_s = clamp(log2(e) * A * dt'_s, -MAX_LOG2_STEP, MAX_LOG2_STEP)
                                                 (a_s = 0 where dt'_s = 0)

Both are written in a [batch, head, token] layout padded to a whole number of chunks, so the
later kernels read them with contiguous (TMA) loads and the last entry of every chunk is the
decay of its last real token (padding adds dt' = 0), which makes partial chunks exact.

With seq_idx, the head-tile-0 programs also write where each token's sequence run begins
inside its chunk:

    start_t = max{s in [chunk start, t] : s > 0 and seq_idx[s] != seq_idx[s - 1]}, or -1 if none

(-1: the run began before the chunk, or at token 0 where the initial state carries in, so the
carried state is the token's own). chunk_scan's same-sequence mask is then one comparison per
key column, `key >= start_query`, instead of comparing every (query, key) pair's sequence ids;
for non-decreasing seq_idx (the API's requirement) the two agree.

Non-finite inputs (the scan stays causal: a bad token never changes an earlier output):

- A dt' with dt' = 0 is 0 even for A = -inf (a decay of exactly 1, as the recurrence
  defines it; padding tokens rely on it, else one A = -inf head would make G NaN).
- A step's log2 decay is clamped to +-MAX_LOG2_STEP (= 256, beyond which exp2 is 0 or inf in
  float32 anyway): A = -inf or dt' = +inf give a decay of exactly 0 without making G infinite,
  so differences G_i - G_j stay exact (A = -inf: multiples of 256) instead of -inf - -inf =
  NaN. A NaN step (dt' NaN, or A = 0 with dt' = inf) becomes -MAX_LOG2_STEP: its NaN reaches
  the outputs through dt' itself, which is kept, while G stays finite for a sequence that
  starts later in the chunk. A NaN A stays NaN.
- The clamp and softplus propagate NaN (cuTile's min/max ignore NaN by default, which would
  turn a NaN dt into lo or 20).

Tiles: dt (1, Q, BLOCK_H) read from [batch, token, head]; grid (B * num_chunks, cdiv(H, BLOCK_H)).
"""

import cuda.tile as ct

from ._common import LOG2E, int64_variant

#: bound on one token's |log2 decay|: 2^-256 is 0 in float32, and 256 tokens of it stay exact
MAX_LOG2_STEP = 256.0


def _dt_and_step(d, bias, a, token, seqlen, dt_lo: float, dt_hi: float,
                 HAS_BIAS: ct.Constant[bool], SOFTPLUS: ct.Constant[bool]):
    """(dt', a') of a (Q, K) float32 tile of raw dt (K heads; `bias` and `a` their (K,)
    dt_bias, read only with HAS_BIAS, and A; `token` the (Q,) token indices): the module
    docstring's dt'_t and the log2 decay step a'_t it sums into G_t (0 where dt'_t = 0)."""
    if HAS_BIAS:
        d = d + bias[None, :]
    if SOFTPLUS:
        # softplus(v) = log1p(e^v), and v itself above 20 (torch's threshold). log1p(u) is
        # log(w) * u / (w - 1) with w = 1 + u: exact to rounding even when u is tiny.
        u = ct.exp(ct.minimum(d, 20.0, propagate_nan=True))
        w = 1.0 + u
        log1p_u = ct.where(w == 1.0, u, ct.log(w) * (u / (w - 1.0)))
        d = ct.where(d > 20.0, d, log1p_u)
    d = ct.minimum(ct.maximum(d, dt_lo, propagate_nan=True), dt_hi, propagate_nan=True)
    d = ct.where((token < seqlen)[:, None], d, 0.0)
    step = ct.minimum(ct.maximum(d * (a * LOG2E)[None, :], -MAX_LOG2_STEP), MAX_LOG2_STEP)
    step = ct.where(ct.isnan(a)[None, :], a[None, :], step)
    return d, ct.where(d == 0.0, 0.0, step)


def decay_cumsum_fn(
    dt,          # (B, L, H) any float dtype, any strides
    A,           # (H,) float32
    dt_bias,     # (H,) float32 (ignored unless HAS_BIAS)
    dt_lo: float,
    dt_hi: float,
    dt_out,      # (B, H, Lp) float32
    cum_out,     # (B, H, Lp) float32
    seq_idx,     # (B, L) int32 (ignored unless HAS_SEQ)
    seq_start,   # (B, Lp) int32 out: start_t above (ignored unless HAS_SEQ)
    Q: ct.Constant[int],
    BLOCK_H: ct.Constant[int],
    HAS_BIAS: ct.Constant[bool],
    SOFTPLUS: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
):
    num_chunks = cum_out.shape[2] // Q
    batch, chunk = ct.bid(0) // num_chunks, ct.bid(0) % num_chunks
    head_tile = ct.bid(1)
    seqlen = dt.shape[1]
    d = ct.load(dt, index=(batch, chunk, head_tile), shape=(1, Q, BLOCK_H),
                padding_mode=ct.PaddingMode.ZERO).reshape((Q, BLOCK_H)).astype(ct.float32)
    a = ct.load(A, index=(head_tile,), shape=(BLOCK_H,),
                padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    bias = a
    if HAS_BIAS:
        bias = ct.load(dt_bias, index=(head_tile,), shape=(BLOCK_H,),
                       padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    token = chunk * Q + ct.arange(Q, dtype=ct.int32)
    d, step = _dt_and_step(d, bias, a, token, seqlen, dt_lo, dt_hi, HAS_BIAS, SOFTPLUS)
    g = ct.cumsum(step, axis=0)
    ct.store(dt_out, index=(batch, head_tile, chunk),
             tile=d.transpose().reshape((1, BLOCK_H, Q)))
    ct.store(cum_out, index=(batch, head_tile, chunk),
             tile=g.transpose().reshape((1, BLOCK_H, Q)))
    if HAS_SEQ:
        if head_tile == 0:
            cur = ct.load(seq_idx, index=(batch, chunk), shape=(1, Q),
                          padding_mode=ct.PaddingMode.ZERO).reshape((Q,))
            # token 0 has no previous token: its run goes on from the initial state, as a run
            # that began before the chunk (-1)
            prev = ct.gather(seq_idx, (batch, token - 1), mask=token > 0)
            first = (token > 0) & (cur != prev)
            start = ct.scan(ct.where(first, token, -1), axis=0,
                            func=lambda a, b: ct.maximum(a, b), identity=-1)
            ct.store(seq_start, index=(batch, chunk),
                     tile=start.reshape((1, Q)).astype(seq_start.dtype))


decay_cumsum = ct.kernel(decay_cumsum_fn)
decay_cumsum_i64 = ct.kernel(int64_variant(decay_cumsum_fn,
                                           ["dt", "A", "dt_bias", "dt_out", "cum_out",
                                            "seq_idx", "seq_start"]))
