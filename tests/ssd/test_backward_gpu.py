"""GPU: the cuTile backward (`backward.ssd_backward_cuda`) against float64 references.

Running the GPU suite (forward, backward, decode) on one machine with several workers:

    python -m pytest -n 8 --dist loadgroup -m gpu tests

`--dist loadgroup` keeps each mamba_ssm comparison family on one worker (tests/conftest.py's
`_xdist_group`: "mamba-bwd" for this file's test_against_mamba_ssm_* tests, "mamba-fwd" for the
forward's). Those comparison tests carry mamba_ssm's Triton autotune, about a minute per
backward kernel shape on an H200, paid once per process thanks to the group. They skip, with
the reason, when mamba_ssm is not importable, when MAMBA2_TEST_COMPARE_MAMBA=0, or when
mamba_ssm refuses an option combination; the float64-reference tests never depend on mamba_ssm.
MAMBA2_TEST_LOG=path appends every check's measured errors to that file.

References: `chunked_backward.ssd_chunked_backward` in float64 on the GPU, from the same
(rounded) inputs, and torch.autograd through `reference.ssd_recurrence` in float64 on a subset.
Tolerance per gradient: support.tolerances.grad_tol (max|grad - ref| / max|ref|; by input dtype
bf16 2e-2, fp16 2e-3, fp32 2e-3, with per-gradient exceptions). The test_against_mamba_ssm_*
tests: never above 1.5x the error of mamba_ssm's gradients (autograd through its
`mamba_chunk_scan_combined`) on the same inputs, plus tol / 10. Plus determinism (equal bits
across runs), CUDA-graph capture, configs, 64-bit indexing, edge shapes and a training step
under torch.compile.
"""

import math
from dataclasses import replace

import pytest
import torch

from mamba2_cutile import reference
from mamba2_cutile.ssd import backward
from mamba2_cutile.reference import ssd_chunked_backward
from mamba2_cutile.runtime import num_sms
from mamba2_cutile.bench.problems import random_problem
from support.gpu import SHAPES as GPU_SHAPES
from support.gpu import log_result, mamba_refused, rel_err, require_mamba_ssm_scan
from support.tolerances import (FLOAT64_SELF_TOL, MAMBA_FACTOR, SAME_MATH_TOL,
                                comparison_floor, grad_tol)

pytestmark = pytest.mark.gpu

NAMES = backward.NAMES
F64 = torch.float64
DEV = "cuda"


def make_problem(b, l, h, g, p, n, dtype, opts, seed=0, Q=128):
    """Realistic random inputs (bench.problems.random_problem), every option key present in
    kw (None when off), and the cotangents dout, dfinal drawn from the same generator."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    # seq_idx resets: at token 1, inside chunks, exactly on a chunk boundary, one past one
    cuts = (1, l // 5, l // 5 + 1, Q, Q + 1, l // 2, (3 * l) // 4)
    inp, kw = random_problem(b, l, h, g, p, n, dtype, D=opts.get("D"), z=bool(opts.get("z")),
                             dt_bias=bool(opts.get("dt_bias")), dt_limit=opts.get("dt_limit"),
                             init=bool(opts.get("init")),
                             seq_cuts=cuts if opts.get("seq_idx") else None, device=DEV,
                             gen=gen)
    kw = {**dict(D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                 dt_softplus=False, dt_limit=(0.0, math.inf)), **kw}
    dout = torch.randn(b, l, h, p, generator=gen, device=DEV).to(dtype)
    dfinal = torch.randn(b, h, p, n, generator=gen, device=DEV) if opts.get("dfinal", True) \
        else None
    return inp, kw, dout, dfinal


def ours(inp, kw, Q, dout, dfinal, **extra):
    return backward.ssd_backward_cuda(**inp, chunk_size=Q, dout=dout, dfinal_states=dfinal, **kw,
                                      **extra)


def chunked_ref(inp, kw, Q, dout, dfinal):
    d = lambda t: None if t is None else (t.double() if t.is_floating_point() else t)  # noqa
    return ssd_chunked_backward(**{k: d(v) for k, v in inp.items()}, chunk_size=Q,
                                dout=d(dout), dfinal_states=d(dfinal),
                                **{k: d(v) if isinstance(v, torch.Tensor) else v
                                   for k, v in kw.items()}, dtype=F64)


def autograd_grads(fn, inp, kw, dout, dfinal, **extra):
    """Gradients of fn's (out, final) by autograd, float64 leaves made from the inputs."""
    leaves = {k: v.double().requires_grad_(True) for k, v in inp.items()}
    kwl = {}
    for k, v in kw.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            kwl[k] = v.double().requires_grad_(True)
        else:
            kwl[k] = v
    y, h = fn(leaves, kwl, **extra)
    outs, cots = [y], [dout.to(y.dtype)]
    if dfinal is not None:
        outs.append(h)
        cots.append(dfinal.to(h.dtype))
    tensors = {**leaves, **{k: v for k, v in kwl.items()
                            if isinstance(v, torch.Tensor) and v.requires_grad}}
    names = [k for k in NAMES if k in tensors]
    got = torch.autograd.grad(outs, [tensors[k] for k in names], cots, allow_unused=True)
    res = dict.fromkeys(NAMES)
    for k, gr in zip(names, got):
        res[k] = torch.zeros_like(tensors[k]) if gr is None else gr
    return res


