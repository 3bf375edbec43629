"""CPU, float64: the backward's tile programs, run one program instance at a time.

The kernels cannot run without a GPU, so this executes *the kernel functions themselves* (their
Python source, unchanged) with `ct` replaced by a small float64 PyTorch emulation of the cuTile
operations they use: `ct.load` partitions the array into tiles of the given shape and indexes
that tile space, out-of-bounds elements are 0 with PaddingMode.ZERO and NaN otherwise (so a
reliance on undefined padding shows up), a tile lying entirely outside the array is an error,
`ct.store` drops the out-of-bounds part. Every program of every grid runs in turn (the same
grids and argument lists `backward.backward_plan` builds for the GPU), scratch buffers start as
NaN (a read of something no program wrote poisons the result), and each array element may be
written by one program of a launch only (two programs writing one slot would be a race on the
GPU).

The gradients must match `chunked_backward.ssd_chunked_backward` (itself checked against
autograd) to float64 rounding, with partial chunks, seq_idx resets on and inside chunk
boundaries, several token blocks per chunk, several p- and n-tiles, and every option.
"""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("cuda.tile")

from mamba2_cutile.reference import ssd_chunked_backward  # noqa: E402
from mamba2_cutile.ssd import backward  # noqa: E402
from support.grads import assert_grads_close  # noqa: E402
from support.emulator import (CT, F64, OPTIONS, _Padding, _tile, emulate_launch,  # noqa: E402
                              make_problem, poison)

NAMES = backward.NAMES


def small_config(Q, p, n, **over):
    """Small tiles, so one chunk holds several token blocks and P, N several tiles; the
    per-block dB/dC programs and the stable da form (bc_fused=0, da_mode=0) unless `over`
    says otherwise (the dispatcher's own choice is tested by test_emulated_dispatcher_config)."""
    cfg = backward.backward_config(2, 4, 2, p, n, Q, F64)
    cfg = replace(cfg, bc_fused=0, da_mode=0,
                  dx_block_q=16, dx_block_p=16, bc_block_q=32, bc_block_p=16,
                  bc_block_n=16, bstate_block_p=16, bstate_block_n=16, state_block_p=16,
                  state_block_n=16, cumsum_block_h=2, dstate_pad=max(16, 1 << (n - 1).bit_length()))
    return replace(cfg, **over)


def emulated_grads(args, kw, Q, dout, dfinal, cfg):
    return backward.run_backward(**args, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                                 config=cfg, launch_fn=emulate_launch, buf_dtype=F64,
                                 on_buffers=poison)


def reference_grads(args, kw, Q, dout, dfinal):
    return ssd_chunked_backward(**args, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                                dtype=F64)


def assert_close(got, ref, tol=1e-10):
    assert_grads_close(got, ref, tol)


#: option sets whose paths the others cover (every input of "all", the dt transforms of "all" and
#: "none"), emulated only in the slow run (MAMBA2_TEST_SLOW=1): 20-27 s each on 2 cores
SLOW_OPTIONS = ("D_head", "bias_softplus_limit", "init_no_dfinal", "limit_nosoftplus")


@pytest.mark.parametrize("opt", [pytest.param(o, marks=pytest.mark.slow) if o in SLOW_OPTIONS
                                 else o for o in OPTIONS])
def test_emulated_kernels_match_chunked_backward(opt):
    Q = 64
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], Q=Q)
    cfg = small_config(Q, 20, 7)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("l", [1, 16, 64, 65, 128, 137])
def test_emulated_lengths(l):
    """One token, a single block, exactly one and two chunks, one token past a chunk."""
    Q = 64
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], l=l, Q=Q, seed=1)
    cfg = small_config(Q, 20, 7)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


