"""CPU: every forward and backward kernel variant the dispatchers pick compiles for sm_90 (and the
all-options variants for sm_100; the rest of sm_100 is marked slow).

Kernels are compiled from the same plans the GPU path launches, on `meta` tensors, so a compile
error shows here before any GPU time is spent. A launch whose machine code an earlier one
already decides (same kernel, hints, constants and array constraints; see
`support.variants.signature_key`) is compiled once: the backward's recompute launches are the
forward's kernels, and most variants share most kernels.
"""

import pytest

pytest.importorskip("cuda.tile")

from mamba2_cutile.bench import compile as cpu_compile  # noqa: E402
from mamba2_cutile.bench import plans  # noqa: E402
from support import variants  # noqa: E402

pytestmark = pytest.mark.compile

FAMILIES = ("forward", "backward")
CASES = [pytest.param(arch, fam, name, i, id=f"{arch}-{tid}",
                      marks=() if arch == "sm_90" or variants.SM100_DEFAULT[fam](name)
                      else (pytest.mark.slow,))
         for arch in ("sm_90", "sm_100")
         for tid, fam, name, i in variants.distinct_launches(FAMILIES, arch)]


@pytest.mark.parametrize("arch, family, name, index", CASES)
def test_launch_compiles(arch, family, name, index):
    assert cpu_compile.compile_call(variants.launch_of(family, name, index), arch) > 0


def test_plans_have_their_launches():
    """Each forward plan holds the 3 forward launches (with scan_causal=1 a fourth, chunk_scan's
    flagged-tile pass), each backward plan the 6 backward ones (2 recompute + 4 backward
    kernels)."""
    for name, problem in variants.forward_variants():
        calls = plans.forward_problem_plan(**problem)
        assert [variants.kernel_name(c) for c in calls] == [
            "decay_cumsum", "chunk_state_pass", "chunk_scan"], name
        assert calls[2].args[-1] == 0, name
        causal = plans.forward_problem_plan(
            **dict(problem, overrides=dict(problem.get("overrides") or {}, scan_causal=1)))
        assert [variants.kernel_name(c) for c in causal[2:]] == ["chunk_scan", "chunk_scan"]
        assert causal[2].args[-1] == 1 and causal[3].args[-1] == 2, name
    for name, problem in variants.backward_variants():
        assert len(plans.backward_problem_plan(**problem)) == 6, name


@pytest.mark.parametrize("chunk_size", [64, pytest.param(256, marks=pytest.mark.slow)])
def test_causal_scan_compiles(chunk_size):
    """scan_causal=1's two chunk_scan launches (the counting one and the flagged-tile pass),
    all options, for sm_90."""
    calls = plans.forward_problem_plan(chunk_size=chunk_size, overrides={"scan_causal": 1})
    for call in calls[2:]:
        assert len(cpu_compile.compile_cubin(call, "sm_90")) > 0


#: dx_cb=1 (chunk_cb, then bwd_chunk_dx reading its S blocks): backward variants (by name in
#: support.variants.backward_variants) with dx_cb=1 and these further overrides; the second
#: field marks the less common ones slow. The two occupancy-2 tilings are the dx_cb=1 choices
#: a CPU compile shows at 2 CTAs per SM (the default tiles: 1).
DX_CB_VARIANTS = [
    ("bfloat16-Q256-all", {}, False),
    ("float16-Q64-all", {}, True),
    ("float32-Q128-all", {}, True),
    ("bf16-h2-p256-n256", {}, True),
    ("bf16-int64", {}, True),
    ("bf16-split-da-latency", {}, True),
    ("bfloat16-Q256-all", dict(dx_block_q=32, dx_occupancy=2), True),
    ("bfloat16-Q256-all", dict(dx_block_p=32, dx_occupancy=2), True),
    ("bfloat16-Q64-all", {}, True),
    ("bfloat16-Q128-all", {}, True),
    ("float16-Q256-all", {}, True),
    ("float32-Q256-all", {}, True),
    ("bf16-h8-g2-p80-n96", {}, True),
    ("bf16-no-options", {}, True),
    ("bf16-lowp", {}, True),
    ("bf16-unfused-stable-da", {}, True),
    ("bf16-Q256-internal-256", {}, True),
    ("bfloat16-Q256-all", dict(dx_block_q=128), True),
]
DX_CB_KERNELS = ("chunk_cb", "bwd_chunk_dx")