def recurrence_fn(leaves, kw):
    y, h, _ = reference.ssd_recurrence(**leaves, **kw, dtype=F64)
    return y, h


def mamba_grads(f, inp, kw, Q, dout, dfinal):
    """mamba_ssm's gradients (f: its mamba_chunk_scan_combined) for the same inputs; skips the
    running test if mamba_ssm refuses them."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}
    kwl = {k: (v.detach().clone().requires_grad_(True)
               if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in kw.items()}
    try:
        y, h = f(**leaves, chunk_size=Q, return_final_states=True, **kwl)
        outs, cots = [y], [dout]
        if dfinal is not None:
            outs.append(h)
            cots.append(dfinal.to(h.dtype))
        tensors = {**leaves, **{k: v for k, v in kwl.items()
                                if isinstance(v, torch.Tensor) and v.requires_grad}}
        names = [k for k in NAMES if k in tensors]
        got = torch.autograd.grad(outs, [tensors[k] for k in names], cots, allow_unused=True)
    except Exception as e:  # noqa: BLE001 - an unsupported option combination in mamba_ssm
        log_result(f"mamba_ssm refused: {type(e).__name__}: {str(e)[:120]}")
        mamba_refused(e)
    res = dict.fromkeys(NAMES)
    for k, gr in zip(names, got):
        res[k] = torch.zeros_like(tensors[k]) if gr is None else gr
    return res


def check_grads(got, inp, kw):
    """Every gradient present exactly when its input is, in the input's shape and dtype,
    finite."""
    for k in NAMES:
        src = inp.get(k, kw.get(k))
        if src is None or not src.is_floating_point():
            assert got[k] is None, f"d{k} should be None"
            continue
        assert got[k] is not None, f"d{k} missing"
        assert got[k].shape == src.shape and got[k].dtype == src.dtype, \
            f"d{k}: {got[k].shape} {got[k].dtype} vs input {src.shape} {src.dtype}"
        assert torch.isfinite(got[k]).all(), f"d{k} has non-finite entries"


def check(inp, kw, Q, dout, dfinal, dtype, with_autograd=False, **extra):
    """Ours against the float64 chunked backward (and float64 autograd through the recurrence
    when with_autograd): every gradient within grad_tol(name, dtype, its dtype)."""
    got = ours(inp, kw, Q, dout, dfinal, **extra)
    ref = chunked_ref(inp, kw, Q, dout, dfinal)
    msgs, failures = [], []
    for k in NAMES:
        src = inp.get(k, kw.get(k))
        if ref[k] is None:
            assert got[k] is None, f"d{k} should be None"
            continue
        assert got[k] is not None, f"d{k} missing"
        assert got[k].shape == src.shape and got[k].dtype == src.dtype, \
            f"d{k}: {got[k].shape} {got[k].dtype} vs input {src.shape} {src.dtype}"
        assert torch.isfinite(got[k]).all(), f"d{k} has non-finite entries"
        tol = grad_tol(k, dtype, src.dtype)
        e = rel_err(got[k], ref[k])
        msgs.append(f"d{k} {e:.2e}")
        if not e <= tol:
            failures.append(f"d{k}: {e:.2e} > tol {tol:.0e}")
    if with_autograd:
        ag = autograd_grads(recurrence_fn, inp, kw, dout, dfinal)
        self_errs = []
        for k in NAMES:
            if ref[k] is not None:
                # the explicit formulas themselves against autograd (float64: tight)
                e_ref = rel_err(ref[k], ag[k])
                self_errs.append(f"d{k} {e_ref:.1e}")
                assert e_ref <= FLOAT64_SELF_TOL, \
                    f"chunked_backward d{k} vs autograd: {e_ref:.2e}"
                tol = grad_tol(k, dtype, inp.get(k, kw.get(k)).dtype)
                e = rel_err(got[k], ag[k])
                msgs.append(f"d{k} vs autograd {e:.2e}")
                if not e <= tol:
                    failures.append(f"d{k} vs autograd: {e:.2e} > tol {tol:.0e}")
        msgs.append("float64 chunked vs autograd: " + " ".join(self_errs))
    line = ", ".join(msgs)
    print(line)
    log_result(line)
    assert not failures, "; ".join(failures) + " | " + line
    return got


def compare_with_mamba(inp, kw, Q, dout, dfinal, dtype):
    """Ours and mamba_ssm's gradient errors against the float64 chunked backward on the same
    inputs: ours at most 1.5x mamba_ssm's plus grad_tol / 10, per gradient (skips when
    mamba_ssm is absent, switched off or refuses these inputs)."""
    f = require_mamba_ssm_scan()
    got = ours(inp, kw, Q, dout, dfinal)
    check_grads(got, inp, kw)
    ref = chunked_ref(inp, kw, Q, dout, dfinal)
    m = mamba_grads(f, inp, kw, Q, dout, dfinal)
    msgs, failures = [], []
    for k in NAMES:
        if ref[k] is None:
            continue
        assert m[k] is not None, f"mamba_ssm gave no d{k}"
        floor = comparison_floor(grad_tol(k, dtype, inp.get(k, kw.get(k)).dtype))
        e, em = rel_err(got[k], ref[k]), rel_err(m[k], ref[k])
        msgs.append(f"d{k} {e:.2e} (mamba_ssm {em:.2e})")
        if not e <= MAMBA_FACTOR * em + floor:
            failures.append(f"d{k}: {e:.2e} > 1.5 x mamba_ssm's {em:.2e} + {floor:.0e}")
    line = ", ".join(msgs)
    print(line)
    log_result(line)
    assert msgs, "no gradient compared"
    assert not failures, "; ".join(failures) + " | " + line


OPTS = {
    "none": {},
    "D_head": {"D": "h"},
    "D_chan": {"D": "hp"},
    "z": {"z": True},
    "bias_softplus": {"dt_bias": True},
    "dt_limit": {"dt_limit": (0.004, 0.05)},
    "init": {"init": True},
    "seq_idx": {"seq_idx": True},
    "no_dfinal": {"init": True, "dfinal": False},
    "all": {"D": "hp", "z": True, "dt_bias": True, "dt_limit": (0.002, 0.08), "init": True,
            "seq_idx": True},
}


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_options(opt, dtype):
    inp, kw, dout, dfinal = make_problem(2, 300, 4, 2, 64, 64, dtype, OPTS[opt])
    check(inp, kw, 128, dout, dfinal, dtype)


@pytest.mark.parametrize("opt", list(OPTS))
def test_against_mamba_ssm_backward(opt):
    """test_options' bf16 problems, chunk 128: ours vs mamba_ssm's gradient errors."""
    inp, kw, dout, dfinal = make_problem(2, 300, 4, 2, 64, 64, torch.bfloat16, OPTS[opt])
    compare_with_mamba(inp, kw, 128, dout, dfinal, torch.bfloat16)


def test_against_mamba_ssm_backward_chunk256():
    """More heads, chunk 256, every option: ours vs mamba_ssm's gradient errors."""
    inp, kw, dout, dfinal = make_problem(2, 700, 16, 2, 64, 128, torch.bfloat16, OPTS["all"],
                                         seed=4, Q=256)
    compare_with_mamba(inp, kw, 256, dout, dfinal, torch.bfloat16)


