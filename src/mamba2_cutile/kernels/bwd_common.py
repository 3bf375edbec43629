"""Tile helpers shared by the backward kernels (inlined into each kernel by cuTile).

Notation as in `chunked_backward`: per chunk c of Q tokens, G2 = log2(e) * cumsum(A dt') (the
forward's `cum` buffer), G2_l its last entry (padding adds dt' = 0, so that is the last real
token's), and with seq_idx

    s_i  = [seq_i == seq before the chunk]      state_w_i = s_i 2^{G2_i}
    u_j  = [seq_j == seq of the chunk's last]   exit_w_j  = u_j 2^{G2_l - G2_j}
    r_c  = [seq last == seq before]             carry_w   = r_c 2^{G2_l}

"Seq before the chunk" is seq[c*Q - 1] (seq[0] for chunk 0: the initial state belongs to the
row's first sequence); "seq of the chunk's last token" is seq[min(c*Q + Q - 1, L - 1)], which
for non-decreasing seq_idx is the forward's max over the chunk's real tokens. Exponents are
masked to -inf *before* exp2, so no inf is ever formed. The load helpers take an optional
latency hint LAT (1-10; 0, the default: none).
"""

import cuda.tile as ct

from ._common import mma_operand


def _hint(LAT: ct.Constant[int]):
    """The load latency hint for LAT (1-10), or none (0)."""
    lat = None
    if LAT > 0:
        lat = LAT
    return lat


def seq_bounds(seq_idx, batch, chunk, seqlen, Q: ct.Constant[int], HAS_SEQ: ct.Constant[bool]):
    """(1,) tiles: seq id of the token before the chunk and of the chunk's last real token
    (zeros without seq_idx)."""
    before = ct.full((1,), 0, dtype=ct.int32)
    last = ct.full((1,), 0, dtype=ct.int32)
    if HAS_SEQ:
        before = ct.load(seq_idx, index=(batch, ct.maximum(chunk * Q - 1, 0)),
                         shape=(1, 1)).reshape((1,))
        last = ct.load(seq_idx, index=(batch, ct.minimum(chunk * Q + Q - 1, seqlen - 1)),
                       shape=(1, 1)).reshape((1,))
    return before, last


def block_seq(seq_idx, batch, blk, BLOCK: ct.Constant[int], HAS_SEQ: ct.Constant[bool]):
    """(BLOCK,) seq ids of token block `blk` (zeros without seq_idx; zero padding past L)."""
    if HAS_SEQ:
        return ct.load(seq_idx, index=(batch, blk), shape=(1, BLOCK),
                       padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK,))
    return ct.full((BLOCK,), 0, dtype=ct.int32)


def block_decay(cum, batch, head, blk, BLOCK: ct.Constant[int], LAT: ct.Constant[int] = 0):
    """(BLOCK,) log2 cumulative decays G2 of token block `blk` (cum is padded: always inside)."""
    return ct.load(cum, index=(batch, head, blk), shape=(1, 1, BLOCK),
                   latency=_hint(LAT)).reshape((BLOCK,))


def chunk_last_decay(cum, batch, head, chunk, Q: ct.Constant[int]):
    """(1,) G2_l: the chunk's last entry of cum."""
    return ct.load(cum, index=(batch, head, chunk * Q + Q - 1), shape=(1, 1, 1)).reshape((1,))


def state_weight(g, s, before, HAS_SEQ: ct.Constant[bool]):
    """state_w = s 2^{G2} (weight of the carried state in y)."""
    if HAS_SEQ:
        return ct.exp2(ct.where(s == before, g, -float("inf")))
    return ct.exp2(g)


def exit_weight(g, g_last, s, last, HAS_SEQ: ct.Constant[bool]):
    """exit_w = u 2^{G2_l - G2} (a token's weight in the chunk's exit state, without dt')."""
    if HAS_SEQ:
        return ct.exp2(ct.where(s == last, g_last - g, -float("inf")))
    return ct.exp2(g_last - g)


def carry_weight(g_last, before, last, HAS_SEQ: ct.Constant[bool]):
    """(1,) carry_w = r 2^{G2_l} (decay of the carried state across the chunk)."""
    if HAS_SEQ:
        return ct.where(last == before, ct.exp2(g_last), 0.0)
    return ct.exp2(g_last)