TILINGS = {
    "one_block_per_chunk": dict(dx_block_q=64, bc_block_q=64),
    "dx_q32_bc_q16": dict(dx_block_q=32, bc_block_q=16),
    "wide_tiles": dict(dx_block_p=32, bc_block_p=32, bc_block_n=32, bstate_block_p=32,
                       bstate_block_n=32, cumsum_block_h=4),
    "lowp": dict(lowp=1, dx_lowp=1),
    "dbc_fused": dict(bc_fused=1),
    "da_local": dict(da_mode=1),
    "da_local_q32": dict(da_mode=1, dx_block_q=32, bc_fused=1),
    "da_split": dict(da_mode=2, bc_fused=1),
    "da_split_q32_lowp": dict(da_mode=2, bc_fused=1, dx_block_q=32, lowp=1, bc_block_n=32),
    "fused_local": dict(bc_fused=1, da_mode=1),
    "latency_hints": dict(bc_fused=1, da_mode=1, bstate_load_latency=4, dx_load_latency=2,
                          bc_load_latency=8),
    "dbc_fused_wide": dict(bc_fused=1, bc_block_p=64, bc_block_n=32, lowp=1),
    "head_split": dict(bc_fused=1, da_mode=1, bc_head_split=2),
    "group_dcb": dict(bc_fused=2, da_mode=1, bc_block_q=32, lowp=1),
}


#: tilings emulated only in the slow run: latency hints (the emulation ignores hints: the math is
#: fused_local's), and the stable and split da forms, which the dispatcher does not pick
SLOW_TILINGS = ("latency_hints", "dbc_fused", "da_split")


@pytest.mark.parametrize("tiling", [pytest.param(t, marks=pytest.mark.slow)
                                    if t in SLOW_TILINGS else t for t in TILINGS])
def test_emulated_tilings(tiling):
    Q = 64
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], l=150, Q=Q, seed=2, h=6, g=3, p=40,
                                          n=20)
    cfg = small_config(Q, 40, 20, **TILINGS[tiling])
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("g", [1, 4])
def test_emulated_groups_and_chunk_32(g):
    Q = 32
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], l=100, Q=Q, seed=3, g=g, p=16, n=16)
    cfg = small_config(Q, 16, 16, bc_block_q=16)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("opt", ["D_head_z_seq", "init_no_dfinal", "all", "none"])
def test_emulated_dbc_fused_options(opt, mode):
    """The whole-chunk dB/dC program with seq_idx resets, z, no dfinal; 4 heads per group."""
    Q = 32
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], l=90, Q=Q, seed=5, g=1, p=24, n=20)
    cfg = small_config(Q, 24, 20, bc_fused=1, bc_block_n=16, da_mode=mode)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("Q", [64, 128, 256])
def test_emulated_dispatcher_config(Q):
    """The dispatcher's own tiles (64-token blocks, 16- or 32-wide p/n tiles here)."""
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], b=1, l=300, h=2, g=1, p=24, n=12,
                                          Q=Q, seed=4)
    cfg = backward.backward_config(1, 2, 1, 24, 12, Q, torch.bfloat16)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


def test_emulation_harness_checks():
    """The harness itself: undefined padding reads NaN, a tile outside the array and two
    programs writing one element are errors."""
    a = torch.arange(10, dtype=F64)
    t = CT.load(a, index=(2,), shape=(4,))
    assert torch.isnan(t[2:]).all() and t[:2].tolist() == [8.0, 9.0]
    assert CT.load(a, index=(2,), shape=(4,), padding_mode=_Padding.ZERO)[2:].eq(0).all()
    with pytest.raises(AssertionError):
        CT.load(a, index=(3,), shape=(4,))
    CT.owner = {}
    out = torch.zeros(8, dtype=F64)
    CT.program = 1
    CT.store(out, index=(0,), tile=_tile(torch.ones(4, dtype=F64)))
    CT.store(out, index=(0,), tile=_tile(torch.ones(4, dtype=F64)))    # same program: fine
    CT.program = 2
    with pytest.raises(AssertionError):
        CT.store(out, index=(1,), tile=_tile(torch.ones(2, dtype=F64)))


@pytest.mark.parametrize("field", ["state_segments", "bstate_segments"])
@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("opt", ["init_no_dfinal", "all", "none"])
def test_emulated_segmented_state_passes(opt, segments, field):
    """state_segments (the recompute of the entry states: the segmented state pass and
    chunk_state_carry before bwd_state_pass) and bstate_segments (bwd_state_pass's reverse
    loop in segments, chunk_state_carry REVERSE after it, writing dinitial_states): 3 chunks
    of 32 in 2 segments (1 + 2) and 3 (one each), with initial states, with and without
    dfinal, and with "all" seq_idx resets."""
    Q = 32
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], l=90, Q=Q, seed=5, g=1, p=24, n=20)
    cfg = small_config(Q, 24, 20, bc_block_q=16, **{field: segments})
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