def test_dt_limit_clamps():
    """The dt_limit cases clamp a good share of dt' at both ends (so the mask is exercised)."""
    for lim in ((0.004, 0.05), (0.002, 0.08)):
        inp, _, _, _ = make_problem(2, 300, 4, 2, 64, 64, torch.bfloat16, {"dt_limit": lim})
        w = inp["dt"]
        assert (w < lim[0]).float().mean() > 0.03 and (w > lim[1]).float().mean() > 0.03


def test_default_limit_clamps_negative_dt():
    """The default dt_limit (0, inf) clamps as mamba_ssm's Triton scan: with about a third of
    dt negative (no softplus) the gradients match the float64 chunked backward, whose ddt is
    0 at those tokens."""
    inp, kw, dout, dfinal = make_problem(2, 300, 8, 2, 64, 64, torch.bfloat16,
                                         {"D": "h", "init": True}, seed=9)
    inp["dt"] = inp["dt"] - inp["dt"].float().quantile(0.33)
    neg = inp["dt"] < 0
    assert neg.float().mean() > 0.25
    check(inp, kw, 64, dout, dfinal, torch.bfloat16)
    assert (ours(inp, kw, 64, dout, dfinal)["dt"][neg] == 0).all()


@pytest.mark.parametrize("opt", ["none", "all", "no_dfinal"])
def test_against_recurrence_autograd(opt):
    inp, kw, dout, dfinal = make_problem(2, 200, 4, 2, 32, 48, torch.float32, OPTS[opt], Q=64)
    check(inp, kw, 64, dout, dfinal, torch.float32, with_autograd=True)


