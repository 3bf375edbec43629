"""CPU: every forward and backward kernel variant the dispatchers pick compiles for sm_90 (and the
all-options variants for sm_100; the rest of sm_100, and the sm_90 variants of
`support.variants.SLOW_VARIANTS`, are marked slow).

Kernels are compiled from the same plans the GPU path launches, on `meta` tensors, so a compile
error shows here before any GPU time is spent. A launch whose machine code an earlier one
already decides (same kernel, hints, constants and array constraints; see
`support.variants.signature_key`) is compiled once: the backward's recompute launches are the
forward's kernels, and most variants share most kernels.
"""

import pytest

pytest.importorskip("cuda.tile")

from mamba2_cutile.bench import compile as cpu_compile  # noqa: E402
from mamba2_cutile.bench import plans, resources  # noqa: E402
from support import variants  # noqa: E402

pytestmark = pytest.mark.compile

FAMILIES = ("forward", "backward")
CASES = [pytest.param(arch, fam, name, i, id=f"{arch}-{tid}",
                      marks=(pytest.mark.slow,) if slow else ())
         for arch in ("sm_90", "sm_100")
         for tid, fam, name, i, slow in variants.distinct_launches(FAMILIES, arch)]


@pytest.mark.parametrize("arch, family, name, index", CASES)
def test_launch_compiles(arch, family, name, index):
    assert cpu_compile.compile_call(variants.launch_of(family, name, index), arch) > 0