def test_emulated_segmented_passes_uneven_runs():
    """bstate_segments=4 and state_segments=4 over 5 chunks: runs of 1 + 1 + 1 + 2, the
    last (two chunks, the partial one) starting from dfinal in the reverse pass."""
    Q = 32
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], l=150, Q=Q, seed=7, g=1, p=24, n=20)
    assert dfinal is not None
    cfg = small_config(Q, 24, 20, bc_block_q=16, bstate_segments=4, state_segments=4)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("da_mode", [1, 3])
@pytest.mark.parametrize("bq,bn,bp", [(16, 16, 16), (32, 32, 8), (8, 16, 32)])
@pytest.mark.parametrize("opt", ["D_head_z_seq", "init_no_dfinal", "all", "none"])
def test_emulated_group_dcb(opt, bq, bn, bp, da_mode):
    """dB and dC through the gradient of each group's C B^T (bc_fused=2): dS summed over the
    group's 3 heads in (bq x bq) blocks, then dB and dC per whole chunk and n-tile; a last chunk
    of 20 tokens (l = 84), so at bq = 8 its last block holds none; seq_idx resets inside
    chunks, z, no dfinal. da_mode 3: the decay gradient's W terms from the dS launch too (2,
    1 and 4 slots of its blocks against 2 p-tiles of bwd_chunk_dx's 16 channels: each slot
    count equal to, below and above the p-tiles')."""
    Q = 32
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], l=84, Q=Q, seed=11, h=6, g=2, p=24,
                                          n=20)
    cfg = small_config(Q, 24, 20, bc_fused=2, da_mode=da_mode, bc_block_q=bq, bc_block_n=bn,
                       bc_block_p=bp)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("over", [dict(bc_fused=2, da_mode=3), dict(bc_fused=2, da_mode=1),
                                  dict(bc_fused=1, da_mode=1),
                                  dict(bc_fused=2, da_mode=3, bstate_segments=2,
                                       state_segments=2)],
                         ids=["dcb-da3", "dcb-da1", "fused", "dcb-segments"])
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("opt", ["all", "init_no_dfinal", "none"])
def test_emulated_side_streams(opt, over, mode):
    """side_streams=1: bwd_state_pass (with bstate_segments its carry too) and the dS launch on
    side streams beside the recompute of the states; 2: only bwd_state_pass (and its carry)
    on a side stream, the recompute then the dS launch on the caller's stream, the dS launch
    thus beside the reverse pass too. The gradients as on one stream, and no
    two launches that may run at the same time touch a byte one of them writes (the
    emulation checks every such pair: with initial states the recompute's final state and
    bwd_state_pass's dh_0 would share hbuf)."""
    Q = 32
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], l=84, Q=Q, seed=12, h=6, g=2, p=24,
                                          n=20)
    cfg = small_config(Q, 24, 20, bc_block_q=16, side_streams=mode, **over)
    calls = []
    backward.run_backward(**args, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                          config=cfg, launch_fn=calls.extend, buf_dtype=F64)
    assert {c.stream for c in calls} == ({0, 1, 2} if over["bc_fused"] == 2 and mode == 1
                                         else {0, 1})
    assert sum(c.join for c in calls) == 1
    names = [c.kernel._annotated_function.pyfunc.__name__ for c in calls]
    on_side = [n for n, c in zip(names, calls) if c.stream == 1]
    assert on_side[0] == "bwd_state_pass_fn"
    if mode == 2:
        # the recompute follows the side launch, before any dB/dC launch
        first_rec = names.index("chunk_state_pass_fn")
        assert names.index("bwd_state_pass_fn") < first_rec < min(
            i for i, n in enumerate(names) if n.startswith("bwd_chunk_db"))
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("scale_dy, fresh", [(-1, 1), (1, 1), (0, 1), (1, 0), (0, 0)])
@pytest.mark.parametrize("opt", ["all", "init_no_dfinal", "seq_idx"])
def test_emulated_reverse_pass_forms(opt, scale_dy, fresh):
    """bwd_state_pass with its decay weights on dY or on C (-1: on the smaller tile, dY at
    these 8 x 32 tiles as at the dispatcher's 64 x 128) and its MMA into a fresh accumulator
    or into the carried gradient: all four forms give the recurrence's gradients."""
    Q = 32
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], l=84, Q=Q, seed=13, h=4, g=2, p=24,
                                          n=20)
    cfg = small_config(Q, 24, 20, bstate_block_p=8, bstate_block_n=32,
                       bstate_scale_dy=scale_dy, bstate_fresh_acc=fresh)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


