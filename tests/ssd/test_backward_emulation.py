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


#: dx_cb=1 (S = C B^T from chunk_cb's buffer in bwd_chunk_dx): option set, chunk, config
#: overrides. Lengths 150 (Q=64) and 300 (Q=128, 256) end inside a token block, so chunk_cb
#: skips row blocks past L and bwd_chunk_dx sees a partial last block; every da form, token
#: blocks of 16 (several per chunk), 32 and a whole chunk; da_mode 2 without z skips the
#: key-block loop (only the transposed query-block reads remain)
DX_CB = {
    "none-Q64": ("none", 64, {}),
    "D_head-Q64-q32": ("D_head", 64, dict(dx_block_q=32)),
    "D_chan_z-Q128-local": ("D_chan_z", 128, dict(dx_block_q=32, da_mode=1, bc_fused=1)),
    "D_head_z_seq-Q64-split": ("D_head_z_seq", 64, dict(da_mode=2, bc_fused=1)),
    "seq_idx-Q128-split-no-z": ("seq_idx", 128, dict(dx_block_q=32, da_mode=2, bc_fused=1)),
    "all-Q64-one-block": ("all", 64, dict(dx_block_q=64)),
    "all-Q256-local-lowp": ("all", 256, dict(dx_block_q=64, da_mode=1, bc_fused=1, lowp=1,
                                             dx_lowp=1, dx_load_latency=2)),
}


@pytest.mark.parametrize("case", list(DX_CB))
def test_emulated_dx_cb(case):
    opt, Q, over = DX_CB[case]
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], l=150 if Q == 64 else 300, Q=Q,
                                          seed=6)
    cfg = small_config(Q, 20, 7, dx_cb=1, **over)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("Q", [64, 256])
def test_emulated_dispatcher_config_dx_cb(Q):
    """The dispatcher's tiles with dx_cb=1 (a chunk-256 call computes at chunk 128)."""
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], b=1, l=300, h=2, g=1, p=24, n=12,
                                          Q=Q, seed=4)
    cfg = replace(backward.backward_config(1, 2, 1, 24, 12, Q, torch.bfloat16), dx_cb=1)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


def test_emulated_chunk_cb_blocks():
    """chunk_cb alone: every block on or below the diagonal is C_i B_j^T of its chunk and group
    (zero rows past L), the rest of the (poisoned) buffer is never written."""
    Q, bq, l, g = 64, 16, 150, 2
    args, kw, dout, dfinal = make_problem(OPTIONS["none"], l=l, g=g, Q=Q, seed=7)
    cfg = small_config(Q, 20, 7, dx_cb=1, dx_block_q=bq)
    calls = []
    bufs = {}
    backward.run_backward(**args, chunk_size=Q, dout=dout, **kw, config=cfg,
                          launch_fn=calls.extend, buf_dtype=F64,
                          on_buffers=lambda b: (poison(b), bufs.update(cb=b.cb)))
    names = [c.kernel._annotated_function.pyfunc.__name__ for c in calls]
    emulate_launch([calls[names.index("chunk_cb_fn")]])
    cb = bufs["cb"]
    b, nc = args["B"].shape[0], -(-l // Q)
    assert cb.shape == (b, nc, g, Q, Q)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 0, 0, nc * Q - l))  # noqa: E731
    Bc, Cc = (pad(args[k]).view(b, nc, Q, g, -1).transpose(2, 3) for k in ("B", "C"))
    want = Cc @ Bc.transpose(-1, -2)                           # (b, nc, g, Q, Q)
    blk = torch.arange(Q) // bq
    lower = blk[:, None] >= blk[None, :]
    row_in = (torch.arange(nc)[:, None] * Q + blk[None, :] * bq) < l    # (nc, Q): row block in L
    written = lower[None] & row_in[:, :, None]                 # (nc, Q, Q)
    written = written[None, :, None].expand_as(cb)
    assert written.any() and (~written).any()
    torch.testing.assert_close(cb[written], want[written], rtol=1e-13, atol=1e-13)
    assert torch.isnan(cb[~written]).all()


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