SHAPES = GPU_SHAPES + [(1, 300, 2, 1, 256, 256)]   # (b, l, h, g, p, n)


@pytest.mark.parametrize("chunk_size", [64, 128, 256])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(shape, chunk_size):
    inp, kw, dout, dfinal = make_problem(*shape, torch.bfloat16, OPTS["all"], seed=1,
                                         Q=chunk_size)
    check(inp, kw, chunk_size, dout, dfinal, torch.bfloat16)


#: training-like head counts: (b, l, h, g, p, n), 64+ heads, 1 and 8 groups, lengths that are not
#: chunk multiples
MANY_HEADS = [(1, 1000, 80, 1, 64, 128), (2, 600, 128, 8, 64, 128), (1, 777, 64, 8, 64, 128)]


@pytest.mark.parametrize("chunk_size", [128, 256])
@pytest.mark.parametrize("shape", MANY_HEADS, ids=lambda s: "x".join(map(str, s)))
def test_many_heads(shape, chunk_size):
    """Chunk 256 (computed at an internal chunk of 128, backward.BackwardConfig) and 128 at the
    head and group counts of real models, all options on."""
    inp, kw, dout, dfinal = make_problem(*shape, torch.bfloat16, OPTS["all"], seed=3,
                                         Q=chunk_size)
    check(inp, kw, chunk_size, dout, dfinal, torch.bfloat16)


#: the dispatcher's wide-program tiles (dstate 129-256: 32 x 256 bwd_state_pass tiles; headdim
#: 65-128 or dstate 129-256: the dS launch in 64-token blocks at two per SM) on sequences long
#: enough for the dS launch (more than 8 fused dB/dC programs), neither
#: dstate nor headdim a multiple of the tiles
WIDE = [(1, 1500, 24, 1, 64, 200), (1, 3000, 6, 2, 100, 64)]


@pytest.mark.parametrize("chunk_size", [128, 256])
@pytest.mark.parametrize("shape", WIDE, ids=lambda s: "x".join(map(str, s)))
def test_wide_program_tiles(shape, chunk_size):
    from mamba2_cutile.ssd import backward

    b, l, h, g, p, n = shape
    cfg = backward.backward_config(b, h, g, p, n, chunk_size, torch.bfloat16, 132, seqlen=l)
    assert (cfg.bc_fused, cfg.bc_block_q, cfg.dcb_occupancy) == (2, 64, 2)
    assert (cfg.bstate_block_p, cfg.bstate_block_n) == ((32, 256) if n > 128 else (64, 64))
    inp, kw, dout, dfinal = make_problem(*shape, torch.bfloat16, OPTS["all"], seed=4,
                                         Q=chunk_size)
    check(inp, kw, chunk_size, dout, dfinal, torch.bfloat16)