def test_emulated_side_streams_race_is_caught():
    """The harness's own check: a launch on a side stream and a later one on the caller's
    stream writing one buffer is refused; the other order (the side launch waits for the
    caller's stream) and a join between them are not."""
    from dataclasses import replace as rep
    from support.emulator import emulate_launch
    Q = 32
    args, kw, dout, dfinal = make_problem(OPTIONS["none"], l=40, Q=Q, seed=1, h=2, g=1, p=8,
                                          n=8)
    cfg = small_config(Q, 8, 8, side_streams=1)
    calls = []
    backward.run_backward(**args, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                          config=cfg, launch_fn=calls.extend, buf_dtype=F64)
    first = calls[0]                    # decay_cumsum: writes dt' and G2
    with pytest.raises(AssertionError, match="at the same time"):
        emulate_launch([rep(first, stream=1), rep(first)])
    emulate_launch([rep(first), rep(first, stream=1)])
    emulate_launch([rep(first, stream=1), rep(first, join=True)])


@pytest.mark.parametrize("split,mode", [(2, 1), (4, 1), (3, 2), (64, 2)])
@pytest.mark.parametrize("opt", ["D_head_z_seq", "all", "none"])
def test_emulated_head_split(opt, split, mode):
    """The fused dB/dC launch with each group's 4 heads split over 2 or 4 programs (3 -> 2,
    64 -> 4: the largest divisor of the heads per group), writing fp32 partials that the
    sum_partials launch adds into dB and dC; with the split da form too (da_mode 2), whose W
    terms each program writes for its own heads."""
    Q = 32
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], l=90, Q=Q, seed=9, g=1, p=24, n=20)
    cfg = small_config(Q, 24, 20, bc_block_q=16, bc_fused=1, bc_block_n=16, da_mode=mode,
                       bc_head_split=split)
    assert backward.head_splits(cfg, 4, 1) == {2: 2, 4: 4, 3: 2, 64: 4}[split]
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("split,mode,g,l", [(2, 3, 1, 90), (4, 3, 1, 70), (3, 3, 1, 90),
                                            (2, 1, 2, 90), (2, 3, 2, 70)])
@pytest.mark.parametrize("opt", ["D_head_z_seq", "all", "none"])
def test_emulated_dcb_head_split(opt, split, mode, g, l):
    """bc_fused 2 with each group's heads split over programs (4 heads per group: 2, 4, and
    3 -> 2): bwd_chunk_dcb writes one dS per split and, in da_mode 3, its heads' W terms;
    bwd_chunk_dbc_group one fp32 dB / dC partial per split from its heads' state terms and
    its split's dS; sum_partials adds them. Chunks of 32 in 16-token blocks: at 90 tokens a
    partial last block, at 70 a last chunk whose last row block lies wholly past the sequence
    (each split writes zeros for its own heads' W slots there)."""
    Q = 32
    h = 4 * g
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], l=l, Q=Q, seed=10, h=h, g=g, p=24,
                                          n=20)
    cfg = small_config(Q, 24, 20, bc_block_q=16, bc_fused=2, bc_block_n=16, da_mode=mode,
                       dcb_head_split=split)
    splits = {2: 2, 4: 4, 3: 2}[split]
    assert backward.head_splits(cfg, h, g) == splits
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("bad", ["dout", "C", "z"])
@pytest.mark.parametrize("bc_fused, da_mode, weights", [(1, 1, "C"), (2, 3, "C"),
                                                         (2, 3, "dY")])