#: bc_head_split (the fused dB/dC launch's heads over several programs per group, fp32
#: partials summed by the launcher): option set, chunk, (heads, groups), config overrides,
#: the splits the launch must run (head_splits: gcd(S, heads per group)). Lengths 150 (Q=64)
#: and 300 (Q=128, 256) end inside a chunk; p=40, n=20 span several p- and n-tiles. 6 heads per
#: group at S=4 runs 2 splits of 3 heads (S need not divide), 3 at S=2 runs unsplit.
HEAD_SPLIT = {
    "D_head_z_seq-Q64-S2-local": ("D_head_z_seq", 64, (8, 2), dict(bc_head_split=2,
                                                                    da_mode=1), 2),
    "D_chan_z-Q128-S4-split-da": ("D_chan_z", 128, (8, 1), dict(bc_head_split=4, da_mode=2),
                                  4),
    "all-Q256-S4-split-da-lowp": ("all", 256, (4, 1), dict(bc_head_split=4, da_mode=2, lowp=1,
                                                           bc_block_n=32), 4),
    "all-Q64-S4-6-heads": ("all", 64, (6, 1), dict(bc_head_split=4, da_mode=1), 2),
    "seq_idx-Q128-S2-split-da-no-z": ("seq_idx", 128, (8, 2), dict(bc_head_split=2,
                                                                    da_mode=2), 2),
    "D_head-Q64-S8-stable-da": ("D_head", 64, (8, 1), dict(bc_head_split=8, da_mode=0), 8),
    "all-Q128-S2-3-heads-unsplit": ("all", 128, (6, 2), dict(bc_head_split=2, da_mode=2), 1),
}


def _launch_recording(calls_seen):
    def launch(calls):
        calls_seen.extend(calls)
        emulate_launch(calls)
    return launch


@pytest.mark.slow     # bc_head_split: measured slower, off by default
@pytest.mark.parametrize("case", list(HEAD_SPLIT))
def test_emulated_head_split(case):
    """With a head split the dB/dC launch has that many programs on grid axis 2, each writing
    its heads' partial sums (and, with da_mode 2, its own heads' da_part W slots: the harness
    fails on any element two programs write); the summed gradients match the float64 stage
    formulas."""
    opt, Q, (h, g), over, splits = HEAD_SPLIT[case]
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], l=150 if Q == 64 else 300, Q=Q, h=h,
                                          g=g, p=40, n=20, seed=8)
    cfg = small_config(Q, 40, 20, bc_fused=1, **over)
    assert backward.head_splits(cfg, h, g) == splits
    calls, bufs = [], {}
    got = backward.run_backward(**args, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                                config=cfg, launch_fn=_launch_recording(calls), buf_dtype=F64,
                                on_buffers=lambda b: (poison(b), bufs.update(b=b)))
    dbc = [c for c in calls
           if c.kernel._annotated_function.pyfunc.__name__ == "bwd_chunk_dbc_fused_fn"]
    assert len(dbc) == 1 and dbc[0].grid[2] == splits
    assert (bufs["b"].db_part is None) == (splits == 1)
    assert_close(got, reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.slow     # bc_head_split: measured slower, off by default
@pytest.mark.parametrize("Q", [64, 256])
def test_emulated_dispatcher_config_head_split(Q):
    """The dispatcher's tiles with bc_head_split=2 and 4 (4 heads, one group)."""
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], b=1, l=300, h=4, g=1, p=24, n=12,
                                          Q=Q, seed=4)
    ref = reference_grads(args, kw, Q, dout, dfinal)
    for split in (2, 4):
        cfg = replace(backward.backward_config(1, 4, 1, 24, 12, Q, torch.bfloat16),
                      bc_head_split=split)
        assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg), ref)


#: dx_head_block (bwd_chunk_dx_heads: several heads of one group per dx program, S = C B^T and
#: the chunk's B/C formed once for them): option set, chunk, length, (heads, groups), config
#: overrides, the heads per program the plan must pick (dx_head_blocks: gcd(HB, heads per
#: group)). Lengths end inside a token block (a partial last chunk); p=40 spans a full and a
#: partial p-tile; 16-token blocks give several per chunk, 64 one. 6 heads per group at HB=4
#: run 2 per program (HB need not divide them).
DX_HEADS = {
    "all-Q64-HB2-local": ("all", 64, (2, 100), (4, 2), dict(dx_head_block=2, da_mode=1), 2),
    "all-Q64-HB4-stable": ("all", 64, (1, 150), (4, 1), dict(dx_head_block=4, da_mode=0), 4),
    "D_head_z_seq-Q128-HB8-q32": ("D_head_z_seq", 128, (1, 200), (8, 1),
                                  dict(dx_head_block=8, da_mode=1, dx_block_q=32), 8),
    "all-Q64-HB4-6-heads-lowp": ("all", 64, (1, 100), (6, 1), dict(dx_head_block=4, da_mode=1,
                                                                   lowp=1, dx_lowp=1), 2),
    "seq_idx-Q64-HB2-one-block": ("seq_idx", 64, (2, 100), (4, 2), dict(dx_head_block=2,
                                                                        dx_block_q=64), 2),
    "init_no_dfinal-Q32-HB16-stable": ("init_no_dfinal", 32, (1, 70), (4, 1),
                                       dict(dx_head_block=16, da_mode=0), 4),
    "D_head-Q64-HB4-no-z-q32": ("D_head", 64, (1, 100), (4, 1), dict(dx_head_block=4,
                                                                     dx_block_q=32), 4),
    "bias_softplus_limit-Q64-HB2": ("bias_softplus_limit", 64, (1, 100), (4, 2),
                                    dict(dx_head_block=2), 2),
    "all-Q64-HB8-8-groups-one-head": ("all", 64, (1, 100), (8, 8), dict(dx_head_block=8), 1),
    "all-Q64-HB4-split-da-fallback": ("all", 64, (1, 100), (4, 1), dict(dx_head_block=4,
                                                                        da_mode=2), 1),
    "D_head-Q64-HB4-dx-cb-fallback": ("D_head", 64, (1, 100), (4, 1), dict(dx_head_block=4,
                                                                           dx_cb=1), 1),
}
#: state-pass tiles wide enough for few programs (the emulation's time is per program)
FAST_STATE = dict(state_block_p=64, state_block_n=32, bstate_block_p=64, bstate_block_n=32,
                  bc_fused=1, bc_block_n=32)