def _rule_config(problem):
    """The config forward_problem_plan builds for `problem`, whether it has seq_idx, and the
    problem's parameters with the builder's defaults."""
    import inspect
    from dataclasses import replace

    from mamba2_cutile.ssd.forward import forward_config

    kw = {k: v.default for k, v in inspect.signature(plans.forward_problem_plan).parameters.items()
          if v.default is not inspect.Parameter.empty}
    kw.update(problem)
    b, h, p = kw["batch"], kw["nheads"], kw["headdim"]
    seqlen = max(kw["seqlen"], -(-(2**31) // (b * h * p)) + 1) if kw["int64"] else kw["seqlen"]
    cfg = replace(forward_config(b, h, p, kw["dstate"], kw["chunk_size"], kw["dtype"],
                                 seqlen=seqlen, has_seq="seq_idx" in kw["options"],
                                 ngroups=kw["ngroups"], walk_ok=not kw["overrides"]),
                  **(kw["overrides"] or {}))
    return cfg, "seq_idx" in kw["options"], kw


def _rule_heads(problem):
    """The heads a chunk_scan_group program walks in `problem`'s plan (1: chunk_scan), from
    the config forward_problem_plan builds."""
    from mamba2_cutile.ssd.forward import group_scan_heads

    cfg, _, kw = _rule_config(problem)
    return group_scan_heads(cfg, kw["nheads"] // kw["ngroups"])


def test_plans_have_their_launches():
    """Each forward plan holds the 3 forward launches and, with scan_causal 1 to 4, a fourth:
    chunk_scan's flagged-tile pass (4, the default: the state pass writes the flags); each
    backward plan the 6 backward ones (2 recompute, the state pass without flags + 4 backward
    kernels; with a head split of the dB/dC launch, the partials' sum too; at long sequences
    dB/dC in two launches, through the groups' C B^T gradient)."""
    from mamba2_cutile.kernels.chunk_scan import FIX_SPAN, chunk_scan, chunk_scan_i64

    from mamba2_cutile.ssd.forward import uses_walk

    for name, problem in variants.forward_variants():
        default = plans.forward_problem_plan(**problem)
        cfg, has_seq, _ = _rule_config(problem)
        if uses_walk(cfg, has_seq):
            # the walk rule's problems (`walk_form`): the walk and its fix-up launch (with
            # runs, the segmented pass for their ends first, each walk program forming its
            # run's entering state); the three-kernel plans are checked on the other problems
            runs = ["chunk_state_pass"] * (cfg.state_segments > 1)
            assert cfg.walk_carry == (cfg.state_segments > 1), name
            assert [variants.kernel_name(c) for c in default] == [
                "decay_cumsum", *runs, "chunk_scan_walk", "chunk_scan_walk"], name
            assert variants.kernel_arg(default[-2], "FLAG") is True, name
            assert variants.kernel_arg(default[-1], "FIX") is True, name
            continue
        # the output launch: chunk_scan_group where the shape rule sets scan_heads (chunk
        # 128) and the heads per group allow it, chunk_scan otherwise
        out = variants.kernel_name(default[2])
        group = out == "chunk_scan_group"
        assert [variants.kernel_name(c) for c in default] == [
            "decay_cumsum", "chunk_state_pass", out, "chunk_scan"], name
        assert group == (_rule_heads(problem) > 1), name
        assert default[3].args[-1] == 8 and (group or default[2].args[-1] == 0), name
        assert variants.kernel_arg(default[1], "FLAG") is True, name
        calls = plans.forward_problem_plan(
            **dict(problem, overrides=dict(problem.get("overrides") or {}, scan_causal=0)))
        assert [variants.kernel_name(c) for c in calls] == [
            "decay_cumsum", "chunk_state_pass", out], name
        assert group or calls[2].args[-1] == 0, name
        assert variants.kernel_arg(calls[1], "FLAG") is False, name
        for causal, checks in ((1, (1, 2)), (2, (3, 4)), (3, (5, 6)), (4, (0, 8)), (5, (0, 9))):
            plan = plans.forward_problem_plan(
                **dict(problem, overrides=dict(problem.get("overrides") or {},
                                               scan_causal=causal)))
            # the flagging forms (1-3) take chunk_scan's plain launch
            first = out if causal >= 4 else "chunk_scan"
            assert [variants.kernel_name(c) for c in plan[2:]] == [first, "chunk_scan"]
            if first == "chunk_scan":
                assert plan[2].args[-1] == checks[0], name
            assert plan[3].args[-1] == checks[1], name
            assert variants.kernel_arg(plan[1], "FLAG") is (causal in (4, 5)), name
            if causal == 1:
                assert plan[3].grid == plan[2].grid, name
            elif causal in (4, 5):   # a program per (batch, head), the state pass's flags
                flags = variants.kernel_arg(plan[1], "flags")
                assert plan[3].args[-2] is flags and flags.shape == (
                    plan[1].grid[0], plan[1].grid[1] * plan[1].grid[2]), name
                # 5: a program per query block of a chunk and p-tile too
                tiles = 1 if causal == 4 else (
                    variants.kernel_arg(plan[3], "Q") // variants.kernel_arg(plan[3], "BLOCK_Q")
                    * plan[2].grid[1])
                assert plan[3].grid == (flags.shape[0], tiles, 1), name
                assert variants.kernel_arg(plan[3], "FLAG_W") >= flags.shape[1], name
                # launched without the scan's hints, as the FIX_SPAN pass (compiled in
                # test_causal_scan_compiles)
                assert plan[3].kernel in (chunk_scan, chunk_scan_i64), name
                # its chunk_scan launch is the plain one (the same compiled kernel)
                assert variants.variant_of(plan[2]) == variants.variant_of(calls[2]), name
            else:          # a program per FIX_SPAN tiles, flags one row per tile
                flags = plan[2].args[-2]
                assert flags.shape[1] == (
                    1 if causal == 2 else variants.kernel_arg(plan[2], "BLOCK_Q")), name
                assert plan[3].grid == (-(-flags.shape[0] // FIX_SPAN), 1, 1), name
    for name, problem in variants.backward_variants():
        bwd = plans.backward_problem_plan(**problem)
        names = [variants.kernel_name(c) for c in bwd]
        # the recompute and the reverse pass in either order: side_streams=2 (few heads) puts
        # the reverse pass first, on side stream 1, beside the recompute
        assert sorted(names[1:3]) == ["bwd_state_pass", "chunk_state_pass"], name
        rev = bwd[names.index("bwd_state_pass")]
        assert rev.stream == (1 if names[1] == "bwd_state_pass" else 0), name
        recompute = bwd[names.index("chunk_state_pass")]
        assert variants.kernel_arg(recompute, "FLAG") is False, name    # no flags to feed
        if "unfused" in name:
            dbc = ["bwd_chunk_dbc"]
        elif "dcb-head-split" in name:                      # bc_fused 2 split, its sum
            dbc = ["bwd_chunk_dcb", "bwd_chunk_dbc_group", "sum_partials"]
        elif "head-split" in name:                          # the head split's sum
            dbc = ["bwd_chunk_dbc_fused", "sum_partials"]
        elif "fused-dbc" in name or "split-da" in name:
            dbc = ["bwd_chunk_dbc_fused"]
        else:
            dbc = ["bwd_chunk_dcb", "bwd_chunk_dbc_group"]
        assert names[0] == "decay_cumsum" and names[3:] == [*dbc, "bwd_chunk_dx", "bwd_dt"], \
            name


@pytest.mark.parametrize("causal", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("chunk_size", [64, pytest.param(256, marks=pytest.mark.slow)])
def test_causal_scan_compiles(chunk_size, causal):
    """scan_causal's two chunk_scan launches (the flagging one and the flagged-tile pass),
    all options, for sm_90; with 4 the flagging state pass too."""
    # 1000 tokens: chunk_scan at the chunk asked (too few group programs for the SMs)
    calls = plans.forward_problem_plan(chunk_size=chunk_size, seqlen=1000,
                                       overrides={"scan_causal": causal})
    assert variants.kernel_arg(calls[2], "Q") == chunk_size
    for call in calls[1 if causal in (4, 5) else 2:]:
        assert len(cpu_compile.compile_cubin(call, "sm_90")) > 0


def test_causal4_state_pass_keeps_the_default_pipeline():
    """scan_causal 4's flag without seq_idx is one tile sum of the run's last state, after the
    chunk loop: the state pass compiles to the default's registers, threads and shared memory
    at the seed problem but for the sum's scratch (a sum per chunk in the loop took it to
    another pipeline, 209 KB of shared memory against 151 KB)."""
    got = {}
    for causal in (0, 4):
        calls = plans.forward_problem_plan(options=("D_head",),
                                           overrides=dict(scan_causal=causal))
        r = resources.compile_resources(calls[1])
        got[causal] = (r["regs"], r["stack"], r["threads"], r["smem"])
    # the same registers, stack and threads; shared memory but for the sum's few bytes
    assert got[4][:3] == got[0][:3] and abs(got[4][3] - got[0][3]) <= 256, got


@pytest.mark.parametrize("causal", [2, 3])
@pytest.mark.parametrize("block_q", [64, 128])
def test_fix_span_pass_takes_no_scan_hints(block_q, causal):
    """The FIX_SPAN pass (scan_causal 2 / 3) is launched without the scan's occupancy and warps
    hints: under the seed problem's tuned occupancy 2 it did not return on the H200 (64-token
    query blocks, clean input) and failed to compile at 128-token blocks. Both launches
    compile for sm_90 at that config."""
    from mamba2_cutile.kernels.chunk_scan import chunk_scan, chunk_scan_i64

    calls = plans.forward_problem_plan(options=("D_head",), overrides=dict(
        scan_causal=causal, scan_block_q=block_q, scan_occupancy=2, scan_warps=4))
    assert calls[2].kernel not in (chunk_scan, chunk_scan_i64)       # the hinted scan
    assert calls[3].kernel is chunk_scan
    for call in calls[2:]:
        assert len(cpu_compile.compile_cubin(call, "sm_90")) > 0


@pytest.mark.parametrize("over", [
    dict(state_segments=4),
    dict(state_segments=4, state_occupancy=4),
    dict(state_segments=8, state_block_n=64, state_occupancy=2),
    dict(state_segments=1, state_load_latency=0),        # 0: no latency hint (compiler's)
    dict(state_segments=4, state_occupancy=4, segment_fold=1),
    dict(state_segments=4, state_block_n=128, state_occupancy=2, state_resweep=1),
], ids=["seg4", "seg4-occ4", "seg8-n64-occ2", "latency0", "seg4-occ4-fold",
        "seg4-n128-occ2-resweep"])
@pytest.mark.parametrize("options", [("D_head",), ("D_head", "seq_idx", "init")],
                         ids=["D", "D-seq-init"])
def test_segmented_state_pass_compiles(over, options):
    """The segmented state pass (`state_segments`) and its chunk_state_carry launch, and the
    state pass without a load latency hint, compile for sm_90 at the seed problem."""
    calls = plans.forward_problem_plan(options=options, overrides=over)
    names = [variants.kernel_name(c) for c in calls]
    segs = over["state_segments"]
    # the flagged-tile pass of scan_causal 4 (the default) last
    fold = over.get("segment_fold", 0)
    resweep = over.get("state_resweep", 0)
    # the output launch at chunk 128: chunk_scan_group, which adds the segments' entering
    # states where they are folded; with state_resweep the pass again after the carry
    assert names == ["decay_cumsum", "chunk_state_pass"] + (
        ["chunk_state_carry"] if segs > 1 else []) + (
        ["chunk_state_pass"] if resweep else []) + ["chunk_scan_group", "chunk_scan"]
    assert calls[1].grid[2] == 4 * segs // (over.get("state_block_n", 32) // 32)
    assert variants.kernel_arg(calls[-2], "SEGS") == (segs if fold else 1)
    for call in calls[1:-1] if fold else calls[1:-2]:
        assert len(cpu_compile.compile_cubin(call, "sm_90")) > 0


@pytest.mark.parametrize("problem, over", [
    ({}, dict(scan_cb=1)),
    (dict(batch=2, seqlen=8192, nheads=80, chunk_size=256), dict(scan_cb=1)),
    (dict(batch=2, seqlen=8192, nheads=32, dstate=256, chunk_size=256), dict(scan_cb=1)),
], ids=["seed", "2.7b", "dstate256"])
@pytest.mark.parametrize("options", [("D_head",), ("D_head", "seq_idx", "z")],
                         ids=["D", "D-seq-z"])
def test_scan_cb_compiles(problem, over, options):
    """scan_cb: chunk_cb and chunk_scan reading its C B^T blocks compile for sm_90, chunk_cb
    without spills."""
    calls = plans.forward_problem_plan(options=options, overrides=over, **problem)
    names = [variants.kernel_name(c) for c in calls]
    assert names == ["decay_cumsum", "chunk_state_pass", "chunk_cb", "chunk_scan", "chunk_scan"]
    for call in calls[2:4]:
        assert len(cpu_compile.compile_cubin(call, "sm_90")) > 0
    assert resources.compile_resources(calls[2])["stack"] == 0       # chunk_cb: no spills


@pytest.mark.parametrize("problem, over", [
    ({}, dict(scan_heads=8)),
    ({}, dict(scan_heads=8, scan_block_q=64, scan_occupancy=2)),
    ({}, dict(scan_heads=2, scan_block_n=64)),
    (dict(batch=2, seqlen=8192, nheads=128, ngroups=8, chunk_size=128), dict(scan_heads=16)),
    (dict(chunk_size=64, headdim=128, dstate=64), dict(scan_heads=4)),
], ids=["seed-8", "seed-8-q64", "seed-2-n64", "7b-q128-16", "q64-p128-4"])
@pytest.mark.parametrize("options", [("D_head",), ("D_head", "seq_idx", "z", "init")],
                         ids=["D", "D-seq-z-init"])
def test_scan_heads_compiles(problem, over, options):
    """scan_heads: chunk_scan_group (a chunk of one query block, several heads of a group a
    program) compiles for sm_90 in bf16 and fp32 (tf32 MMAs), the fix-up launch after it."""
    import torch

    for dtype in (torch.bfloat16, torch.float32):
        calls = plans.forward_problem_plan(options=options, dtype=dtype, overrides={
            "scan_block_q": problem.get("chunk_size", 128), **over}, **problem)
        assert [variants.kernel_name(c) for c in calls] == [
            "decay_cumsum", "chunk_state_pass", "chunk_scan_group", "chunk_scan"]
        assert len(cpu_compile.compile_cubin(calls[2], "sm_90")) > 0


@pytest.mark.parametrize("over", [dict(bstate_segments=4, state_segments=4, side_streams=0),
                                  dict(bstate_segments=8, bstate_occupancy=4,
                                       state_segments=4, state_occupancy=4, side_streams=0)],
                         ids=["seg4", "seg8-occ4"])
def test_segmented_backward_state_passes_compile(over):
    """The backward with both state passes in segments (all options): its nine launches,
    the two state passes and their chunk_state_carry launches compile for sm_90."""
    calls = plans.backward_problem_plan(overrides=over)
    names = [variants.kernel_name(c) for c in calls]
    assert names[:5] == ["decay_cumsum", "chunk_state_pass", "chunk_state_carry",
                         "bwd_state_pass", "chunk_state_carry"] and len(calls) == 9
    # REVERSE, dinit (init given), not ENTRY_ONLY
    assert tuple(variants.kernel_arg(calls[4], k) for k in ("REVERSE", "WRITE_END",
                                                             "ENTRY_ONLY")) == (True, True, False)
    for call in calls[1:5]:
        assert len(cpu_compile.compile_cubin(call, "sm_90")) > 0


def test_scan_cb_scratch_past_int32_widens_only_its_launches():
    """scan_cb's C B^T scratch (B * L * G * Q floats) reaches 2^31 elements at one sequence of
    2^20 tokens in 8 groups at chunk 256, where x (2^29 elements) does not: the launches that
    touch the scratch (chunk_cb, chunk_scan) take the 64-bit variants, the others stay 32-bit."""
    import cuda.tile as ct

    def wide(call, param):
        fn = call.kernel._annotated_function.pyfunc
        return fn.__annotations__.get(param) is ct.IndexedWithInt64

    calls = plans.forward_problem_plan(batch=1, seqlen=2**20, nheads=8, ngroups=8,
                                       chunk_size=256, options=("D_head",),
                                       overrides=dict(scan_cb=1, chunk_size=256))
    assert [variants.kernel_name(c) for c in calls] == [
        "decay_cumsum", "chunk_state_pass", "chunk_cb", "chunk_scan", "chunk_scan"]
    assert variants.kernel_arg(calls[2], "cb").numel() == 2**31
    assert [wide(c, p) for c, p in zip(calls, ("dt", "x", "cb", "cbuf", "cbuf"))] == [
        False, False, True, True, True]


#: the 32-channel, 4-warp dx tiles bwd_chunk_dx_group was timed with (the dispatcher gives the
#: per-head kernel 64 channels and 8 warps at headdim 64 since 2026-12-06)
NARROW = dict(dx_block_p=32, dx_warps=4)


@pytest.mark.parametrize("problem, over, spill_free", [
    ({}, dict(dx_heads=8, **NARROW), True),
    (dict(batch=2, seqlen=8192, nheads=80, chunk_size=256), dict(dx_heads=16, **NARROW), True),
    (dict(batch=2, seqlen=8192, nheads=128, ngroups=8, chunk_size=256),
     dict(dx_heads=16, **NARROW), True),
    (dict(batch=2, seqlen=8192, nheads=48, headdim=128, chunk_size=256),
     dict(dx_heads=8, dx_block_p=32), True),
    (dict(batch=2, seqlen=8192, nheads=32, dstate=256, chunk_size=256),
     dict(dx_heads=8, **NARROW), False),
    (dict(batch=2, seqlen=8192, nheads=32, dstate=256, chunk_size=256),
     dict(dx_heads=8, dx_block_n=128, dx_occupancy=2, **NARROW), True),
], ids=["seed-8", "2.7b-16", "7b-16", "p128-8", "n256-8", "n256-8-n128-occ2"])
@pytest.mark.parametrize("options", [("D_head", "dfinal"), ("D_chan", "seq_idx", "init")],
                         ids=["D", "Dp-seq-init"])
def test_dx_heads_compiles(problem, over, spill_free, options):
    """dx_heads: bwd_chunk_dx_group compiles for sm_90 in place of bwd_chunk_dx (no z), without
    spills at headdim 64 and 128 with dstate 128 (32-channel programs at headdim 128: 64
    spill 336-392 bytes per thread), and at dstate 256 in 128-wide dstate tiles under
    occupancy 2 and 4 warps (whole-N tiles there spill 448 bytes per thread; 8 warps, the
    per-head kernel's rule there, 424-464)."""
    calls = plans.backward_problem_plan(options=options, overrides=over, **problem)
    names = [variants.kernel_name(c) for c in calls]
    assert "bwd_chunk_dx_group" in names and "bwd_chunk_dx" not in names
    call = calls[names.index("bwd_chunk_dx_group")]
    res = resources.compile_resources(call)
    assert res["regs"] > 0
    if spill_free:
        assert res["stack"] == 0, res


@pytest.mark.parametrize("problem, options, ctas, max_stack", [
    (dict(batch=2, seqlen=8192, nheads=80, chunk_size=256), ("D_head", "dfinal"), 2, 64),
    (dict(batch=2, seqlen=8192, nheads=80, chunk_size=256),
     ("D_chan", "seq_idx", "init", "dfinal", "dt_bias", "softplus"), 2, 128),
    (dict(batch=2, seqlen=8192, nheads=32, dstate=256, chunk_size=256), ("D_head",), 1, 0),
], ids=["2.7b-D", "2.7b-all-but-z", "n256-D"])
def test_dx_64_channel_compiles(problem, options, ctas, max_stack):
    """The dispatcher's bwd_chunk_dx at headdim 64 without z (64 channels, 8 warps) compiles
    for sm_90 at two CTAs per SM with dstate 128 (spilling 32-88 bytes per thread in
    tileiras 13.4, timed so: benchmarks/results/2026-12-06-h100-backward-sweep-dx-64-
    channels.jsonl) and without spills at dstate 256 (one CTA per SM, no occupancy hint)."""
    calls = plans.backward_problem_plan(options=options, **problem)
    call = calls[[variants.kernel_name(c) for c in calls].index("bwd_chunk_dx")]
    assert variants.kernel_arg(call, "BLOCK_P") == 64
    res = resources.compile_resources(call)
    assert res["ctas_per_sm"] == ctas and res["stack"] <= max_stack, res


def test_wide_state_dispatch_compiles():
    """At dstate 256 (B=2 T=8K H=32, chunk 256): the dispatcher's forward is the walk in
    32-channel programs (spilling at most 8 bytes per thread, its fix-up launch 176 here);
    its three-kernel rule, where the walk does not apply, the group launch computed at chunk
    128 (with D per head 16 bytes of spills per thread in tileiras 13.4;
    benchmarks/results/2026-12-06-h100-forward-sweep-group-dstate256.jsonl); its backward:
    the reverse state pass in 32 x 256 tiles (spilling 80 bytes per thread here, timed so:
    benchmarks/results/2026-12-06-h100-backward-sweep-wide-tiles.jsonl) and the dS launch in
    64-token blocks at two CTAs per SM."""
    problem = dict(batch=2, seqlen=8192, nheads=32, dstate=256, chunk_size=256)
    walk = plans.forward_problem_plan(options=("D_head",), **problem)
    assert [variants.kernel_name(c) for c in walk] == [
        "decay_cumsum", "chunk_scan_walk", "chunk_scan_walk"]
    assert variants.kernel_arg(walk[1], "BLOCK_P") == 32
    assert resources.compile_resources(walk[1])["stack"] <= 8
    assert resources.compile_resources(walk[2])["stack"] <= 176
    fwd = plans.forward_problem_plan(options=("D_head",), overrides=dict(scan_walk=0),
                                     **problem)
    names = [variants.kernel_name(c) for c in fwd]
    assert names == ["decay_cumsum", "chunk_state_pass", "chunk_scan_group", "chunk_scan"]
    assert variants.kernel_arg(fwd[2], "Q") == 128
    assert resources.compile_resources(fwd[2])["stack"] <= 16
    bwd = plans.backward_problem_plan(options=("D_head", "dfinal"), **problem)
    names = [variants.kernel_name(c) for c in bwd]
    state = bwd[names.index("bwd_state_pass")]
    assert (variants.kernel_arg(state, "BLOCK_P"), variants.kernel_arg(state, "BLOCK_N")) == (
        32, 256)
    assert resources.compile_resources(state)["stack"] <= 80
    dcb = bwd[names.index("bwd_chunk_dcb")]
    assert variants.kernel_arg(dcb, "BLOCK_Q") == 64
    assert resources.compile_resources(dcb)["ctas_per_sm"] == 2


def test_heads_kernels_int64_variants_compile():
    """Past 2^31 elements the plans launch the 64-bit variants of chunk_scan_group and
    bwd_chunk_dx_group; both compile for sm_90."""
    import cuda.tile as ct

    fwd = plans.forward_problem_plan(options=("D_head",), int64=True, overrides=dict(
        scan_heads=8, scan_block_q=64, scan_occupancy=2))
    bwd = plans.backward_problem_plan(options=("D_head", "dfinal"), int64=True,
                                      overrides=dict(dx_heads=8, **NARROW))
    for calls, name in ((fwd, "chunk_scan_group"), (bwd, "bwd_chunk_dx_group")):
        call = next(c for c in calls if variants.kernel_name(c) == name)
        fn = call.kernel._annotated_function.pyfunc
        assert fn.__annotations__["x"] is ct.IndexedWithInt64
        assert len(cpu_compile.compile_cubin(call, "sm_90")) > 0


@pytest.mark.parametrize("dtype_name, problem, over, fix, max_stack", [
    ("bfloat16", dict(chunk_size=64), dict(scan_block_p=64, state_segments=4), True, 0),
    ("bfloat16", dict(chunk_size=64), dict(scan_block_p=64, state_segments=8,
                                           walk_occupancy=2), False, 8),
    ("bfloat16", dict(chunk_size=128), dict(scan_block_p=32), False, None),
    ("float32", dict(chunk_size=64), dict(scan_block_p=32), False, None),
    ("bfloat16", dict(chunk_size=64, int64=True), dict(scan_block_p=32), False, None),
    ("bfloat16", dict(chunk_size=64), dict(scan_block_p=64, state_segments=8,
                                           walk_occupancy=2, walk_carry=1), True, 8),
    ("bfloat16", dict(chunk_size=64), dict(scan_block_p=64, state_segments=8,
                                           walk_occupancy=2, walk_carry=1, state_block_p=64,
                                           state_block_n=128, state_occupancy=2), False, 8),
], ids=["bf16-q64-p64-seg4", "bf16-q64-p64-seg8-occ2", "bf16-q128-p32", "fp32-q64-p32",
        "bf16-q64-p32-int64", "bf16-q64-p64-seg8-occ2-carry", "bf16-q64-p64-seg8-rule-runs"])
def test_scan_walk_compiles(dtype_name, problem, over, fix, max_stack):
    """scan_walk: chunk_scan_walk (and its fix-up launch) compiles for sm_90 at the seed
    problem with every option but seq_idx; bf16 at chunk 64 with the whole 64-channel head a
    program holds its state without spills (sm_90, 168 registers, 384 threads; under the
    rule's two-per-SM hint, `walk_occupancy=2`, 128 registers at 256 threads, two CTAs an
    SM, with 8 B of stack; with `walk_carry` in 8 runs, the entering states formed in the
    walk, 8 B; the rule's runs form, `walk_config`: the state pass over whole states two an
    SM without stack, 128 registers, 115 KB)."""
    import cuda.tile as ct
    import torch

    calls = plans.forward_problem_plan(
        dtype=getattr(torch, dtype_name), options=("D_chan", "z", "dt_bias", "softplus", "init"),
        overrides=dict(scan_walk=1, **over), **problem)
    names = [variants.kernel_name(c) for c in calls]
    segs = over.get("state_segments", 1)
    carry = over.get("walk_carry", 0) and segs > 1
    assert names == (["decay_cumsum"] + ["chunk_state_pass"] * (segs > 1)
                     + ["chunk_state_carry"] * (segs > 1 and not carry)
                     + ["chunk_scan_walk"] * 2)
    walk = calls[-2]
    if problem.get("int64"):
        fn = walk.kernel._annotated_function.pyfunc
        assert fn.__annotations__["x"] is ct.IndexedWithInt64
    if max_stack is not None:
        res = resources.compile_resources(walk)
        assert res["stack"] <= max_stack, res
        assert res["ctas_per_sm"] >= max(1, over.get("walk_occupancy", 0)), res
        if segs > 1 and over.get("state_occupancy", 0) == 2:
            # the runs' state pass: no spills, two CTAs an SM (sm_90: 128 registers at 256
            # threads, 115 KB of shared memory)
            state = calls[names.index("chunk_state_pass")]
            res = resources.compile_resources(state)
            assert res["stack"] == 0 and res["ctas_per_sm"] >= 2, res
    else:
        assert len(cpu_compile.compile_cubin(walk, "sm_90")) > 0
    if fix:
        assert len(cpu_compile.compile_cubin(calls[-1], "sm_90")) > 0


def test_short_walk_compiles():
    """The shape rule's short walk (`forward.short_walk`, B=1 T=512 H=24 at chunk 256): two
    launches, the walk in 16-channel programs with its causal fix-up inside (FIX_INLINE),
    one CTA an SM at sm_90 with at most 48 B of stack with every option but seq_idx (168
    registers at 384 threads; 32 B with D alone)."""
    import torch

    calls = plans.forward_problem_plan(dtype=torch.bfloat16, chunk_size=256, batch=1,
                                       seqlen=512, nheads=24,
                                       options=("D_chan", "z", "dt_bias", "softplus", "init"))
    assert [variants.kernel_name(c) for c in calls] == ["decay_cumsum", "chunk_scan_walk"]
    walk = calls[-1]
    assert (variants.kernel_arg(walk, "BLOCK_P"), variants.kernel_arg(walk, "FIX_INLINE"),
            variants.kernel_arg(walk, "FLAG"), variants.kernel_arg(walk, "Q")) == (
        16, True, True, 64)
    res = resources.compile_resources(walk)
    assert res["stack"] <= 48 and res["ctas_per_sm"] >= 1, res

