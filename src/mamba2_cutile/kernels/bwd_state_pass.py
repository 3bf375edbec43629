"""Backward kernel 1: the reverse sequential pass over chunks (adjoint of chunk_state_pass).

With dS_c = dLoss/dh_{c+1} (the gradient at chunk c's EXIT state), dY = dout * silu(z):

    dS_{nc-1} = dfinal (or 0)
    dh_c      = carry_w dS_c  +  dY_c^T (P x Q) @ (state_w * C_c) (Q x N)
    dS_{c-1}  = dh_c;          dinitial_states = dh_0

(chunked_backward.stage3_reverse_state_pass). One tensor-core MMA per chunk, both operands in
the input dtype (as the forward's chunk_state_pass), the weights on the smaller of the two
operand tiles (SCALE_DY: on dY when BLOCK_P < BLOCK_N, else on C; (w dY)^T C == dY^T (w C), one
rounding either way). FRESH_ACC: the MMA into a fresh accumulator, then dh_c = carry_w dS_c +
that, so the chunk's MMA does not wait for the carried gradient (only a multiply-add is
sequential).
Writes dS_c for every chunk (state dtype, default fp32) and dh_0 (fp32) when HAS_INIT.

Tiles: dY (Q, BLOCK_P) from dout/z, C (Q, BLOCK_N), G2 (Q,), seq (Q,), dS (BLOCK_P, BLOCK_N).
Grid: (B * H, cdiv(P, BLOCK_P), cdiv(N, BLOCK_N)); the chunk loop is sequential (c = nc-1..0).

SEGMENTS > 1 (BackwardConfig.bstate_segments): the loop in SEGMENTS parallel runs of
C / SEGMENTS chunks (as chunk_state_pass's; grid axis 2: n-tiles x SEGMENTS), each from a zero gradient (the
last from dfinal), as chunk_state_pass's segments in reverse: the local dS_c are stored with
f_c, the product of the carry weights of the run's chunks after c (chunk_factor), and each
run's end gradient and factor (seg_final, seg_factor); `chunk_state_carry` (REVERSE) adds
f_c times the gradient entering the run from the later ones, and writes dh_0.
"""

import cuda.tile as ct

from ._common import int64_variant, mma_operand, state_segment
from .bwd_common import (
    block_decay,
    block_seq,
    carry_weight,
    load_dy,
    load_rows,
    seq_bounds,
    state_weight,
)