def _dx_cb_plan(name, over):
    problem = dict(variants.backward_variants())[name]
    return plans.backward_problem_plan(**{**problem, "overrides": {
        **problem.get("overrides", {}), **over, "dx_cb": 1}})


def _dx_cb_cases(arch):
    """The distinct chunk_cb / bwd_chunk_dx launches of DX_CB_VARIANTS (signature_key)."""
    seen, out = set(), []
    for name, over, slow in DX_CB_VARIANTS:
        for i, call in enumerate(_dx_cb_plan(name, over)):
            kernel = variants.kernel_name(call)
            key = variants.signature_key(call, arch)
            if kernel not in DX_CB_KERNELS or key in seen:
                continue
            seen.add(key)
            tid = "-".join([arch, name] + [f"{k}{v}" for k, v in over.items()] + [kernel])
            marks = (pytest.mark.slow,) if slow or arch != "sm_90" else ()
            out.append(pytest.param(arch, name, over, i, id=tid, marks=marks))
    return out


@pytest.mark.parametrize("arch, name, over, index",
                         _dx_cb_cases("sm_90") + _dx_cb_cases("sm_100"))
def test_dx_cb_launch_compiles(arch, name, over, index):
    """Every chunk_cb and dx_cb=1 bwd_chunk_dx variant compiles; for sm_90 its registers,
    spills and shared memory are printed (pyelftools), and the occupancy-2 tilings must give
    2 CTAs per SM."""
    call = _dx_cb_plan(name, over)[index]
    cubin = cpu_compile.compile_cubin(call, arch)
    assert len(cubin) > 0
    if arch != "sm_90":
        return
    try:
        from mamba2_cutile.bench.resources import resources
    except ImportError:        # pyelftools (the dev extra) is optional
        pytest.skip("compiled; registers and spills not read: pyelftools (the dev extra) missing")
    res = resources(cubin)
    print(variants.kernel_name(call), res)
    if over.get("dx_occupancy") == 2 and variants.kernel_name(call) == "bwd_chunk_dx":
        # at most a few spilled registers (8 B per thread measured at 32-token blocks with
        # every option on, none without z and seq_idx)
        assert res["ctas_per_sm"] >= 2 and res["stack"] <= 64, res


def test_dx_cb_plans_have_their_launches():
    """dx_cb=1 adds chunk_cb right before bwd_chunk_dx: 7 launches."""
    for name, over, _ in DX_CB_VARIANTS:
        names = [variants.kernel_name(c) for c in _dx_cb_plan(name, over)]
        assert len(names) == 7 and names[names.index("chunk_cb") + 1] == "bwd_chunk_dx", name


#: bc_head_split > 1 (the fused dB/dC launch over several programs per group, fp32 partial
#: outputs): (problem for plans.backward_problem_plan, config overrides, slow). The first two
#: are the seed problem's sweep candidates (B=2 T=4096 H=80 G=1, chunk 256 computed at 128).
SEED = dict(batch=2, seqlen=4096, nheads=80, ngroups=1, headdim=64, dstate=128, chunk_size=256,
            options=())
HEAD_SPLIT_VARIANTS = [
    (SEED, dict(bc_head_split=2, bc_occupancy=2), False),
    (SEED, dict(bc_head_split=4, bc_occupancy=2), False),
    (dict(), dict(bc_head_split=4, da_mode=2, bc_block_n=32), False),
    (dict(int64=True), dict(bc_head_split=2), True),
    (dict(dtype=__import__("torch").float32), dict(bc_head_split=2), True),
]


def _head_split_call(problem, over):
    calls = plans.backward_problem_plan(**problem, overrides=over)
    (call,) = [c for c in calls if variants.kernel_name(c) == "bwd_chunk_dbc_fused"]
    return call


@pytest.mark.parametrize("problem, over", [
    pytest.param(p, o, id="-".join(f"{k}{v}" for k, v in {**p, **o}.items()
                                   if k not in ("options",)) or "default",
                 marks=(pytest.mark.slow,) if slow else ())
    for p, o, slow in HEAD_SPLIT_VARIANTS])