def test_emulated_later_sequence_nan_stays_out_of_earlier_chunks(bad, bc_fused, da_mode,
                                                                 weights):
    """Three packed sequences (tokens 0-20, 21-69, 70-95; chunks of 16): a NaN in the last
    sequence's dout, C or z at token 90 (a chunk of that sequence alone) reaches no gradient
    of a token before the chunk where the sequence starts (64-79), nor dinitial_states:
    bwd_state_pass selects the exit-state gradient away at a reset (0 * NaN carried it back
    through every earlier chunk). The earlier rows of that chunk can still see it, and a NaN
    in a chunk holding an earlier sequence's rows reaches that sequence (masked products in
    the chunk kernels: README's Known gaps)."""
    Q, l = 16, 96
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], b=1, l=l, Q=Q, seed=3, h=2, g=1,
                                          p=8, n=8)
    seq = torch.zeros(1, l, dtype=torch.int32)
    seq[:, 21:], seq[:, 70:] = 1, 2
    kw = {**kw, "seq_idx": seq, "dt_limit": (0.0, float("inf"))}
    cfg = replace(small_config(32, 8, 8), chunk_size=Q, dx_block_q=8, bc_block_q=8,
                  bc_fused=bc_fused, da_mode=da_mode,
                  bstate_scale_dy={"C": 0, "dY": 1}[weights])
    clean = emulated_grads(args, kw, Q, dout, dfinal, cfg)
    b_args, b_kw, b_dout = dict(args), dict(kw), dout.clone()
    if bad == "dout":
        b_dout[0, 90, 1, 3] = float("nan")
    elif bad == "C":
        b_args["C"] = args["C"].clone()
        b_args["C"][0, 90, 0, 2] = float("nan")
    else:
        b_kw["z"] = kw["z"].clone()
        b_kw["z"][0, 90, 1, 3] = float("nan")
    got = emulated_grads(b_args, b_kw, Q, b_dout, dfinal, cfg)
    for name in ("x", "B", "C", "dt", "z"):
        assert torch.equal(got[name][0, :64], clean[name][0, :64]), name
    assert torch.equal(got["initial_states"], clean["initial_states"])
    assert not torch.isfinite(got["x"][0, 70:]).all()       # its own sequence does see it


@pytest.mark.parametrize("heads, bq, bp, bcq, bn", [(2, 16, 16, 16, 0), (4, 8, 32, 16, 0),
                                                    (4, 32, 16, 16, 0), (2, 16, 8, 32, 0),
                                                    (4, 16, 16, 16, 16), (2, 16, 16, 16, 8)])