@pytest.mark.parametrize("chunk_size", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dtypes_and_chunks_all_options(dtype, chunk_size):
    inp, kw, dout, dfinal = make_problem(2, 333, 6, 3, 80, 96, dtype, OPTS["all"], seed=2,
                                         Q=chunk_size)
    check(inp, kw, chunk_size, dout, dfinal, dtype)


@pytest.mark.parametrize("l", [1, 17, 64, 65, 255, 256, 257])
def test_short_and_partial(l):
    inp, kw, dout, dfinal = make_problem(2, l, 4, 1, 32, 64, torch.bfloat16,
                                         {"D": "h", "init": True, "seq_idx": l > 2}, Q=256)
    check(inp, kw, 256, dout, dfinal, torch.bfloat16)


def test_state_dtype_bf16():
    inp, kw, dout, dfinal = make_problem(2, 700, 4, 1, 64, 128, torch.bfloat16, OPTS["all"])
    check(inp, kw, 256, dout, dfinal, torch.bfloat16, state_dtype=torch.bfloat16)


def test_deterministic():
    inp, kw, dout, dfinal = make_problem(2, 700, 8, 2, 64, 128, torch.bfloat16, OPTS["all"])
    a = ours(inp, kw, 256, dout, dfinal)
    b = ours(inp, kw, 256, dout, dfinal)
    for k in NAMES:
        if a[k] is not None:
            assert torch.equal(a[k], b[k]), f"d{k} differs between two runs"


@pytest.mark.parametrize("side", ["", "side_streams=1", "side_streams=2"],
                         ids=["one-stream", "side-streams", "side-stream-reverse-pass"])
def test_cuda_graph_capture(side, monkeypatch):
    """A captured backward replays on new inputs as a fresh call computes them; with side
    streams the capture holds their fork and join (launch_calls joins them to the capture's
    stream), and the eager call equals the one-stream call bit for bit."""
    inp, kw, dout, dfinal = make_problem(2, 500, 4, 1, 64, 128, torch.bfloat16, OPTS["all"])
    if side:
        one = ours(inp, kw, 128, dout, dfinal)
        monkeypatch.setenv("MAMBA2_CUTILE_BWD_CONFIG", side)
        two = ours(inp, kw, 128, dout, dfinal)
        for k in NAMES:
            if one[k] is not None:
                assert torch.equal(one[k], two[k]), f"d{k} differs with side streams"
    eager = ours(inp, kw, 128, dout, dfinal)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            ours(inp, kw, 128, dout, dfinal)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ours(inp, kw, 128, dout, dfinal)
    dout.mul_(0.5)
    inp["x"].mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    again = ours(inp, kw, 128, dout, dfinal)
    for k in NAMES:
        if captured[k] is not None:
            torch.testing.assert_close(captured[k], again[k], rtol=0, atol=0)
    assert not torch.equal(captured["x"], eager["x"])


CONFIGS = [
    {"lowp": 0, "dx_warps": 8, "bc_load_latency": 0, "bstate_load_latency": 0},
    {"dx_lowp": 1},
    {"dx_warps": 0, "bc_warps": 0}, {"dx_warps": 4, "bc_warps": 4},
    {"dx_block_q": 32, "bc_block_q": 128}, {"dx_block_q": 128, "bc_block_q": 32},
    {"dx_block_p": 16, "bc_block_p": 32, "bc_block_n": 32},
    {"bc_block_n": 128}, {"bstate_block_p": 32, "bstate_block_n": 16},
    {"dx_occupancy": 2, "bc_occupancy": 2, "bstate_occupancy": 2},
    {"bc_fused": 0, "da_mode": 0}, {"bc_fused": 0, "da_mode": 1, "lowp": 1},
    {"da_mode": 2, "bc_fused": 1, "bc_block_n": 32},
    {"da_mode": 2, "bc_fused": 1, "dx_warps": 4, "dx_block_q": 128},
    {"cumsum_block_h": 2},
    {"bstate_load_latency": 4, "dx_load_latency": 4, "bc_load_latency": 4},
    {"bstate_segments": 2}, {"bstate_segments": 3, "state_segments": 3, "state_occupancy": 4},
    {"side_streams": 1}, {"side_streams": 1, "bstate_segments": 2, "state_segments": 2},
    {"side_streams": 1, "bc_fused": 1, "da_mode": 1},
    {"side_streams": 2}, {"side_streams": 2, "bstate_segments": 2},
    {"bc_head_split": 2, "bc_fused": 1, "da_mode": 1},
    {"bc_head_split": 2, "bc_fused": 1, "da_mode": 2},
    {"bc_fused": 1, "da_mode": 1, "bc_block_q": 64, "dcb_occupancy": 0, "bc_occupancy": 0,
     "bc_warps": 8},
    {"bc_fused": 2, "da_mode": 1}, {"bc_fused": 2, "da_mode": 1, "bc_block_q": 32,
                                     "dcb_occupancy": 4},
    {"bc_fused": 2, "da_mode": 1, "bc_block_q": 128, "bc_block_n": 32, "bc_occupancy": 2,
     "bc_warps": 4, "lowp": 0},
    {"bc_fused": 2, "da_mode": 3}, {"bc_fused": 2, "da_mode": 3, "bc_block_q": 128},
    {"bc_fused": 2, "da_mode": 3, "dcb_head_split": 2},
    {"bc_fused": 2, "da_mode": 1, "dcb_head_split": 2, "bc_block_q": 32},
]


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: ",".join(
    f"{k}={v}" for k, v in o.items()))