def test_head_split_launch_compiles(problem, over):
    """The split dB/dC variants compile for sm_90; registers, spills, shared memory and CTAs
    per SM are printed (pyelftools)."""
    call = _head_split_call(problem, over)
    assert call.grid[2] == over["bc_head_split"]
    cubin = cpu_compile.compile_cubin(call, "sm_90")
    assert len(cubin) > 0
    try:
        from mamba2_cutile.bench.resources import resources
    except ImportError:        # pyelftools (the dev extra) is optional
        pytest.skip("compiled; registers and spills not read: pyelftools (the dev extra) missing")
    print(over, resources(cubin))


#: dx_head_block > 1 (bwd_chunk_dx_heads, several heads of a group per dx program): (problem,
#: config overrides, slow). The first ones are the sweep's candidates at the seed problem and at
#: B=8 T=2048 H=128 G=8 (head and group counts do not change the machine code, only HEAD_BLOCK
#: does: the head loops are run-time loops, heads per group come from the shapes); then every
#: option, the stable da form, input-dtype operands, 64-bit, fp32, fp16, chunk 256 computed at
#: 256.
SEED8 = dict(batch=8, seqlen=2048, nheads=128, ngroups=8, headdim=64, dstate=128, chunk_size=256,
             options=())
DX_HEADS_VARIANTS = [
    (SEED, dict(dx_head_block=4), False),
    (SEED, dict(dx_head_block=8, dx_occupancy=1, dx_warps=8), True),
    (SEED8, dict(dx_head_block=8, dx_block_q=32), True),
    (dict(), dict(dx_head_block=4, da_mode=0), True),
    (SEED, dict(dx_head_block=8, dx_block_p=64, dx_occupancy=1, dx_warps=8), True),
    (SEED, dict(dx_head_block=8, dx_block_q=32, dx_block_p=64), True),
    (SEED, dict(dx_head_block=8, dx_lowp=1), True),
    (dict(), dict(dx_head_block=2, dx_block_q=32, dx_occupancy=1, dx_warps=8), True),
    (dict(int64=True), dict(dx_head_block=4), True),
    (dict(dtype=__import__("torch").float32), dict(dx_head_block=4), True),
    (dict(dtype=__import__("torch").float16), dict(dx_head_block=4), True),
    (dict(chunk_size=256), dict(dx_head_block=4, chunk_size=256), True),
]


def _dx_heads_call(problem, over):
    calls = plans.backward_problem_plan(**problem, overrides=over)
    (call,) = [c for c in calls if variants.kernel_name(c) == "bwd_chunk_dx_heads"]
    return call


@pytest.mark.parametrize("problem, over", [
    pytest.param(p, o, id="-".join(f"{k}{v}" for k, v in {**p, **o}.items()
                                   if k not in ("options",)) or "default",
                 marks=(pytest.mark.slow,) if slow else ())
    for p, o, slow in DX_HEADS_VARIANTS])
def test_dx_head_block_launch_compiles(problem, over):
    """The multi-head dx variants compile for sm_90; registers, spills, shared memory and CTAs
    per SM are printed (pyelftools). At occupancy 1 with 8 warps the seed problem's has no
    spills (measured: 168 registers, 0 bytes of stack, 1 CTA per SM)."""
    call = _dx_heads_call(problem, over)
    fn = call.kernel._annotated_function.pyfunc
    args = dict(zip(fn.__code__.co_varnames[:fn.__code__.co_argcount], call.args))
    b, l, h, _ = args["x"].shape
    assert args["HEAD_BLOCK"] == over["dx_head_block"]
    assert call.grid[0] * args["HEAD_BLOCK"] == -(-l // args["BLOCK_Q"]) * b * h
    cubin = cpu_compile.compile_cubin(call, "sm_90")
    assert len(cubin) > 0
    try:
        from mamba2_cutile.bench.resources import resources
    except ImportError:        # pyelftools (the dev extra) is optional
        pytest.skip("compiled; registers and spills not read: pyelftools (the dev extra) missing")
    res = resources(cubin)
    print(over, res)
    if problem is SEED and over.get("dx_occupancy") == 1 and over.get("dx_warps") == 8 \
            and "dx_block_p" not in over:
        assert res["stack"] == 0, res