@pytest.mark.parametrize("opt", ["seq_idx", "init_no_dfinal", "all_but_z", "D_head"])
def test_emulated_dx_heads(opt, heads, bq, bp, bcq, bn):
    """dx_heads: bwd_chunk_dx_group (da_mode 3 without z) walks 2 or 4 of each group's 4 heads
    with B_t C^T of the chunk formed once: 1, 4 and 2 token blocks per chunk of 32 (the
    query columns before the block masked), 2 and 1 p-tiles of 24 channels, a last chunk of 20
    tokens, seq_idx resets inside chunks, D per head and per channel, initial states, no
    dfinal; bwd_chunk_dcb's W terms in 2 slots, and in 1 against 3 p-tiles (the slots it did
    not write are selected away, never read into da); dstate 20 as one 32-wide tile, as
    two 16-wide ones and as three 8-wide ones (dx_block_n; the padded dstate's fourth 8-wide
    tile lies wholly past dstate and must not be loaded). With z the per-head kernel runs."""
    Q = 32
    options = dict(OPTIONS["all"], z=False) if opt == "all_but_z" else OPTIONS[opt]
    args, kw, dout, dfinal = make_problem(options, l=84, Q=Q, seed=13, h=8, g=2, p=24, n=20)
    cfg = small_config(Q, 24, 20, bc_fused=2, da_mode=3, bc_block_q=bcq, dx_block_q=bq,
                       dx_block_p=bp, dx_heads=heads, dx_block_n=bn)
    assert backward.dx_group_heads(cfg, 4, False) == heads
    assert backward.dx_group_heads(cfg, 4, True) == 1
    names = []

    def launch(calls):
        names.extend(c.kernel._annotated_function.pyfunc.__name__ for c in calls)
        emulate_launch(calls)

    got = backward.run_backward(**args, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                                config=cfg, launch_fn=launch, buf_dtype=F64, on_buffers=poison)
    assert "bwd_chunk_dx_group_fn" in names and "bwd_chunk_dx_fn" not in names
    assert_close(got, reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("bad", ["dout", "C"])
def test_emulated_dx_heads_later_sequence_nan_stays_out_of_earlier_chunks(bad):
    """The packed-sequence case above without z, with dx_heads=2 (bwd_chunk_dx_group, whose
    masked products span the whole chunk): a NaN at token 90 reaches no gradient of a token
    before the chunk where its sequence starts, nor dinitial_states."""
    Q, l = 16, 96
    options = dict(OPTIONS["all"], z=False)
    args, kw, dout, dfinal = make_problem(options, b=1, l=l, Q=Q, seed=3, h=2, g=1, p=8, n=8)
    seq = torch.zeros(1, l, dtype=torch.int32)
    seq[:, 21:], seq[:, 70:] = 1, 2
    kw = {**kw, "seq_idx": seq, "dt_limit": (0.0, float("inf"))}
    cfg = replace(small_config(32, 8, 8), chunk_size=Q, dx_block_q=8, bc_block_q=8,
                  bc_fused=2, da_mode=3, dx_heads=2)
    assert backward.dx_group_heads(cfg, 2, False) == 2
    clean = emulated_grads(args, kw, Q, dout, dfinal, cfg)
    b_args, b_dout = dict(args), dout.clone()
    if bad == "dout":
        b_dout[0, 90, 1, 3] = float("nan")
    else:
        b_args["C"] = args["C"].clone()
        b_args["C"][0, 90, 0, 2] = float("nan")
    got = emulated_grads(b_args, kw, Q, b_dout, dfinal, cfg)
    for name in ("x", "B", "C", "dt"):
        assert torch.equal(got[name][0, :64], clean[name][0, :64]), name
    assert torch.equal(got["initial_states"], clean["initial_states"])
    assert not torch.isfinite(got["x"][0, 70:]).all()


@pytest.mark.parametrize("l", [5, 40])
def test_emulated_dx_heads_odd_heads_per_group(l):
    """6 heads in one group (dx_heads=8 walks 2 a program), sequences shorter than a chunk
    and one partial chunk, seq_idx and D per channel."""
    Q = 32
    args, kw, dout, dfinal = make_problem(dict(OPTIONS["all"], z=False), l=l, Q=Q, seed=5,
                                          h=6, g=1, p=24, n=20)
    cfg = small_config(Q, 24, 20, bc_fused=2, da_mode=3, bc_block_q=16, dx_block_q=16,
                       dx_heads=8)
    assert backward.dx_group_heads(cfg, 6, False) == 2
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("opt", ["seq_idx", "init_no_dfinal", "all_but_z"])
def test_emulated_dx_whole_headdim(opt):
    """The dispatcher's long-sequence dx tiles at headdim 64: one bwd_chunk_dx program per token
    block over all 64 channels (one p-tile, no padding) beside da_mode 3's dS launch, a last
    chunk of 20 tokens, 2 token blocks per chunk."""
    Q = 32
    options = dict(OPTIONS["all"], z=False) if opt == "all_but_z" else OPTIONS[opt]
    args, kw, dout, dfinal = make_problem(options, l=84, Q=Q, seed=17, h=4, g=2, p=64, n=20)
    cfg = small_config(Q, 64, 20, bc_fused=2, da_mode=3, bc_block_q=16, dx_block_q=16,
                       dx_block_p=64, bc_block_p=32)
    calls = []
    backward.run_backward(**args, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                          config=cfg, launch_fn=calls.extend, buf_dtype=F64)
    dx = next(c for c in calls
              if c.kernel._annotated_function.pyfunc.__name__ == "bwd_chunk_dx_fn")
    assert dx.grid[1] == 1
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))
