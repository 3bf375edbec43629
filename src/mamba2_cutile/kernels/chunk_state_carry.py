"""Kernel 2b of the forward pass (only with `ForwardConfig.state_segments` S > 1): the states
entering each segment of `chunk_state_pass`'s segmented loop, added to its local states; with
REVERSE the same for the backward's reverse pass (`bwd_state_pass`, BackwardConfig's
bstate_segments), whose segments are entered from the later ones.

With l_c, f_c, E_s (the segment's end state from a zero start; segment 0 from init) and F_s
(its end factor) from the segmented pass (chunk_state_pass's docstring), the state entering
segment s is the recurrence over segments

    H_0 = 0,   H_s = F_{s-1} H_{s-1} + E_{s-1}

and every chunk c of segment s >= 1 gets  h_c = l_c + f_c H_s  (in float32, stored in the
state dtype); the final state is F_{S-1} H_{S-1} + E_{S-1}. REVERSE (dS_c, the exit-state
gradients, from the last segment down): H_{S-1} = 0, H_s = F_{s+1} H_{s+1} + E_{s+1}, every
chunk of segment s < S-1 gets dS_c = l_c + f_c H_s, and dinitial_states = F_0 H_0 + E_0
(written when WRITE_END).

ENTRY_ONLY (ForwardConfig.segment_fold): the chunks' states are left local; each program
writes H_s itself to `entry` (zeros for segment 0), and the output launch (chunk_scan or
chunk_scan_group) adds f_c H_s to the state it loads (chunk_scan._entry_state), so the states
make no second round trip through memory.

Every product f H is a select where f = 0 (a seq_idx reset: the state of another sequence,
which may hold a NaN, is dropped, never multiplied by 0), as in chunk_state_pass.

Program (bh, p-tile, n-tile * S + s) forms H_s itself from the s earlier segments' end states
(S is small: a few (BLOCK_P, BLOCK_N) float32 tiles each), then rewrites the states of its
segment's chunks; they do not depend on one another, so their loads are issued ahead
(LOAD_LATENCY). Segment 0's programs (REVERSE: segment S-1's) have nothing to add; the last
segment's (REVERSE: segment 0's) write the end state.
Grid: (B * H, cdiv(P, BLOCK_P), cdiv(N, BLOCK_N) * S).
"""

import cuda.tile as ct

from ._common import int64_variant, state_segment


def _carried_state(seg_final, seg_factor, batch, head, p_tile, n_tile, seg,
                   SEGMENTS: ct.Constant[int], BLOCK_P: ct.Constant[int],
                   BLOCK_N: ct.Constant[int], REVERSE: ct.Constant[bool]):
    """H_s of the module docstring, the (BLOCK_P, BLOCK_N) float32 tile entering segment
    `seg` from the segments before it (REVERSE: after it). Also the walk's entering state
    (kernels/chunk_scan_walk.py, CARRY), so the two form the same values."""
    tile = (1, 1, 1, BLOCK_P, BLOCK_N)
    carry = ct.full((BLOCK_P, BLOCK_N), 0.0, dtype=ct.float32)
    s_from, s_to = 0, seg
    if REVERSE:
        s_from, s_to = seg + 1, SEGMENTS
    for i in range(s_to - s_from):
        src = s_from + i
        if REVERSE:
            src = SEGMENTS - 1 - i
        end = ct.load(seg_final, index=(batch, head, src, p_tile, n_tile), shape=tile,
                      padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_P, BLOCK_N))
        f = ct.load(seg_factor, index=(batch, head, src), shape=(1, 1, 1)).reshape((1, 1))
        # a select where F = 0 (a seq_idx reset): 0 * NaN would keep a NaN it drops
        carry = ct.where(f == 0.0, 0.0, carry * f) + end
    return carry


def chunk_state_carry_fn(
    seg_final,     # (B, H, S, P, N) float32: E_s
    seg_factor,    # (B, H, S) float32: F_s
    chunk_factor,  # (B, H, C) float32: f_c
    states,        # (B, H, C, P, N) state dtype: l_c in, h_c out
    final,         # (B, H, P, N) float32 out: the end state (written only if WRITE_END)
    entry,         # (B, H, S, P, N) float32 out: H_s (written only if ENTRY_ONLY)
    BLOCK_P: ct.Constant[int],
    BLOCK_N: ct.Constant[int],
    SEGMENTS: ct.Constant[int],
    LOAD_LATENCY: ct.Constant[int],
    REVERSE: ct.Constant[bool],
    WRITE_END: ct.Constant[bool],
    ENTRY_ONLY: ct.Constant[bool],
):
    bh, p_tile = ct.bid(0), ct.bid(1)
    # the sizes from the segment scratch, not from `states`: with ENTRY_ONLY the walk
    # (kernels/chunk_scan_walk.py) passes a stand-in it never writes
    nheads = seg_final.shape[1]
    batch = bh // nheads
    head = bh % nheads
    n_tile, seg, c_begin, c_end = state_segment(seg_final.shape[4], BLOCK_N,
                                                chunk_factor.shape[2], SEGMENTS)
    tile = (1, 1, 1, BLOCK_P, BLOCK_N)
    lat = None if LOAD_LATENCY == 0 else LOAD_LATENCY
    # the segments that enter this one: those before it, or after it with REVERSE
    carry = _carried_state(seg_final, seg_factor, batch, head, p_tile, n_tile, seg, SEGMENTS,
                           BLOCK_P, BLOCK_N, REVERSE)
    s_from, s_to = 0, seg
    if REVERSE:
        s_from, s_to = seg + 1, SEGMENTS
    if ENTRY_ONLY:
        ct.store(entry, index=(batch, head, seg, p_tile, n_tile), tile=carry.reshape(tile))
    elif s_to > s_from:
        for c in range(c_begin, c_end):
            loc = ct.load(states, index=(batch, head, c, p_tile, n_tile), shape=tile,
                          padding_mode=ct.PaddingMode.ZERO, latency=lat)
            f = ct.load(chunk_factor, index=(batch, head, c), shape=(1, 1, 1), latency=lat)
            # a select, not a product: f_c = 0 where a seq_idx reset dropped the carried state,
            # and 0 * NaN would carry another sequence's NaN / Inf into this one
            f = f.reshape((1, 1))
            h = loc.reshape((BLOCK_P, BLOCK_N)).astype(ct.float32) + ct.where(
                f == 0.0, 0.0, f * carry)
            ct.store(states, index=(batch, head, c, p_tile, n_tile),
                     tile=h.reshape(tile).astype(states.dtype))
    if WRITE_END:
        if seg == (0 if REVERSE else SEGMENTS - 1):
            end = ct.load(seg_final, index=(batch, head, seg, p_tile, n_tile), shape=tile,
                          padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_P, BLOCK_N))
            f = ct.load(seg_factor, index=(batch, head, seg), shape=(1, 1, 1)).reshape((1, 1))
            end = end + ct.where(f == 0.0, 0.0, carry * f)
            ct.store(final, index=(batch, head, p_tile, n_tile),
                     tile=end.reshape((1, 1, BLOCK_P, BLOCK_N)))


chunk_state_carry = ct.kernel(chunk_state_carry_fn)
chunk_state_carry_i64 = ct.kernel(int64_variant(
    chunk_state_carry_fn,
    ["seg_final", "seg_factor", "chunk_factor", "states", "final", "entry"]))