def test_config_variants(overrides):
    """Every config field a tuner may change gives a correct answer (all options on)."""
    b, l, h, g, p, n, Q = 2, 700, 4, 2, 64, 128, 256
    dtype = torch.bfloat16
    inp, kw, dout, dfinal = make_problem(b, l, h, g, p, n, dtype, OPTS["all"], seed=3, Q=Q)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, dtype), **overrides)
    check(inp, kw, Q, dout, dfinal, dtype, config=cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("opt", ["none", "D_head", "D_chan", "seq_idx", "no_dfinal"])
@pytest.mark.parametrize("Q, heads, g, block_q", [(256, 8, 1, 64), (128, 4, 2, 32),
                                                  (64, 2, 2, 64)])
def test_dx_heads(Q, heads, g, block_q, opt, dtype):
    """bwd_chunk_dx_group (dx_heads: B_t C^T of the chunk once per token block and group, the
    program walking `heads` heads) against the float64 backward and against bwd_chunk_dx at
    the same config (the same products; the sums in another order): headdim 80 and dstate
    96, a partial last chunk, chunk 256 computed at 128, 64 and 32-token blocks."""
    b, l, h, p, n = 2, 700, 8, 80, 96
    inp, kw, dout, dfinal = make_problem(b, l, h, g, p, n, dtype, OPTS[opt], seed=7, Q=Q)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, dtype), bc_fused=2, da_mode=3,
                  dx_block_q=block_q, dx_heads=heads)
    assert backward.dx_group_heads(cfg, h // g, False) == heads
    got = check(inp, kw, Q, dout, dfinal, dtype, config=cfg)
    one = ours(inp, kw, Q, dout, dfinal, config=replace(cfg, dx_heads=1))
    diffs = {k: rel_err(got[k], one[k]) for k in NAMES if got[k] is not None}
    log_result("against bwd_chunk_dx: " + ", ".join(f"d{k} {e:.2e}" for k, e in diffs.items()))
    # the same products, sums in another order: equal to the bit at five shapes in bf16 on an
    # H100 (benchmarks/results/2026-12-05-h100-backward-sweep-dx-heads.jsonl, dA within
    # 1e-6); at most one rounding of a 16-bit gradient apart
    for k, e in diffs.items():
        assert e <= (4e-3 if got[k].dtype in (torch.bfloat16, torch.float16) else 1e-5), (k, e)


DA3 = {"bc_fused": 2, "da_mode": 3, "bc_block_q": 32, "dcb_occupancy": 4, "bc_occupancy": 2,
       "bc_warps": 4}


@pytest.mark.parametrize("opt", ["none", "D_head", "z", "seq_idx", "no_dfinal", "all"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_da_from_the_dcb_launch(opt, dtype):
    """da_mode 3 (the decay gradient's W terms from bwd_chunk_dcb, bwd_chunk_dx without its
    key-block loop when there is no z) at the long-sequence tiles, 64 heads in 8 groups and a
    partial last chunk, against the float64 definitions."""
    b, l, h, g, p, n, Q = 1, 1000, 64, 8, 64, 128, 256
    inp, kw, dout, dfinal = make_problem(b, l, h, g, p, n, dtype, OPTS[opt], seed=5, Q=Q)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, dtype), **DA3)
    check(inp, kw, Q, dout, dfinal, dtype, config=cfg)


@pytest.mark.parametrize("opt", ["D_head", "seq_idx", "no_dfinal"])
def test_dispatcher_64_channel_dx(opt):
    """A sequence long enough for the dispatcher's long-sequence rule (da_mode 3, no z): one
    bwd_chunk_dx program over all 64 channels with 4 warps, chunk 256 computed at 128, a
    partial last chunk; against the float64 definitions (that the public path picks this
    config: test_backward_plan.py::test_dispatcher_dx_tiles_follow_z)."""
    b, l, h, g, p, n, Q = 2, 8000, 8, 1, 64, 128, 256
    cfg = backward.backward_config(b, h, g, p, n, Q, torch.bfloat16, num_sms(0), seqlen=l)
    assert (cfg.da_mode, cfg.dx_block_p, cfg.dx_warps) == (3, 64, 4)
    inp, kw, dout, dfinal = make_problem(b, l, h, g, p, n, torch.bfloat16, OPTS[opt], seed=9,
                                         Q=Q)
    check(inp, kw, Q, dout, dfinal, torch.bfloat16, config=cfg)


def test_more_than_65535_batch_heads():
    inp, kw, dout, dfinal = make_problem(600, 3, 128, 1, 4, 16, torch.bfloat16,
                                         {"D": "h", "init": True}, Q=64)
    check(inp, kw, 64, dout, dfinal, torch.bfloat16)


def test_tiny_headdim_and_dstate():
    inp, kw, dout, dfinal = make_problem(2, 130, 4, 2, 1, 1, torch.bfloat16, OPTS["all"], Q=64)
    check(inp, kw, 64, dout, dfinal, torch.bfloat16)


def test_mixed_dtypes_and_strided_inputs():
    """fp16 B/C with bf16 x, a strided bf16 dt view, bf16 D/dt_bias/initial_states: every
    gradient comes back in its input's dtype."""
    inp, kw, dout, dfinal = make_problem(2, 300, 4, 2, 64, 64, torch.bfloat16, OPTS["all"])
    inp["B"], inp["C"] = inp["B"].half(), inp["C"].half()
    wide = torch.zeros(2, 300, 12, device="cuda", dtype=torch.bfloat16)
    wide[..., 4:8] = inp["dt"].bfloat16()
    inp["dt"] = wide[..., 4:8]
    for k in ("D", "dt_bias", "initial_states"):
        kw[k] = kw[k].bfloat16()
    check(inp, kw, 128, dout, dfinal, torch.bfloat16)


def test_empty():
    inp, kw, dout, dfinal = make_problem(2, 0, 4, 1, 32, 64, torch.bfloat16, {"init": True})
    got = ours(inp, kw, 128, dout, dfinal)
    assert got["x"].shape == (2, 0, 4, 32) and float(got["A"].abs().sum()) == 0.0
    torch.testing.assert_close(got["initial_states"], dfinal)


def test_int64_indexing():
    """x with 3 * 2**30 elements: batch 2 lies past 2**31 elements and must get the same
    gradients as when run on its own (a wrapped 32-bit offset would read another batch)."""
    b, l, h, g, p, n = 3, 2**20, 16, 1, 64, 128
    free, _ = torch.cuda.mem_get_info()
    if free < 70 * 2**30:
        pytest.skip("needs 70 GiB of free GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, l, h, p, device="cuda", dtype=torch.bfloat16, generator=gen)
    dt = torch.full((b, l, h), 0.02, device="cuda")
    A = -torch.linspace(1, 8, h, device="cuda")
    Bm = torch.randn(b, l, g, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    Cm = torch.randn(b, l, g, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(b, l, h, p, device="cuda", dtype=torch.bfloat16, generator=gen)
    full = backward.ssd_backward_cuda(x, dt, A, Bm, Cm, 256, dout)
    dx2, dB2 = full["x"][2].clone(), full["B"][2].clone()
    del full
    one = backward.ssd_backward_cuda(x[2:], dt[2:], A, Bm[2:], Cm[2:], 256, dout[2:])
    # equal bits (SAME_MATH_TOL)
    e_x, e_B = rel_err(dx2, one["x"][0]), rel_err(dB2, one["B"][0])
    tol_x, tol_B = (min(SAME_MATH_TOL, grad_tol(k, torch.bfloat16, torch.bfloat16))
                    for k in ("x", "B"))
    msg = f"batch 2 vs alone: dx {e_x:.2e} (tol {tol_x:.0e}), dB {e_B:.2e} (tol {tol_B:.0e})"
    print(msg)
    log_result(msg)
    assert e_x <= tol_x and e_B <= tol_B, msg


def test_public_function_uses_cutile_backward(monkeypatch):
    """MAMBA2_CUTILE_BACKWARD=cutile routes autograd of the public function to these kernels;
    the gradients equal the PyTorch-stage backward's."""
    from mamba2_cutile import mamba_chunk_scan_combined

    gen = torch.Generator(device="cuda").manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    b, l, h, g, p, n = 2, 300, 4, 2, 64, 64
    base = dict(x=r(b, l, h, p).bfloat16(), dt=r(b, l, h) * 0.5 - 3.0, A=-torch.rand(
        h, device="cuda") * 4 - 1, B=r(b, l, g, n).bfloat16(), C=r(b, l, g, n).bfloat16(),
        D=r(h), z=r(b, l, h, p).bfloat16(), dt_bias=r(h) * 0.1)
    dout = r(b, l, h, p).bfloat16()
    grads = {}
    for impl in ("torch", "cutile"):
        monkeypatch.setenv("MAMBA2_CUTILE_BACKWARD", impl)
        leaves = {k: v.clone().requires_grad_(True) for k, v in base.items()}
        y = mamba_chunk_scan_combined(**leaves, chunk_size=128, dt_softplus=True)
        y.backward(dout)
        grads[impl] = {k: v.grad.float() for k, v in leaves.items()}
    # two float32-accumulating backwards against each other: the bf16 base tolerance (largest
    # measured 5.3e-3, dC), dD's own (1.4e-7 measured; D is float32)
    tols = {k: grad_tol(k, torch.bfloat16, torch.float32 if k == "D" else torch.bfloat16)
            for k in base}
    errs = {k: rel_err(grads["cutile"][k], grads["torch"][k]) for k in base}
    msg = "cutile vs torch-stage backward: " + ", ".join(f"d{k} {e:.2e}" for k, e in errs.items())
    print(msg)
    log_result(msg)
    for k, err in errs.items():
        assert torch.isfinite(grads["cutile"][k]).all(), f"d{k} has non-finite entries"
        assert grads["torch"][k].abs().max() > 0, f"d{k} of the torch-stage backward is zero"
        assert err <= tols[k], f"d{k}: {err:.2e} > tol {tols[k]:.0e} | {msg}"


def test_compiled_and_eager_training_step_agree():
    """A small Mamba-2-style block (in-projection, the scan with every option a model uses,
    out-projection): one SGD step eager and one under torch.compile (inductor, fullgraph: the
    custom op traces without a graph break) give the same loss, the same gradients and the
    same weight updates.

    The parameters are float32 (an optimizer's master weights) and the block computes in bf16
    (the projections use bf16 casts of their weights, so the scan sees bf16 x, z, B, C): a
    step's update (~1e-4) is then kept whole, where a bf16 weight would round most of it away,
    and the updates themselves are compared, relative to their own scale."""
    from mamba2_cutile import mamba_chunk_scan_combined

    b, l, h, g, p, n, d_model = 2, 300, 4, 2, 32, 64, 96
    bf16 = torch.bfloat16
    lin = torch.nn.functional.linear

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(d_model, 2 * h * p + 2 * g * n + h)
            self.out = torch.nn.Linear(h * p, d_model)
            self.A_log = torch.nn.Parameter(torch.log(torch.linspace(1.0, 8.0, h)))
            self.D = torch.nn.Parameter(torch.ones(h))
            self.dt_bias = torch.nn.Parameter(torch.full((h,), -2.0))

        def forward(self, u):
            proj = lin(u, self.inp.weight.to(bf16), self.inp.bias.to(bf16))
            xz, bc, dt = proj.split([2 * h * p, 2 * g * n, h], dim=-1)
            x, z = xz.view(b, l, 2, h, p).unbind(2)
            B, C = bc.view(b, l, 2, g, n).unbind(2)
            y = mamba_chunk_scan_combined(x, dt.float(), -torch.exp(self.A_log), B, C, 128,
                                          D=self.D, z=z, dt_bias=self.dt_bias,
                                          dt_softplus=True)
            return lin(y.reshape(b, l, h * p), self.out.weight.to(bf16), self.out.bias.to(bf16))

    torch.manual_seed(0)
    u = torch.randn(b, l, d_model, device="cuda", dtype=bf16)
    target = torch.randn(b, l, d_model, device="cuda", dtype=bf16)
    eager = Block().cuda()
    comp = Block().cuda()
    comp.load_state_dict(eager.state_dict())
    before = {k: prm.detach().double().clone() for k, prm in eager.named_parameters()}
    for k, prm in comp.named_parameters():
        assert prm.dtype == torch.float32 and torch.equal(prm.detach().double(), before[k]), k
    step = torch.compile(comp, fullgraph=True)
    losses, grads, updates, after = {}, {}, {}, {}
    for name, model, fn in (("eager", eager, eager), ("compiled", comp, step)):
        loss = torch.nn.functional.mse_loss(fn(u).float(), target.float())
        loss.backward()
        losses[name] = loss.item()
        grads[name] = {k: prm.grad.float().clone() for k, prm in model.named_parameters()}
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        after[name] = {k: prm.detach().double().clone() for k, prm in model.named_parameters()}
        updates[name] = {k: w - before[k] for k, w in after[name].items()}
    e_loss = abs(losses["compiled"] - losses["eager"]) / abs(losses["eager"])
    e_grad = {k: rel_err(grads["compiled"][k], ref) for k, ref in grads["eager"].items()}
    e_upd = {k: rel_err(updates["compiled"][k], ref) for k, ref in updates["eager"].items()}
    msg = (f"loss {losses['eager']:.4e} (compiled rel diff {e_loss:.2e}); grads: "
           + ", ".join(f"d{k} {e:.2e}" for k, e in e_grad.items()) + "; updates: "
           + ", ".join(f"{k} {e:.2e} (max {updates['eager'][k].abs().max().item():.1e})"
                       for k, e in e_upd.items()))
    print(msg)
    log_result(msg)
    assert math.isfinite(losses["eager"]) and math.isfinite(losses["compiled"]), msg
    assert e_loss <= 1e-3, msg
    for k, err in e_grad.items():
        assert grads["eager"][k].abs().max() > 0, f"d{k} is zero | {msg}"
        assert err < 2e-2, f"d{k}: {err:.2e} between the compiled and the eager step | {msg}"
    for k, err in e_upd.items():
        ue, uc = updates["eager"][k], updates["compiled"][k]
        assert ue.abs().max() > 0 and uc.abs().max() > 0, f"{k}: the step changed nothing | {msg}"
        # float32 rounding of w + update moves each entry by at most half an ulp of w, per step
        scale = torch.maximum(before[k].abs(), after["eager"][k].abs()).max().item()
        slack = torch.finfo(torch.float32).eps * scale / ue.abs().max().item()
        assert err <= 2e-2 + slack, \
            f"{k}: update {err:.2e} between the compiled and the eager step | {msg}"
