"""CPU, float64: the forward's three tile programs, run one program instance at a time.

The same emulated cuTile as tests/test_backward_emulation.py (the kernel functions' own source,
`ct` replaced by float64 PyTorch; buffers poisoned with NaN; one writer per element): the
forward plan's launches must reproduce the float64 recurrence to rounding, with seq_idx resets
inside chunks and on chunk boundaries, partial last chunks, several query blocks per chunk and
every option. This is what checks chunk_scan's same-sequence mask (a per-query run start that
decay_cumsum writes) without a GPU.
"""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("cuda.tile")

from mamba2_cutile.reference import ssd_recurrence  # noqa: E402
from mamba2_cutile.runtime import dt_clamp_bounds  # noqa: E402
from mamba2_cutile.ssd import forward  # noqa: E402
from support import variants  # noqa: E402
from support.emulator import F64, OPTIONS, emulate_launch, make_problem  # noqa: E402


def emulated_forward(args, kw, Q, cfg):
    x, dt, A, B, C = (args[k] for k in ("x", "dt", "A", "B", "C"))
    b, l, h, p = x.shape
    n = B.shape[3]
    nc = -(-l // Q)
    nan = lambda *s: torch.full(s, float("nan"), dtype=F64)  # noqa: E731
    dt_buf, cum_buf, states = nan(b, h, nc * Q), nan(b, h, nc * Q), nan(b, h, nc, p, n)
    final, out = nan(b, h, p, n), nan(b, l, h, p)
    lo, hi = dt_clamp_bounds(kw["dt_limit"])
    seq = kw["seq_idx"]
    calls = forward.forward_plan(x, dt, A, B, C, kw["z"], kw["D"], kw["dt_bias"], lo, hi,
                                 kw["dt_softplus"], kw["initial_states"],
                                 None if seq is None else seq.to(torch.int32),
                                 dt_buf, cum_buf, states, final, out, cfg)
    if seq is not None:                  # the run starts are written by kernel 1: poison them
        calls[0].args[8].fill_(-(2**30))
    for call in calls:                   # scan_cb's C B^T scratch: a block read unwritten is NaN
        if call.kernel._annotated_function.pyfunc.__name__ == "chunk_cb_fn":
            call.args[2].fill_(float("nan"))
    emulate_launch(calls)
    return out, final


def small_forward_config(Q, n, **over):
    cfg = forward.forward_shape_config(2, 4, 20, n, Q, F64)
    cfg = replace(cfg, cumsum_block_h=2, state_block_p=16, state_block_n=16, scan_block_p=16,
                  dstate_pad=max(16, 1 << (n - 1).bit_length()))
    return replace(cfg, **over)


def check(args, kw, Q, cfg, tol=1e-10):
    out, final = emulated_forward(args, kw, Q, cfg)
    ref_out, ref_final, _ = ssd_recurrence(**args, **kw)
    for name, got, ref in (("out", out, ref_out), ("final", final, ref_final)):
        assert torch.isfinite(got).all(), f"{name} has non-finite entries"
        err = (got - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert err <= tol * scale, f"{name}: error {err:.3e}, scale {scale:.3e}"


def _forward_cases():
    """Every option set at chunks 64 and 128; at chunk 256 (27-32 s each on 2 cores) "all" by
    default and the other three in the slow run (MAMBA2_TEST_SLOW=1)."""
    for Q, block_q in [(64, 16), (64, 64), (128, 32), (128, 128), (256, 64)]:
        for opt in ["seq_idx", "D_head_z_seq", "all", "none"]:
            marks = pytest.mark.slow if Q == 256 and opt != "all" else ()
            yield pytest.param(opt, Q, block_q, marks=marks, id=f"{Q}-{block_q}-{opt}")


@pytest.mark.parametrize("opt, Q, block_q", list(_forward_cases()))
def test_emulated_forward_matches_recurrence(opt, Q, block_q):
    """Several query blocks per chunk (block_q < Q: the key-block loop) and one (the diagonal
    block only); seq_idx resets at token 1, inside chunks, on and one after chunk boundaries,
    at the last token; a partial last chunk (l = 150 or 300)."""
    l = {64: 150, 128: 300, 256: 600}[Q]
    args, kw, _, _ = make_problem(OPTIONS[opt], l=l, Q=Q)
    check(args, kw, Q, small_forward_config(Q, 7, scan_block_q=block_q))


@pytest.mark.parametrize("l", [1, 2, 63, 64, 65])
def test_emulated_forward_short_with_seq_idx(l):
    """Sequences shorter than a chunk, a reset at the very last token of a chunk."""
    args, kw, _, _ = make_problem(OPTIONS["seq_idx"], l=l, Q=64)
    check(args, kw, 64, small_forward_config(64, 7, scan_block_q=32))


@pytest.mark.parametrize("segments", [2, 3, 4, 8])
@pytest.mark.parametrize("opt", ["none", "seq_idx", "all"])
def test_emulated_segmented_state_pass(opt, segments):
    """state_segments: the state pass's chunk loop in parallel runs from zero states, then
    chunk_state_carry adding each run's entering state. 5 chunks (a partial last one) in 2
    runs of 2 + 3 chunks, 3 of 1 + 2 + 2, 4 of 1 + 1 + 1 + 2, 8 (one chunk a run: never more
    runs than chunks); seq_idx resets inside runs and on their boundaries, and
    initial_states (only the first run starts from it) with "all"."""
    Q = 64
    args, kw, _, _ = make_problem(OPTIONS[opt], l=300, Q=Q)
    cfg = small_forward_config(Q, 7, scan_block_q=32, state_segments=segments)
    calls = forward.forward_plan(*_plan_args(args, kw, Q), cfg)
    names = [c.kernel._annotated_function.pyfunc.__name__ for c in calls]
    assert names[1:3] == ["chunk_state_pass_fn", "chunk_state_carry_fn"]
    assert calls[1].args[17] == min(segments, 5)
    check(args, kw, Q, cfg)


@pytest.mark.parametrize("opt, Q, block_q", [("all", 64, 16), ("seq_idx", 128, 32),
                                             ("D_head_z_seq", 64, 64), ("none", 128, 128)])
def test_emulated_scan_cb(opt, Q, block_q):
    """scan_cb: C B^T formed once per chunk and group (chunk_cb, its unwritten blocks NaN) and
    read by chunk_scan, with several query blocks per chunk and one, a partial last chunk,
    seq_idx resets and two heads per group."""
    l = {64: 150, 128: 300}[Q]
    args, kw, _, _ = make_problem(OPTIONS[opt], l=l, Q=Q)
    cfg = small_forward_config(Q, 7, scan_block_q=block_q, scan_cb=1)
    calls = forward.forward_plan(*_plan_args(args, kw, Q), cfg)
    names = [c.kernel._annotated_function.pyfunc.__name__ for c in calls]
    # the flagged-tile pass of scan_causal 4 (the default) last
    assert names == ["decay_cumsum_fn", "chunk_state_pass_fn", "chunk_cb_fn", "chunk_scan_fn",
                     "chunk_scan_fn"]
    nc = -(-l // Q)
    assert calls[2].args[2].shape == (2, nc, 2, Q, Q)
    assert tuple(calls[2].grid) == (nc * 2 * 2, Q // block_q, Q // block_q)
    check(args, kw, Q, cfg)


@pytest.mark.parametrize("heads", [1, 2], ids=["chunk_scan", "group"])
@pytest.mark.parametrize("segments", [2, 3, 5])
@pytest.mark.parametrize("opt, block_q", [("none", 64), ("seq_idx", 32), ("all", 16)])
def test_emulated_segment_fold(opt, block_q, segments, heads):
    """segment_fold: chunk_state_carry writes only the states entering the segments (zeros for
    the first) and the output launch (chunk_scan, or chunk_scan_group over both heads of a
    group) adds f_c H_s to the local state it loads. 5 chunks in 2, 3 or 5 runs; seq_idx
    resets inside runs and on their boundaries; initial_states with "all"; one and several
    query blocks per chunk. The chunk states stay local (not the entry states)."""
    Q = 64
    args, kw, _, _ = make_problem(OPTIONS[opt], l=300, Q=Q)
    cfg = small_forward_config(Q, 7, scan_block_q=block_q, state_segments=segments,
                               segment_fold=1, scan_heads=heads)
    plan_args = _plan_args(args, kw, Q)
    calls = forward.forward_plan(*plan_args, cfg)
    names = [c.kernel._annotated_function.pyfunc.__name__ for c in calls]
    out = "chunk_scan_group_fn" if heads > 1 else "chunk_scan_fn"
    assert names == ["decay_cumsum_fn", "chunk_state_pass_fn", "chunk_state_carry_fn",
                     out, "chunk_scan_fn"]
    assert variants.kernel_arg(calls[4], "seg_entry") is calls[2].args[5]
    assert variants.kernel_arg(calls[4], "SEGS") == segments
    if heads > 1:
        # the group launch's products and their order are chunk_scan's
        got = emulated_forward(args, kw, Q, cfg)
        want = emulated_forward(args, kw, Q, replace(cfg, scan_heads=1))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    entry = calls[2].args[5]
    assert entry.shape == (2, 4, segments, 20, 7)
    assert variants.kernel_arg(calls[3], "seg_entry") is entry
    assert variants.kernel_arg(calls[3], "SEGS") == segments
    check(args, kw, Q, cfg)


@pytest.mark.parametrize("heads", [1, 2], ids=["chunk_scan", "group"])
@pytest.mark.parametrize("segments", [2, 3, 8])
@pytest.mark.parametrize("opt, block_q", [("none", 64), ("seq_idx", 32), ("all", 16)])
def test_emulated_state_resweep(opt, block_q, segments, heads):
    """state_resweep: the segmented pass for the runs' ends only, chunk_state_carry forming
    the states entering the runs, the pass again from them writing the true chunk states
    (every state starts as NaN in the emulation: one left unwritten would reach the output),
    then the plain output launch. 5 chunks in 2, 3 or 5 runs; seq_idx resets inside runs and
    on their boundaries; initial_states with "all"."""
    Q = 64
    args, kw, _, _ = make_problem(OPTIONS[opt], l=300, Q=Q)
    cfg = small_forward_config(Q, 7, scan_block_q=block_q, state_segments=segments,
                               state_resweep=1, scan_heads=heads)
    calls = forward.forward_plan(*_plan_args(args, kw, Q), cfg)
    names = [c.kernel._annotated_function.pyfunc.__name__ for c in calls]
    out = "chunk_scan_group_fn" if heads > 1 else "chunk_scan_fn"
    assert names == ["decay_cumsum_fn", "chunk_state_pass_fn", "chunk_state_carry_fn",
                     "chunk_state_pass_fn", out, "chunk_scan_fn"]
    entry = calls[2].args[5]
    assert variants.kernel_arg(calls[2], "ENTRY_ONLY") is True
    assert [variants.kernel_arg(calls[i], "SEG_MODE") for i in (1, 3)] == [1, 2]
    assert variants.kernel_arg(calls[3], "seg_entry") is entry
    assert (variants.kernel_arg(calls[1], "FLAG"), variants.kernel_arg(calls[3], "FLAG")) == (
        False, True)                     # the flags of scan_causal 4 from the second pass
    assert variants.kernel_arg(calls[4], "SEGS") == 1       # nothing left to add
    check(args, kw, Q, cfg)


def test_state_resweep_refuses_segment_fold():
    with pytest.raises(ValueError, match="state_resweep=1 and segment_fold=1"):
        small_forward_config(64, 7, state_segments=3, state_resweep=1, segment_fold=1)


def test_segment_fold_off_where_states_are_read():
    """Varlen states read the chunk states: forward_launches turns segment_fold off there."""
    args, kw, _, _ = make_problem(OPTIONS["none"], l=300, Q=64)
    cfg = small_forward_config(64, 7, scan_block_q=32, state_segments=3, segment_fold=1)
    x, dt, A, B, C = (args[k] for k in ("x", "dt", "A", "B", "C"))
    for need in (False, True):
        calls = forward.forward_launches(x, dt, A, B, C, 64, config=cfg, need_states=need)[0]
        assert variants.kernel_arg(calls[3], "SEGS") == (1 if need else 3)
        assert variants.kernel_arg(calls[2], "ENTRY_ONLY") is (not need)


def _plan_args(args, kw, Q):
    x, dt, A, B, C = (args[k] for k in ("x", "dt", "A", "B", "C"))
    b, l, h, p = x.shape
    nc = -(-l // Q)
    e = lambda *s: torch.empty(s, dtype=F64)  # noqa: E731
    lo, hi = dt_clamp_bounds(kw["dt_limit"])
    seq = kw["seq_idx"]
    return (x, dt, A, B, C, kw["z"], kw["D"], kw["dt_bias"], lo, hi, kw["dt_softplus"],
            kw["initial_states"], None if seq is None else seq.to(torch.int32),
            e(b, h, nc * Q), e(b, h, nc * Q), e(b, h, nc, p, B.shape[3]), e(b, h, p, B.shape[3]),
            e(b, l, h, p))


@pytest.mark.parametrize("heads, n, block_n", [(2, 7, 0), (4, 20, 16)])
@pytest.mark.parametrize("opt, Q, block_q, l", [("all", 64, 64, 150), ("none", 64, 16, 130),
                                                ("D_head_z_seq", 128, 128, 300),
                                                ("all", 128, 32, 300), ("seq_idx", 64, 64, 64)])
def test_emulated_scan_heads(opt, Q, block_q, l, heads, n, block_n):
    """scan_heads: the output launch is chunk_scan_group, a program per query block, group
    and p-tile walking `heads` heads of its group (8 heads in 2 groups: 4 per group, walked 2
    or 4 at a time) with the block's C B^T against its chunk formed once; a chunk of one
    query block and of several; one dstate tile (C kept as the MMA operand) and two (dstate
    20 in 16-wide tiles); a partial last chunk, seq_idx resets, every option; the default
    fix-up launch (chunk_scan) after it."""
    args, kw, _, _ = make_problem(OPTIONS[opt], l=l, Q=Q, h=8, g=2, n=n)
    cfg = small_forward_config(Q, n, scan_block_q=block_q, scan_heads=heads,
                               scan_block_n=block_n)
    calls = forward.forward_plan(*_plan_args(args, kw, Q), cfg)
    names = [c.kernel._annotated_function.pyfunc.__name__ for c in calls]
    assert names == ["decay_cumsum_fn", "chunk_state_pass_fn", "chunk_scan_group_fn",
                     "chunk_scan_fn"]
    assert tuple(calls[2].grid) == (-(-l // block_q) * 2 * 2 * (4 // heads), 2, 1)
    check(args, kw, Q, cfg)


def test_scan_heads_falls_back_to_chunk_scan():
    """scan_heads applies where the plain tile runs: a persistent grid, scan_cb, the flagging
    forms (scan_causal 1-3) keep chunk_scan; a heads per group count with no such divisor
    walks fewer."""
    Q = 64
    args, kw, _, _ = make_problem(OPTIONS["none"], l=150, Q=Q, h=6, g=1)
    for over, kernel, heads in [(dict(scan_persistent=1), "chunk_scan_fn", None),
                                (dict(scan_cb=1), "chunk_scan_fn", None),
                                (dict(scan_causal=2), "chunk_scan_fn", None),
                                (dict(), "chunk_scan_group_fn", 2)]:
        cfg = small_forward_config(Q, 7, scan_heads=8, **{"scan_block_q": Q, **over})
        calls = forward.forward_plan(*_plan_args(args, kw, Q), cfg)
        scan = [c for c in calls if "scan" in c.kernel._annotated_function.pyfunc.__name__][0]
        assert scan.kernel._annotated_function.pyfunc.__name__ == kernel
        if heads:
            assert variants.kernel_arg(scan, "HEADS") == heads


@pytest.mark.parametrize("causal", [0, 5])
@pytest.mark.parametrize("opt, block_q", [("all", 16), ("D_head_z_seq", 64)])
def test_emulated_scan_heads_other_causal_modes(opt, block_q, causal):
    """scan_heads with the plain forward (scan_causal 0: no fix-up launch) and with the
    per-tile fix-up (5); the output equals chunk_scan's (scan_heads=1) exactly."""
    Q = 64
    args, kw, _, _ = make_problem(OPTIONS[opt], l=150, Q=Q, h=8, g=2)
    cfg = small_forward_config(Q, 7, scan_block_q=block_q, scan_heads=4, scan_causal=causal)
    calls = forward.forward_plan(*_plan_args(args, kw, Q), cfg)
    names = [c.kernel._annotated_function.pyfunc.__name__ for c in calls]
    assert names == ["decay_cumsum_fn", "chunk_state_pass_fn", "chunk_scan_group_fn"] + (
        ["chunk_scan_fn"] if causal else [])
    check(args, kw, Q, cfg)
    out, _ = emulated_forward(args, kw, Q, cfg)
    one, _ = emulated_forward(args, kw, Q, replace(cfg, scan_heads=1))
    assert torch.equal(out, one)


@pytest.mark.parametrize("l", [1, 37, 130])
def test_emulated_scan_heads_odd_heads_per_group(l):
    """6 heads in one group (scan_heads=8 walks 2 a program, 3 programs per query block), a
    sequence shorter than a chunk, seq_idx: equal to chunk_scan's output."""
    Q = 64
    args, kw, _, _ = make_problem(OPTIONS["D_head_z_seq"], l=l, Q=Q, h=6, g=1)
    cfg = small_forward_config(Q, 7, scan_block_q=32, scan_heads=8)
    calls = forward.forward_plan(*_plan_args(args, kw, Q), cfg)
    assert variants.kernel_arg(calls[2], "HEADS") == 2
    assert calls[2].grid[0] == -(-l // 32) * 2 * 3
    check(args, kw, Q, cfg)
    out, _ = emulated_forward(args, kw, Q, cfg)
    one, _ = emulated_forward(args, kw, Q, replace(cfg, scan_heads=1))
    assert torch.equal(out, one)


def test_computed_chunk_shorter_than_the_callers():
    """A chunk-256 call computed at chunk 128 (`ForwardConfig.chunk_size`, the rule's
    `computed_chunk`): forward_launches sizes its buffers at the computed chunk, gives the bits
    of a chunk-128 call, and the recurrence's output and final state (to its float32 decay
    buffers' rounding: 4e-5 measured; the chunked algorithm is exact for any chunk)."""
    args, kw, _, _ = make_problem(OPTIONS["all"], l=300, Q=256)
    cfg = small_forward_config(128, 7, scan_block_q=32)
    x, dt, A, B, C = (args[k] for k in ("x", "dt", "A", "B", "C"))
    results = []
    for caller_chunk in (256, 128):
        calls, out, final, (dt_buf, cum_buf, states), _ = forward.forward_launches(
            x, dt, A, B, C, caller_chunk, config=cfg, **kw)
        assert cum_buf.shape[2] == 384 and states.shape[2] == 3
        for t in (out, final, dt_buf, cum_buf, states):
            t.fill_(float("nan"))
        calls[0].args[8].fill_(-(2**30))     # seq_idx's run starts, written by kernel 1
        emulate_launch(calls)
        results.append((out, final))
    ref_out, ref_final, _ = ssd_recurrence(**args, **kw)
    for name, got, same, ref in (("out", *results[0][:1], results[1][0], ref_out),
                                 ("final", results[0][1], results[1][1], ref_final)):
        assert torch.equal(got, same), name
        err = (got - ref).abs().max().item()
        assert err <= 1.5e-4 * ref.abs().max().item(), f"{name}: error {err:.3e}"


def test_varlen_states_at_the_computed_chunk():
    """varlen states of a chunk-256 call computed at chunk 128: read from the 128-token chunk
    states (four packed sequences, one of a single token, one ending inside a chunk)."""
    args, kw, _, _ = make_problem(OPTIONS["D_head"], b=1, l=300, Q=256)
    lens = torch.tensor([100, 1, 150, 49])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    kw["seq_idx"] = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), lens)[None]
    kw["initial_states"] = torch.randn(1, 4, 20, 7, dtype=F64)
    cfg = small_forward_config(128, 7, scan_block_q=32)
    x, dt, A, B, C = (args[k] for k in ("x", "dt", "A", "B", "C"))
    calls, out, final, (dt_buf, cum_buf, states), (xk, Bk, init) = forward.forward_launches(
        x, dt, A, B, C, 256, config=cfg, need_states=True, **kw)
    for t in (out, final, dt_buf, cum_buf, states):
        t.fill_(float("nan"))
    calls[0].args[8].fill_(-(2**30))
    emulate_launch(calls)
    got = forward.varlen_states(xk, Bk, dt_buf, cum_buf, states, init, cu)
    _, _, ref = ssd_recurrence(**args, **kw, cu_seqlens=cu)
    assert got.shape == ref.shape == (4, 4, 20, 7)
    err = (got - ref).abs().max().item()
    assert err <= 5e-6 * ref.abs().max().item(), f"varlen error {err:.3e}"   # 1.4e-6 measured


@pytest.mark.parametrize("dtype, headdim, dstate, computed", [
    (torch.bfloat16, 64, 128, 128), (torch.float16, 32, 64, 128),
    (torch.float32, 64, 128, 256), (torch.bfloat16, 128, 128, 128),
    (torch.float16, 96, 128, 128), (torch.bfloat16, 256, 128, 256),
    (torch.bfloat16, 64, 256, 128), (torch.float16, 64, 200, 128),
    (torch.bfloat16, 128, 256, 256), (torch.float16, 96, 200, 256),
    (torch.float32, 64, 256, 256)])
def test_computed_chunk_rule(dtype, headdim, dstate, computed):
    """Where chunk_scan_group applies (16-bit inputs, headdim <= 128 with dstate <= 128,
    headdim <= 64 with dstate <= 256) a chunk-256
    call is computed at GROUP_CHUNK with the group launch; elsewhere at the caller's chunk.
    Calls of chunk 64 keep theirs."""
    cfg = forward.forward_shape_config(2, 80, headdim, dstate, 256, dtype, 132, 8192)
    assert cfg.chunk_size == computed
    assert (cfg.scan_heads > 1) == (computed == 128)
    assert forward.forward_shape_config(2, 80, headdim, dstate, 64, dtype).chunk_size == 64


@pytest.mark.parametrize("batch, seqlen, nheads, ngroups, chunk, group", [
    (1, 512, 24, 1, 256, False),     # 8 blocks x 3 programs of 8 heads: 24 programs
    (1, 2048, 64, 1, 256, False),    # 32 x 4: 128
    (4, 4096, 8, 1, 128, True),      # 64 x 4 x 1: 256
    (2, 8192, 128, 8, 256, True),
    (1, 8192, 24, 1, 256, True),     # 128 x 3: 384
    (4, 1024, 8, 1, 128, False),     # 16 x 4: 64
    (1, 4096, 128, 8, 128, True)])   # 64 x 8 x 1: 512
def test_group_scan_needs_a_full_grid(batch, seqlen, nheads, ngroups, chunk, group):
    """The group launch only where its grid gives each of the 132 SMs a program; otherwise
    chunk_scan at the caller's chunk (the rule before the group kernel)."""
    cfg = forward.forward_shape_config(batch, nheads, 64, 128, chunk, torch.bfloat16, 132,
                                       seqlen, ngroups)
    assert (cfg.scan_heads > 1) == group
    assert cfg.chunk_size == (128 if group else chunk)
    if not group:
        assert cfg.scan_block_q == 128


#: the options without seq_idx (the walk keeps the three-kernel forward with it)
WALK_OPTIONS = {"none": {}, "D_head": OPTIONS["D_head"], "D_chan_z": OPTIONS["D_chan_z"],
                "limit_nosoftplus": OPTIONS["limit_nosoftplus"],
                "all_but_seq": {k: v for k, v in OPTIONS["all"].items() if k != "seq_idx"}}


@pytest.mark.parametrize("fold", ["none", "carry"])
@pytest.mark.parametrize("causal", [0, 4, 5])
@pytest.mark.parametrize("segments", [1, 2, 3])
@pytest.mark.parametrize("opt, Q, l, n, block_p",
                         [("all_but_seq", 64, 150, 7, 16), ("D_chan_z", 128, 300, 20, 8),
                          ("limit_nosoftplus", 64, 64, 33, 32), ("D_head", 64, 130, 16, 16),
                          ("none", 32, 97, 5, 32)])
def test_emulated_walk(opt, Q, l, n, block_p, segments, causal, fold):
    """scan_walk: decay_cumsum, (S > 1: chunk_state_pass for the runs' ends, chunk_state_carry
    for their entering states and the final state,) chunk_scan_walk carrying the state through
    each run's chunks in registers, and with scan_causal 4 / 5 its second launch over the
    flagged runs: the recurrence's outputs and final state, with headdim 20 in p-tiles of 8 to
    32 (a partial last one), dstate 5 to 33 (padded), partial last chunks, 1 to 3 runs
    (clamped to the chunk count: one chunk at l = 64). walk_carry at 2+ runs: no
    chunk_state_carry, each walk program forms its entering state and the last run writes
    the final state."""
    args, kw, _, _ = make_problem(WALK_OPTIONS[opt], l=l, Q=Q, n=n)
    cfg = small_forward_config(Q, n, chunk_size=Q, scan_walk=1, scan_block_p=block_p,
                               state_segments=segments, scan_causal=causal,
                               walk_carry=int(fold == "carry"))
    calls = forward.forward_plan(*_plan_args(args, kw, Q), cfg)
    names = [variants.kernel_name(c) for c in calls]
    segs = min(segments, -(-l // Q))
    carry = bool(cfg.walk_carry) and segs > 1
    state = ["chunk_state_pass"] + ["chunk_state_carry"] * (not carry) if segs > 1 else []
    fix = ["chunk_scan_walk"] if causal else []
    assert names == ["decay_cumsum", *state, "chunk_scan_walk", *fix]
    walk = calls[len(state) + 1]
    assert tuple(walk.grid) == (2 * 4, -(-20 // block_p), segs)
    assert (variants.kernel_arg(walk, "FLAG"), variants.kernel_arg(walk, "FIX"),
            variants.kernel_arg(walk, "CARRY")) == (causal > 0, False, carry)
    if causal:
        assert (variants.kernel_arg(calls[-1], "FIX"),
                variants.kernel_arg(calls[-1], "CARRY")) == (True, carry)
    # calls[1]: the runs' state pass, where S > 1; calls[2]: chunk_state_carry, without carry
    if carry:
        assert variants.kernel_arg(walk, "seg_final") is variants.kernel_arg(calls[1],
                                                                              "seg_final")
    if segs > 1:
        assert variants.kernel_arg(calls[1], "SEG_MODE") == 1
    if segs > 1 and not carry:
        assert variants.kernel_arg(calls[2], "ENTRY_ONLY") is True
        assert variants.kernel_arg(walk, "seg_entry") is variants.kernel_arg(calls[2], "entry")
    # measured at most 1.5e-15 of the largest element (out and final) over these cases
    check(args, kw, Q, cfg, tol=5e-15)


@pytest.mark.parametrize("opt, Q, l, n, block_p, segments, carry, causal", [
    ("all_but_seq", 64, 150, 7, 16, 1, 0, 4), ("D_chan_z", 64, 300, 20, 16, 3, 1, 5),
    ("D_head", 32, 97, 5, 8, 2, 0, 4), ("none", 64, 130, 33, 32, 1, 0, 5)])
def test_emulated_walk_fix_inline(opt, Q, l, n, block_p, segments, carry, causal):
    """walk_fix_inline on clean input: one walk launch (no flags, no second launch), the
    recurrence's outputs and final state as the walk with the fix-up launch gives them."""
    args, kw, _, _ = make_problem(WALK_OPTIONS[opt], l=l, Q=Q, n=n)
    cfg = small_forward_config(Q, n, chunk_size=Q, scan_walk=1, scan_block_p=block_p,
                               state_segments=segments, scan_causal=causal, walk_carry=carry,
                               walk_fix_inline=1)
    calls = forward.forward_plan(*_plan_args(args, kw, Q), cfg)
    names = [variants.kernel_name(c) for c in calls]
    assert names.count("chunk_scan_walk") == 1 and names[0] == "decay_cumsum", names
    walk = calls[-1]
    assert (variants.kernel_arg(walk, "FLAG"), variants.kernel_arg(walk, "FIX"),
            variants.kernel_arg(walk, "FIX_INLINE")) == (True, False, True)
    check(args, kw, Q, cfg, tol=5e-15)


def test_walk_applies_only_where_it_can():
    """The walk replaces the state pass and the output launch only without seq_idx, in causal
    modes 0, 4 and 5, without scan_cb and at computed chunks up to 128; forward_launches turns
    it off where varlen states read the chunk states, and allocates no chunk states under it;
    the backward's recompute of the states never takes it."""
    from mamba2_cutile.ssd import backward
    args, kw, _, _ = make_problem(OPTIONS["none"], l=300, Q=64)
    base = small_forward_config(64, 7, scan_walk=1)
    for over, walks in [(dict(), True), (dict(scan_causal=2), False), (dict(scan_cb=1), False),
                        (dict(scan_causal=1), False), (dict(chunk_size=256), False)]:
        assert forward.uses_walk(replace(base, **over), False) is walks, over
    assert not forward.uses_walk(base, True)
    # a state tile above WALK_MAX_STATE (64 x 256: does not build) keeps the three-kernel plan
    wide = replace(forward.forward_config(2, 32, 64, 256, 256, torch.bfloat16, 132,
                                          seqlen=8192), scan_block_p=64)
    assert wide.scan_walk == 1 and not forward.uses_walk(wide, False)
    assert forward.uses_walk(replace(wide, scan_block_p=32), False)
    x, dt, A, B, C = (args[k] for k in ("x", "dt", "A", "B", "C"))
    for need in (False, True):
        calls, _, _, (_, _, states), _ = forward.forward_launches(x, dt, A, B, C, 64,
                                                                  config=base, need_states=need)
        names = [variants.kernel_name(c) for c in calls]
        assert ("chunk_scan_walk" in names) is (not need)
        assert states.shape == ((2, 4, 5, 20, 7) if need else (1, 1, 1, 1, 1))
    seq = dict(kw, seq_idx=torch.zeros(2, 300, dtype=torch.int32))
    calls = forward.forward_launches(x, dt, A, B, C, 64, config=base, **seq)[0]
    assert "chunk_scan_walk" not in [variants.kernel_name(c) for c in calls]
    bcfg = replace(backward.backward_config(2, 4, 2, 20, 7, 64, F64), dstate_pad=16)
    assert backward.recompute_config(bcfg, x, B).scan_walk == 0


@pytest.mark.parametrize("segments, block_n, carry", [(3, 8, 0), (2, 16, 0), (3, 8, 1)])
def test_emulated_walk_through_forward_launches(segments, block_n, carry):
    """The walk as forward_launches plans it: with its stand-in for the chunk states (no
    (B, H, C, P, N) buffer), the segmented pass and chunk_state_carry take their sizes from
    the segment scratch (dstate 20 in state tiles of 8 or 16: several n-tiles per run; with
    walk_carry the walk reads the whole run ends those tiles wrote). The decay buffers forward_launches allocates are float32: 4.3e-5 of the largest output
    measured, as in `test_computed_chunk_shorter_than_the_callers`."""
    args, kw, _, _ = make_problem(WALK_OPTIONS["all_but_seq"], l=300, Q=64, n=20)
    cfg = small_forward_config(64, 20, scan_walk=1, state_segments=segments,
                               state_block_n=block_n, walk_carry=carry)
    x, dt, A, B, C = (args[k] for k in ("x", "dt", "A", "B", "C"))
    calls, out, final, (dt_buf, cum_buf, states), _ = forward.forward_launches(
        x, dt, A, B, C, 64, config=cfg, **kw)
    assert states.shape == (1, 1, 1, 1, 1)
    assert ("chunk_state_carry" in [variants.kernel_name(c) for c in calls]) is not carry
    for t in (out, final, dt_buf, cum_buf):
        t.fill_(float("nan"))
    emulate_launch(calls)
    ref_out, ref_final, _ = ssd_recurrence(**args, **kw)
    for name, got, ref in (("out", out, ref_out), ("final", final, ref_final)):
        err = (got - ref).abs().max().item()
        assert err <= 1.5e-4 * ref.abs().max().item(), f"{name}: error {err:.3e}"


def test_walk_rule_empty_grid():
    """No programs (a zero batch, head count or headdim), no walk: nothing to divide by."""
    for dims in ((0, 8, 64), (4, 0, 64), (4, 8, 0)):
        assert forward.walk_form(*dims, 128, torch.bfloat16, 16384, 132) == (0, 0)


@pytest.mark.parametrize(
    "batch, seqlen, nheads, ngroups, headdim, dstate, dtype, segments, occupancy", [
        (2, 8192, 128, 8, 64, 128, torch.bfloat16, 1, 2),   # 256 programs, two per SM
        (2, 8192, 80, 1, 64, 128, torch.bfloat16, 1, 2),    # 160, two per SM
        (4, 16384, 48, 1, 64, 128, torch.bfloat16, 1, 2),   # 192, two per SM (untimed)
        (3, 8192, 88, 1, 64, 128, torch.bfloat16, 1, 2),    # 264: two per SM, every SM
        (4, 8192, 128, 8, 64, 128, torch.bfloat16, 0, 0),   # 512: an 88% last wave of one
        (2, 8192, 64, 1, 64, 128, torch.float16, 1, 0),     # 128: one wave, 97%
        (2, 8192, 48, 1, 64, 128, torch.bfloat16, 1, 0),    # 96: one wave, 73%
        (4, 16384, 8, 1, 64, 128, torch.bfloat16, 8, 2),    # the seed problem: 8 x 32 runs
        (2, 8192, 24, 1, 64, 128, torch.bfloat16, 5, 2),    # 5 x 48 runs: 91% of 2 SMs
        (2, 8192, 32, 1, 64, 128, torch.bfloat16, 4, 2),    # 4 x 64 runs
        (1, 8192, 80, 1, 64, 128, torch.bfloat16, 3, 2),    # 3 x 80 runs (untimed)
        (1, 16384, 32, 1, 32, 64, torch.float16, 8, 2),     # 8 x 32 runs (untimed)
        (1, 2048, 64, 1, 64, 128, torch.bfloat16, 2, 0),    # 2 x 64 runs, from 2048 tokens
        (4, 4096, 8, 1, 64, 128, torch.bfloat16, 0, 0),     # other runs only from 8192
        (1, 4096, 80, 1, 64, 128, torch.bfloat16, 0, 0),    # (3 x 80 at 8192 above)
        (2, 4096, 64, 1, 64, 128, torch.bfloat16, 0, 0),    # one wave only from 8192
        (2, 8192, 32, 1, 64, 256, torch.bfloat16, 1, 0),    # dstate 256: 2 x 64 of 32 ch.
        (1, 8192, 16, 1, 64, 256, torch.bfloat16, 0, 0),    # dstate 256: 32 programs, no runs
        (2, 8192, 128, 8, 64, 256, torch.bfloat16, 0, 0),   # 512 programs: an 88% last wave
        (2, 8192, 64, 1, 64, 200, torch.bfloat16, 1, 0),    # 200 pads to 256: 2 x 128 ...
        (1, 8192, 136, 1, 64, 256, torch.bfloat16, 0, 0),   # 272 at dstate 256: a 6% wave
        (1, 8192, 80, 1, 64, 256, torch.bfloat16, 0, 0),    # 160 at dstate 256: never two
        (1, 8192, 132, 1, 64, 128, torch.bfloat16, 1, 0),   # 132: one per SM, every SM
        (1, 8192, 133, 1, 64, 128, torch.bfloat16, 1, 2),   # 133: two per SM (untimed)
        (1, 8192, 265, 1, 64, 128, torch.bfloat16, 0, 0),   # 265: a 1-program last wave
        (2, 4096, 80, 1, 64, 128, torch.bfloat16, 0, 0),    # 160 below 8192 tokens
        (1, 8192, 44, 1, 64, 128, torch.bfloat16, 6, 2),    # 6 x 44 runs (untimed)
        (1, 8192, 36, 1, 64, 128, torch.bfloat16, 7, 2),    # 7 x 36 runs (untimed)
        (1, 8192, 48, 1, 64, 256, torch.bfloat16, 1, 0),    # 96 of 32 channels: one wave
        (1, 4096, 24, 1, 64, 128, torch.bfloat16, 0, 0),    # short sequences stay
        (1, 8192, 16, 1, 64, 128, torch.bfloat16, 0, 0),    # 16 programs: 8 runs fill 48%
        (2, 8192, 128, 8, 64, 128, torch.float32, 0, 0),    # 16-bit inputs only
        (2, 8192, 48, 1, 128, 128, torch.bfloat16, 1, 2),   # headdim 128: 192, two per SM
        (1, 8192, 48, 1, 128, 128, torch.bfloat16, 0, 0),   # 96 of headdim 128: one wave
        (2, 8192, 48, 1, 96, 128, torch.bfloat16, 0, 0),    # headdim 96: padded tiles
        (1, 8192, 40, 1, 256, 128, torch.bfloat16, 0, 0),   # headdim 256: 160, untimed
        (2, 8192, 40, 1, 128, 256, torch.bfloat16, 0, 0),   # headdim 128 at dstate 256
        (2, 4096, 48, 1, 128, 128, torch.bfloat16, 0, 0),   # below 8192 tokens
        (2, 8192, 128, 8, 128, 128, torch.bfloat16, 0, 0)])  # 512 of headdim 128
def test_walk_rule(batch, seqlen, nheads, ngroups, headdim, dstate, dtype, segments,
                   occupancy):
    """forward_config takes the walk where `walk_form` fills the 132 SMs, one or two
    programs each, computed at chunk 64 with `walk_block_p` channels a program; never with
    seq_idx or where varlen states read the chunk states (walk_ok False)."""
    def cfg(**kw):
        return forward.forward_config(batch, nheads, headdim, dstate, 256, dtype, 132,
                                      seqlen=seqlen, ngroups=ngroups, **kw)
    assert forward.walk_form(batch, nheads, headdim, dstate, dtype, seqlen, 132) == (
        segments, occupancy)
    walk = cfg()
    assert forward.uses_walk(walk, False) is bool(segments)
    assert walk.walk_fix_inline == 0     # slower in these walks (`short_walk_config`)
    if segments:
        assert (walk.chunk_size, walk.scan_block_p, walk.state_segments,
                walk.walk_occupancy) == (64, forward.walk_block_p(walk.dstate_pad), segments,
                                         occupancy)
        if segments > 1:
            # the runs' ends over whole states two per SM, each walk program forming its
            # run's entering state (no chunk_state_carry)
            assert (walk.state_block_p, walk.state_block_n, walk.state_occupancy,
                    walk.walk_carry) == (64, walk.dstate_pad, 2, 1)
        else:
            assert walk.walk_carry == 0
    off = cfg(walk_ok=False)
    assert off.scan_walk == 0 and cfg(has_seq=True).scan_walk == 0
    if segments:                         # the walk's fields replace only the rule's
        assert walk == forward.walk_config(off, segments, occupancy)
    else:
        assert walk == off


@pytest.mark.parametrize("batch, seqlen, nheads, headdim, dstate, dtype, short", [
    (1, 512, 24, 64, 128, torch.bfloat16, True),      # 96 programs of 16 channels (timed)
    (1, 1000, 24, 64, 128, torch.bfloat16, True),     # timed: even with the three kernels
    (1, 1024, 33, 64, 128, torch.float16, True),      # 132 programs: one wave
    (2, 300, 8, 32, 64, torch.bfloat16, True),        # 32 programs, untimed
    (1, 1025, 24, 64, 128, torch.bfloat16, False),    # past WALK_SHORT_MAX_SEQLEN
    (1, 512, 34, 64, 128, torch.bfloat16, False),     # 136 programs: a second wave
    (1, 512, 24, 64, 256, torch.bfloat16, False),     # dstate 256
    (1, 512, 24, 128, 128, torch.bfloat16, False),    # headdim 128
    (1, 512, 24, 8, 128, torch.bfloat16, False),      # headdim below one 16-channel tile
    (1, 512, 24, 64, 128, torch.float32, False),      # 16-bit inputs only
    (1, 2048, 24, 64, 128, torch.bfloat16, False)])   # from 2048 tokens the runs' rule
def test_short_walk_rule(batch, seqlen, nheads, headdim, dstate, dtype, short):
    """Up to WALK_SHORT_MAX_SEQLEN tokens forward_config takes the short walk where its
    16-channel programs fit one wave: chunk 64, one run, the causal fix-up in each program,
    so two launches; never with seq_idx or where varlen states read the chunk states."""
    def cfg(**kw):
        return forward.forward_config(batch, nheads, headdim, dstate, 256, dtype, 132,
                                      seqlen=seqlen, **kw)
    assert forward.short_walk(batch, nheads, headdim, dstate, dtype, seqlen, 132) is short
    walk, off = cfg(), cfg(walk_ok=False)
    assert off.scan_walk == 0 and cfg(has_seq=True).scan_walk == 0
    if not short:
        assert walk.walk_fix_inline == 0
        return
    assert walk == forward.short_walk_config(off)
    assert forward.uses_walk(walk, False)
    assert (walk.chunk_size, walk.scan_block_p, walk.state_segments, walk.walk_fix_inline,
            walk.scan_causal) == (64, 16, 1, 1, 4)
    x = torch.empty(batch, seqlen, nheads, headdim, dtype=dtype, device="meta")
    dt = torch.empty(batch, seqlen, nheads, device="meta")
    bc = torch.empty(batch, seqlen, 1, dstate, dtype=dtype, device="meta")
    A = torch.empty(nheads, device="meta")
    calls = forward.forward_launches(x, dt, A, bc, bc, chunk_size=256, config=walk)[0]
    names = [c.kernel._annotated_function.pyfunc.__name__[:-3] for c in calls]
    assert names == ["decay_cumsum", "chunk_scan_walk"], names
