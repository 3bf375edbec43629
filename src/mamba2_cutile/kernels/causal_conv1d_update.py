"""Causal conv1d decode update: k new tokens per row against a rolling conv state, in place.

For row r with slot s = conv_state_indices[r] (r without indices), state z = conv_state[s] of
length S, new tokens x[r, c, 0:k] and window e(u) (u = -(W-1)..k-1):

    e(u)     = x[r, c, u]                       for u >= 0
             = z[c, S + u]                      plain (shifting) state, u < 0
             = z[c, (p + u) mod S]              circular, p = cache_seqlens[r] mod S, u < 0
    out[t]   = act(bias[c] + sum_{i<W} w[c, i] e(t - (W-1) + i))
    new z    = last S entries of cat(z, x)      plain
             = z with x[t] written at (p + t) mod S, later tokens winning      circular

A negative slot (or one past the state) is a padding row: out 0, no state change.

Two launches: `causal_conv1d_update` reads the old states, writes out and each row's new
state to a (batch, dim, S) scratch; `causal_conv1d_state_copy` copies those rows into their
slots. The new state moves old entries to other positions, and within one launch nothing
orders one thread's write of an entry after another thread's read of it; the launch boundary
does. Tiles: (BLOCK_D channels, KP tokens / SP state entries), k and S rounded up to powers of
two; every access is a bounds-checked gather/scatter, so any strides work. Grid: (cdiv(dim,
BLOCK_D), batch).
"""

import cuda.tile as ct

from ._common import int64_variant
from .causal_conv1d_common import weight_row


def _slot(slots, r, nslots, HAS_IDX: ct.Constant[bool]):
    slot = ct.full((1,), 0, dtype=ct.int32).item() + r
    if HAS_IDX:
        slot = ct.load(slots, index=(r,), shape=(1,)).item()
        if slot >= nslots:
            slot = -1
    return slot


def _update(x, conv_state, weight_t, bias, cache_seqlens, slots, out, new_state,
            WIDTH: ct.Constant[int], BLOCK_D: ct.Constant[int], KP: ct.Constant[int],
            SP: ct.Constant[int], HAS_BIAS: ct.Constant[bool], SILU: ct.Constant[bool],
            CIRCULAR: ct.Constant[bool], HAS_IDX: ct.Constant[bool]):
    d_blk = ct.bid(0)
    r = ct.bid(1)
    k = x.shape[2]
    S = conv_state.shape[2]
    slot = _slot(slots, r, conv_state.shape[0], HAS_IDX)
    c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((BLOCK_D, 1))
    t = ct.arange(KP, dtype=ct.int32).reshape((1, KP))
    if slot >= 0:
        p = 0
        if CIRCULAR:
            # non-negative cache_seqlens (validated); the mod keeps p in 0..S-1
            p = ct.load(cache_seqlens, index=(r,), shape=(1,)).item() % S
        acc = ct.full((BLOCK_D, KP), 0.0, dtype=ct.float32)
        for i in range(WIDTH):
            u = t + (i - (WIDTH - 1))
            if CIRCULAR:
                pos = (p + u + S) % S
            else:
                pos = S + u
            tap = ct.gather(x, (r, c, u), mask=u >= 0).astype(ct.float32) + \
                ct.gather(conv_state, (slot, c, pos), mask=u < 0).astype(ct.float32)
            w_i = weight_row(weight_t, i, d_blk, BLOCK_D).reshape((BLOCK_D, 1))
            acc = acc + w_i * tap
        if HAS_BIAS:
            acc = acc + ct.load(bias, index=(d_blk,), shape=(BLOCK_D,),
                                padding_mode=ct.PaddingMode.ZERO).reshape(
                                    (BLOCK_D, 1)).astype(ct.float32)
        if SILU:
            acc = acc / (1.0 + ct.exp(-acc))
        ct.scatter(out, (r, c, t), acc.astype(out.dtype))
        j = ct.arange(SP, dtype=ct.int32).reshape((1, SP))
        if CIRCULAR:
            # entry j takes the last token t with (p + t) mod S == j, if any
            first = (j - p + S) % S
            last = first + S * ((k - 1 - first) // S)
            hit = first < k
            new = ct.where(hit, ct.gather(x, (r, c, last), mask=hit),
                           ct.gather(conv_state, (slot, c, j)))
        else:
            m = j + k
            new = ct.where(m < S, ct.gather(conv_state, (slot, c, m)),
                           ct.gather(x, (r, c, m - S)))
        ct.scatter(new_state, (r, c, j), new.astype(new_state.dtype))
    else:
        ct.scatter(out, (r, c, t), ct.full((BLOCK_D, KP), 0.0, dtype=out.dtype))


def _state_copy(new_state, slots, conv_state, BLOCK_D: ct.Constant[int], SP: ct.Constant[int],
                HAS_IDX: ct.Constant[bool]):
    d_blk = ct.bid(0)
    r = ct.bid(1)
    slot = _slot(slots, r, conv_state.shape[0], HAS_IDX)
    if slot >= 0:
        c = d_blk * BLOCK_D + ct.arange(BLOCK_D, dtype=ct.int32).reshape((BLOCK_D, 1))
        j = ct.arange(SP, dtype=ct.int32).reshape((1, SP))
        vals = ct.gather(new_state, (r, c, j))
        ct.scatter(conv_state, (slot, c, j), vals.astype(conv_state.dtype))


causal_conv1d_update = ct.kernel(_update)
causal_conv1d_state_copy = ct.kernel(_state_copy)
#: 64-bit indexing of the state (a large slot pool)
causal_conv1d_update_i64 = ct.kernel(int64_variant(_update, ("conv_state",)))
causal_conv1d_state_copy_i64 = ct.kernel(int64_variant(_state_copy, ("conv_state",)))