def bwd_state_pass_fn(
    dout,        # (B, L, H, P) x's dtype
    z,           # (B, L, H, P) (ignored unless HAS_Z)
    c,           # (B, L, G, N)
    cum,         # (B, H, Lp) float32, log2-space per-chunk cumsum (decay_cumsum)
    seq_idx,     # (B, L) int32 (ignored unless HAS_SEQ)
    dfinal,      # (B, H, P, N) float32 (ignored unless HAS_DFINAL)
    dstates,     # (B, H, C, P, N) out: dS_c, the gradient at each chunk's exit state
    dinit,       # (B, H, P, N) float32 out: dh_0 (written only if HAS_INIT)
    Q: ct.Constant[int],
    BLOCK_P: ct.Constant[int],
    BLOCK_N: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    HAS_SEQ: ct.Constant[bool],
    HAS_DFINAL: ct.Constant[bool],
    HAS_INIT: ct.Constant[bool],
    LAT: ct.Constant[int],        # load latency hint of the per-chunk loads (0: none)
    SEGMENTS: ct.Constant[int],
    SCALE_DY: ct.Constant[bool],
    FRESH_ACC: ct.Constant[bool],
    seg_final,   # (B, H, SEGMENTS, P, N) float32: each run's end gradient from its own start
    seg_factor,  # (B, H, SEGMENTS) float32
    chunk_factor,  # (B, H, C) float32: f_c
):
    bh, p_tile = ct.bid(0), ct.bid(1)
    nheads = dout.shape[2]
    batch = bh // nheads
    head = bh % nheads
    group = head // HEADS_PER_GROUP
    seqlen = dout.shape[1]
    num_chunks = cum.shape[2] // Q
    n_tile = ct.bid(2)
    seg = 0
    c_begin = 0
    c_end = num_chunks
    last_seg = True
    if SEGMENTS > 1:
        n_tile, seg, c_begin, c_end = state_segment(c.shape[3], BLOCK_N, num_chunks,
                                                    SEGMENTS)
        last_seg = seg == SEGMENTS - 1
        writer = p_tile + n_tile == 0           # f_c is the same for every tile: one writes it
        factor = ct.full((1,), 1.0, dtype=ct.float32)

    dh = ct.full((BLOCK_P, BLOCK_N), 0.0, dtype=ct.float32)
    if HAS_DFINAL:
        if last_seg:                            # earlier runs start from zero
            dh = ct.load(dfinal, index=(batch, head, p_tile, n_tile),
                         shape=(1, 1, BLOCK_P, BLOCK_N),
                         padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_P, BLOCK_N))
            dh = dh.astype(ct.float32)

    for i in range(c_end - c_begin):
        chunk = c_end - 1 - i
        ct.store(dstates, index=(batch, head, chunk, p_tile, n_tile),
                 tile=dh.reshape((1, 1, 1, BLOCK_P, BLOCK_N)).astype(dstates.dtype))
        if SEGMENTS > 1:
            if writer:
                ct.store(chunk_factor, index=(batch, head, chunk),
                         tile=factor.reshape((1, 1, 1)))
        dy = load_dy(dout, z, batch, chunk, head, p_tile, Q, BLOCK_P, HAS_Z, LAT)
        ct_ = load_rows(c, batch, chunk, group, n_tile, Q, BLOCK_N, LAT)
        g = block_decay(cum, batch, head, chunk, Q, LAT)
        g_last = ct.extract(g, index=(Q - 1,), shape=(1,))
        s = block_seq(seq_idx, batch, chunk, Q, HAS_SEQ)
        before, last = seq_bounds(seq_idx, batch, chunk, seqlen, Q, HAS_SEQ)
        w = state_weight(g, s, before, HAS_SEQ)
        carry = carry_weight(g_last, before, last, HAS_SEQ)
        if SCALE_DY:
            lhs = mma_operand(dy * w[:, None], c.dtype).transpose()
            rhs = mma_operand(ct_, c.dtype)
        else:
            lhs = mma_operand(dy.transpose(), c.dtype)
            rhs = mma_operand(ct_.astype(ct.float32) * w[:, None], c.dtype)
        carried = dh * carry[:, None]
        if HAS_SEQ:
            # a select, not a product with the zero carry weight (0 * NaN is NaN): a later
            # sequence's NaN/Inf in the gradient carried back across a reset never reaches an
            # earlier sequence's state gradient
            carried = ct.where(last == before, carried, 0.0)
        if FRESH_ACC:
            dh = carried + ct.mma(lhs, rhs, ct.full((BLOCK_P, BLOCK_N), 0.0, dtype=ct.float32))
        else:
            dh = ct.mma(lhs, rhs, carried)
        if SEGMENTS > 1:
            factor = factor * carry

    if SEGMENTS > 1:
        ct.store(seg_final, index=(batch, head, seg, p_tile, n_tile),
                 tile=dh.reshape((1, 1, 1, BLOCK_P, BLOCK_N)))
        if writer:
            ct.store(seg_factor, index=(batch, head, seg), tile=factor.reshape((1, 1, 1)))
    elif HAS_INIT:
        ct.store(dinit, index=(batch, head, p_tile, n_tile),
                 tile=dh.reshape((1, 1, BLOCK_P, BLOCK_N)).astype(dinit.dtype))


bwd_state_pass = ct.kernel(bwd_state_pass_fn)
bwd_state_pass_i64 = ct.kernel(int64_variant(
    bwd_state_pass_fn, ["dout", "z", "c", "cum", "seq_idx", "dfinal", "dstates", "dinit",
                        "seg_final", "seg_factor", "chunk_factor"]))