def _dx_launch(calls):
    (call,) = [c for c in calls if c.kernel._annotated_function.pyfunc.__name__.startswith(
        "bwd_chunk_dx")]
    return call


@pytest.mark.parametrize("case", list(DX_HEADS))
def test_emulated_dx_head_block(case):
    """The dx launch is bwd_chunk_dx_heads with HB heads per program (grid axis 0 shrunk by HB)
    or, where the plan must fall back, bwd_chunk_dx; every program writes only its own heads'
    slots (the harness fails on an element two programs write), and the gradients match the
    float64 stage formulas."""
    opt, Q, (b, l), (h, g), over, hb = DX_HEADS[case]
    args, kw, dout, dfinal = make_problem(OPTIONS[opt], b=b, l=l, Q=Q, h=h, g=g, p=40, n=20,
                                          seed=9)
    cfg = small_config(Q, 40, 20, **{**FAST_STATE, **over})
    assert backward.dx_head_blocks(cfg, h, g) == hb
    calls = []
    got = backward.run_backward(**args, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                                config=cfg, launch_fn=_launch_recording(calls), buf_dtype=F64,
                                on_buffers=poison)
    call = _dx_launch(calls)
    name = call.kernel._annotated_function.pyfunc.__name__
    n_q = -(-l // cfg.dx_block_q)
    assert name == ("bwd_chunk_dx_heads_fn" if hb > 1 else "bwd_chunk_dx_fn")
    assert tuple(call.grid) == (n_q * b * h // hb, -(-40 // cfg.dx_block_p), 1)
    assert_close(got, reference_grads(args, kw, Q, dout, dfinal))


@pytest.mark.parametrize("l", [1, 65])
def test_emulated_dx_head_block_lengths(l):
    """One token (one partial block, the chunk's rows mostly past L) and one past a chunk."""
    Q = 64
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], b=1, l=l, Q=Q, h=4, g=1, p=20, n=20,
                                          seed=10)
    cfg = small_config(Q, 20, 20, **FAST_STATE, dx_head_block=4, da_mode=1)
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal))


def test_emulated_dispatcher_config_dx_head_block(monkeypatch):
    """MAMBA2_CUTILE_BWD_CONFIG="dx_head_block=4" on the dispatcher's own tiles (a chunk-256
    call computed at chunk 128, 64-token blocks, lowp on, dx_lowp off, da_mode 1) selects the
    multi-head launch."""
    monkeypatch.setenv("MAMBA2_CUTILE_BWD_CONFIG", "dx_head_block=4")
    Q = 256
    args, kw, dout, dfinal = make_problem(OPTIONS["all"], b=1, l=300, h=4, g=1, p=24, n=12,
                                          Q=Q, seed=4)
    cfg = backward.backward_config(1, 4, 1, 24, 12, Q, torch.bfloat16)
    assert cfg.dx_head_block == 4 and backward.dx_head_blocks(cfg, 4, 1) == 4
    calls = []
    got = backward.run_backward(**args, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                                config=cfg, launch_fn=_launch_recording(calls), buf_dtype=F64,
                                on_buffers=poison)
    assert _dx_launch(calls).kernel._annotated_function.pyfunc.__name__ == \
        "bwd_chunk_dx_heads_fn"
    assert_close(got, reference_grads(args, kw, Q, dout, dfinal))