def intra_decay(g_row, g_col, tok_row, tok_col, s_row, s_col, HAS_SEQ: ct.Constant[bool]):
    """(R, K) L = 2^{G2_row - G2_col} on [tok_row >= tok_col] (and the same sequence), else 0."""
    keep = tok_row[:, None] >= tok_col[None, :]
    if HAS_SEQ:
        keep = keep & (s_row[:, None] == s_col[None, :])
    return ct.exp2(ct.where(keep, g_row[:, None] - g_col[None, :], -float("inf")))


def load_dy(dout, z, batch, blk, head, p_tile, BLOCK: ct.Constant[int],
            BLOCK_P: ct.Constant[int], HAS_Z: ct.Constant[bool], LAT: ct.Constant[int] = 0):
    """(BLOCK, BLOCK_P) fp32 dY = dout * silu(z) (dout without z); zero past L and P."""
    do = ct.load(dout, index=(batch, blk, head, p_tile), shape=(1, BLOCK, 1, BLOCK_P),
                 padding_mode=ct.PaddingMode.ZERO,
                 latency=_hint(LAT)).reshape((BLOCK, BLOCK_P)).astype(ct.float32)
    if HAS_Z:
        zt = ct.load(z, index=(batch, blk, head, p_tile), shape=(1, BLOCK, 1, BLOCK_P),
                     padding_mode=ct.PaddingMode.ZERO,
                     latency=_hint(LAT)).reshape((BLOCK, BLOCK_P))
        zt = zt.astype(ct.float32)
        return do * (zt / (1.0 + ct.exp(-zt)))
    return do


def load_rows(t, batch, blk, col, c_tile, BLOCK: ct.Constant[int], WIDTH: ct.Constant[int],
              LAT: ct.Constant[int] = 0):
    """(BLOCK, WIDTH) tile of a (B, L, heads or groups, width) tensor, zero past the ends."""
    return ct.load(t, index=(batch, blk, col, c_tile), shape=(1, BLOCK, 1, WIDTH),
                   padding_mode=ct.PaddingMode.ZERO, latency=_hint(LAT)).reshape((BLOCK, WIDTH))


def load_state_raw(t, batch, head, chunk, p_tile, n_tile, BLOCK_P: ct.Constant[int],
                   BLOCK_N: ct.Constant[int], LAT: ct.Constant[int] = 0):
    """(BLOCK_P, BLOCK_N) tile of a (B, H, C, P, N) per-chunk state tensor, in its dtype."""
    return ct.load(t, index=(batch, head, chunk, p_tile, n_tile),
                   shape=(1, 1, 1, BLOCK_P, BLOCK_N), padding_mode=ct.PaddingMode.ZERO,
                   latency=_hint(LAT)).reshape((BLOCK_P, BLOCK_N))


def load_state(t, batch, head, chunk, p_tile, n_tile, BLOCK_P: ct.Constant[int],
               BLOCK_N: ct.Constant[int], LAT: ct.Constant[int] = 0):
    """(BLOCK_P, BLOCK_N) fp32 tile of a (B, H, C, P, N) per-chunk state tensor."""
    return load_state_raw(t, batch, head, chunk, p_tile, n_tile, BLOCK_P, BLOCK_N,
                          LAT).astype(ct.float32)


def wop(tile, like, LOWP: ct.Constant[bool]):
    """Operand of an MMA with a computed fp32 factor (decayed Q x Q weights, gated dY): tf32
    (near-fp32), or with LOWP the input dtype (half the MMA cost, mamba_ssm's choice)."""
    if LOWP:
        return mma_operand(tile, like)
    return tile.astype(ct.tfloat32)


def dy_op(tile, like, LOWP: ct.Constant[bool], HAS_Z: ct.Constant[bool]):
    """Operand for dY (and its partner X) in dY X^T: without z dY is dout itself, exact in the
    input dtype; with z it is computed, so tf32 unless LOWP."""
    if HAS_Z:
        return wop(tile, like, LOWP)
    return mma_operand(tile, like)
