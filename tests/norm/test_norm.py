"""CPU: rmsnorm_fn / RMSNorm on the PyTorch path against the float64 definition
(`reference.norm.rmsnorm_gated_ref`): both gate orders, with and without z and bias, groups,
hidden sizes that are not powers of two, strided x and z, leading dimensions; the gradients
(float64 gradcheck, and against the definition's autograd), the module's parameters and
defaults (mamba_ssm's), argument errors naming the argument, the custom ops under opcheck and
torch.compile(fullgraph=True)."""

import argparse
import itertools
import os

import pytest
import torch
from support.grads import DOUBLE_BACKWARD

from mamba2_cutile.norm import RMSNorm, rmsnorm_fn
from mamba2_cutile.reference.norm import (rmsnorm_gated_backward, rmsnorm_gated_forward,
                                          rmsnorm_gated_ref)

F64 = torch.float64


def make(shape, hidden, dtype=F64, seed=0, z=True, bias=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64).to(dtype)  # noqa: E731
    x = r(*shape, hidden) * 2 + 0.3
    zz = r(*shape, hidden) * 2 if z else None
    w = (1 + 0.5 * r(hidden)).to(dtype)
    b = 0.3 * r(hidden) if bias else None
    return x, w, b, zz


#: (leading shape, hidden, group_size): one group, several, odd sizes, a group of 1
CASES = [((3, 7), 24, None), ((5,), 40, 8), ((2, 3, 4), 30, 10), ((11,), 37, None),
         ((4,), 6, 1), ((1,), 1, None)]


@pytest.mark.parametrize("shape, hidden, gs", CASES)
@pytest.mark.parametrize("has_z, nbg", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_forward_matches_definition(shape, hidden, gs, has_z, nbg, has_bias):
    for dtype, tol in ((F64, 1e-14), (torch.float32, 2e-6)):
        x, w, b, z = make(shape, hidden, dtype, z=has_z, bias=has_bias)
        got = rmsnorm_fn(x, w, b, z=z, eps=1e-5, group_size=gs, norm_before_gate=nbg)
        ref = rmsnorm_gated_ref(x, w, b, z, eps=1e-5, group_size=gs, norm_before_gate=nbg)
        assert got.shape == x.shape and got.dtype == dtype
        err = ((got.to(F64) - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, (dtype, err)


def test_definition_by_hand():
    """The float64 definition on a 1 x 4 row with 2 groups, written out."""
    x = torch.tensor([[1.0, 3.0, -2.0, 2.0]], dtype=F64)
    z = torch.tensor([[0.5, -1.0, 2.0, 0.0]], dtype=F64)
    w = torch.tensor([1.0, 2.0, 0.5, -1.0], dtype=F64)
    silu = z * torch.sigmoid(z)
    r1, r2 = (5.0 + 1e-6) ** -0.5, (4.0 + 1e-6) ** -0.5
    xhat = torch.tensor([[1.0 * r1, 3.0 * r1, -2.0 * r2, 2.0 * r2]], dtype=F64)
    got = rmsnorm_gated_ref(x, w, None, z, eps=1e-6, group_size=2, norm_before_gate=True)
    torch.testing.assert_close(got, xhat * w * silu, rtol=1e-15, atol=0)
    u = x * silu
    ms = torch.stack([u[0, :2].square().mean(), u[0, 2:].square().mean()])
    rs = torch.rsqrt(ms + 1e-6).repeat_interleave(2)
    got = rmsnorm_gated_ref(x, w, None, z, eps=1e-6, group_size=2, norm_before_gate=False)
    torch.testing.assert_close(got, (u * rs * w), rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_dtype(dtype):
    x, w, b, z = make((9,), 48, dtype)
    w = w.float()
    got = rmsnorm_fn(x, w, b, z=z, group_size=16)
    assert got.dtype == dtype
    ref = rmsnorm_gated_ref(x, w, b, z, group_size=16)
    # one rounding of the output to the dtype: at most half an ulp (2^-8 bf16, 2^-11 fp16)
    rel = ((got.to(F64) - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
    assert rel <= (2**-8 if dtype == torch.bfloat16 else 2**-11) * 1.01


def test_strided_inputs_are_read_in_place():
    """x and z as slices of one wider projection (no copy), x with a transposed layout (copied),
    an expanded weight: same result as contiguous inputs."""
    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(2, 9, 100, generator=gen, dtype=F64)
    z, x = proj[..., :40], proj[..., 50:90]
    w = torch.randn(40, generator=gen, dtype=F64)
    from mamba2_cutile.norm.api import _rows
    for t in (x, z):                                 # the rows the op gets are views of proj
        rows = _rows(t, 40)
        assert rows.data_ptr() == t.data_ptr() and rows.stride() == (100, 1)
    ref = rmsnorm_gated_ref(x, w, None, z, group_size=10)
    torch.testing.assert_close(rmsnorm_fn(x, w, z=z, group_size=10), ref, rtol=1e-14, atol=0)
    xt = x.contiguous().transpose(0, 1).contiguous().transpose(0, 1)       # leading dims swapped
    torch.testing.assert_close(rmsnorm_fn(xt, w, z=z, group_size=10), ref, rtol=1e-14, atol=0)
    xs = torch.randn(2, 9, 80, generator=gen, dtype=F64)[..., ::2]            # channel stride 2
    torch.testing.assert_close(rmsnorm_fn(xs, w, z=z, group_size=10),
                               rmsnorm_gated_ref(xs, w, None, z, group_size=10),
                               rtol=1e-14, atol=0)
    w1 = torch.tensor([0.7], dtype=F64).expand(40)
    torch.testing.assert_close(rmsnorm_fn(x, w1, z=z, group_size=10),
                               rmsnorm_gated_ref(x, w1.contiguous(), None, z, group_size=10),
                               rtol=1e-14, atol=0)


def test_empty_rows():
    x, w, b, z = make((0, 3), 16)
    out = rmsnorm_fn(x.requires_grad_(), w.requires_grad_(), b, z=z)
    assert out.shape == (0, 3, 16)
    out.sum().backward()
    assert x.grad.shape == x.shape and float(w.grad.abs().sum()) == 0.0


# ------------------------------------------------------------------------------------ gradients

@pytest.mark.parametrize("has_z, nbg, has_bias, gs",
                         [(False, True, False, None), (True, True, True, 4),
                          (True, False, True, 6), (True, False, False, None),
                          (True, True, False, 1)])
def test_gradcheck_float64(has_z, nbg, has_bias, gs):
    x, w, b, z = make((2, 3), 12, z=has_z, bias=has_bias, seed=3)
    args = [t.requires_grad_() for t in (x, w, b, z) if t is not None]

    def f(*a):
        it = iter(a)
        xx, ww = next(it), next(it)
        bb = next(it) if has_bias else None
        zz = next(it) if has_z else None
        return rmsnorm_fn(xx, ww, bb, z=zz, eps=1e-5, group_size=gs, norm_before_gate=nbg)
    assert torch.autograd.gradcheck(f, tuple(args))


@pytest.mark.parametrize("shape, hidden, gs", CASES[:4])
@pytest.mark.parametrize("has_z, nbg", [(False, True), (True, True), (True, False)])
def test_gradients_match_definition_autograd(shape, hidden, gs, has_z, nbg):
    """float32 inputs on the CPU path against the float64 definition's autograd; z and x are
    strided slices of one projection, so their gradients reach it through the views."""
    gen = torch.Generator().manual_seed(5)
    proj64 = torch.randn(*shape, 3 * hidden, generator=gen, dtype=F64) * 1.5
    w64 = 1 + 0.5 * torch.randn(hidden, generator=gen, dtype=F64)
    b64 = 0.3 * torch.randn(hidden, generator=gen, dtype=F64)
    dout = torch.randn(*shape, hidden, generator=gen, dtype=F64)
    grads = {}
    for dtype in (F64, torch.float32):
        proj, w, b = (t.to(dtype).detach().clone().requires_grad_() for t in (proj64, w64, b64))
        x, z = proj[..., hidden:2 * hidden], proj[..., :hidden] if has_z else None
        if dtype == F64:
            out = rmsnorm_gated_ref(x, w, b, z, eps=1e-5, group_size=gs, norm_before_gate=nbg)
        else:
            out = rmsnorm_fn(x, w, b, z=z, eps=1e-5, group_size=gs, norm_before_gate=nbg)
        out.backward(dout.to(dtype))
        grads[dtype] = (proj.grad, w.grad, b.grad)
    for name, got, ref in zip(("proj", "weight", "bias"), grads[torch.float32], grads[F64]):
        err = ((got.to(F64) - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-6, (name, err)      # float32 arithmetic: at most 4.1e-7 measured


def test_explicit_backward_matches_autograd():
    """The explicit backward formulas (the kernel's blueprint) in float64 against autograd of
    the forward they belong to, every option combination."""
    for has_z, nbg, has_bias, gs in itertools.product((False, True), (False, True),
                                                      (False, True), (5, 15)):
        x, w, b, z = make((6,), 15, z=has_z, bias=has_bias, seed=7)
        leaves = [t.requires_grad_() if t is not None else None for t in (x, w, b, z)]
        out, rstd = rmsnorm_gated_forward(x, w, b, z, 1e-5, gs, nbg, F64)
        dout = torch.randn_like(out)
        out.backward(dout)
        dx, dw, db, dz = rmsnorm_gated_backward(dout, x.detach(), w.detach(), b, z, rstd.detach(),
                                                gs, nbg, F64)
        for got, leaf in zip((dx, dw, db, dz), leaves):
            if leaf is None:
                assert got is None
            else:
                torch.testing.assert_close(got, leaf.grad, rtol=1e-14, atol=1e-14)  # 2.2e-15


def test_weight_gradient_in_weight_dtype():
    x, w, b, z = make((4,), 8, torch.bfloat16)
    w = w.float().requires_grad_()
    b = b.to(torch.bfloat16).requires_grad_()
    x.requires_grad_()
    rmsnorm_fn(x, w, b, z=z).sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.bfloat16
    assert x.grad.dtype == torch.bfloat16


# -------------------------------------------------------------------------------------- module

def test_module_matches_mamba_ssm_contract():
    m = RMSNorm(24, group_size=8, norm_before_gate=False, dtype=F64)
    assert [n for n, _ in m.named_parameters()] == ["weight"]
    assert m.bias is None and m.eps == 1e-5 and m.group_size == 8 and not m.norm_before_gate
    assert torch.equal(m.weight, torch.ones(24, dtype=F64))
    assert list(m.state_dict()) == ["weight"]
    d = RMSNorm(16)
    assert d.eps == 1e-5 and d.group_size is None and d.norm_before_gate is True
    assert d.weight.dtype == torch.get_default_dtype()
    # a mamba_ssm-style state dict loads
    sd = {"weight": torch.linspace(0.5, 1.5, 24, dtype=F64)}
    m.load_state_dict(sd)
    x, _, _, z = make((3,), 24)
    torch.testing.assert_close(m(x, z), rmsnorm_gated_ref(x, sd["weight"], None, z, eps=1e-5,
                                                          group_size=8, norm_before_gate=False),
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(m(x), rmsnorm_gated_ref(x, sd["weight"], None, None, eps=1e-5,
                                                       group_size=8), rtol=1e-14, atol=0)


def test_module_trains():
    m = RMSNorm(12, dtype=F64)
    x, _, _, z = make((5,), 12)
    m(x, z).square().sum().backward()
    assert m.weight.grad is not None and m.weight.grad.shape == (12,)


# -------------------------------------------------------------------------------------- errors

def _call(**over):
    x, w, b, z = make((3,), 12)
    kw = dict(x=x, weight=w, bias=b, z=z, eps=1e-6, group_size=None, norm_before_gate=True)
    kw.update(over)
    return rmsnorm_fn(kw.pop("x"), kw.pop("weight"), **kw)


@pytest.mark.parametrize("over, exc, name", [
    (dict(x=[1.0]), TypeError, "x"),
    (dict(x=torch.tensor(1.0, dtype=F64)), ValueError, "x"),
    (dict(x=torch.ones(3, 12, dtype=torch.int32)), TypeError, "x"),
    (dict(x=torch.ones(3, 0, dtype=F64), weight=torch.ones(0, dtype=F64), bias=None, z=None),
     ValueError, "hidden"),
    (dict(weight=torch.ones(11, dtype=F64)), ValueError, "weight"),
    (dict(weight=torch.ones(12, 1, dtype=F64)), ValueError, "weight"),
    (dict(weight=None), ValueError, "weight"),
    (dict(bias=torch.ones(13, dtype=F64)), ValueError, "bias"),
    (dict(bias=torch.ones(12, dtype=torch.int64)), TypeError, "bias"),
    (dict(z=torch.ones(3, 13, dtype=F64)), ValueError, "z"),
    (dict(z=torch.ones(12, dtype=F64)), ValueError, "z"),
    (dict(group_size=5), ValueError, "group_size"),
    (dict(group_size=0), ValueError, "group_size"),
    (dict(group_size=4.0), TypeError, "group_size"),
    (dict(group_size=True), TypeError, "group_size"),
    (dict(eps=-1e-6), ValueError, "eps"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(eps="1e-6"), TypeError, "eps"),
    (dict(norm_before_gate="yes"), TypeError, "norm_before_gate"),
    (dict(z=torch.ones(3, 12, dtype=F64, device="meta")), ValueError, "z"),
])
def test_bad_arguments_name_the_argument(over, exc, name):
    with pytest.raises(exc, match=name):
        _call(**over)


def test_eps_of_any_real_type():
    """eps as a numpy scalar (a config read with numpy) is a number like any other."""
    import numpy as np
    ref = _call(eps=1e-5)
    for eps in (np.float32(1e-5), np.float64(1e-5)):
        # float32(1e-5) is 1e-5 to 2.5e-8 relative: outputs move by up to 3.9e-13 relative
        torch.testing.assert_close(_call(eps=eps), ref, rtol=1e-12, atol=0)


def test_config_validates_itself(monkeypatch):
    from mamba2_cutile.norm import NormConfig, norm_config
    with pytest.raises(ValueError, match="block_m"):
        NormConfig(block_g=64, block_m=3, bwd_block_m=1)
    with pytest.raises(ValueError, match="block_g"):
        NormConfig(block_g=2 * 16384, block_m=1, bwd_block_m=1)
    monkeypatch.setenv("MAMBA2_CUTILE_NORM_CONFIG", "block_m=8,bwd_occupancy=2")
    cfg = norm_config(320)
    assert cfg.block_m == 8 and cfg.bwd_occupancy == 2 and cfg.block_g == 512
    monkeypatch.setenv("MAMBA2_CUTILE_NORM_CONFIG", "block_g=1024")
    with pytest.raises(ValueError, match="MAMBA2_CUTILE_NORM_CONFIG"):
        norm_config(320)
    monkeypatch.setenv("MAMBA2_CUTILE_NORM_CONFIG", "warps=3")
    with pytest.raises(ValueError, match="warps"):
        norm_config(320)
    for bad in (3, 32, 8192):
        with pytest.raises(ValueError, match="chunk"):
            NormConfig(block_g=64, block_m=1, bwd_block_m=1, chunk=bad)
    monkeypatch.setenv("MAMBA2_CUTILE_NORM_CONFIG", "chunk=0")
    assert norm_config(1536).chunk == 0                   # the padded kernels on request
    monkeypatch.setenv("MAMBA2_CUTILE_NORM_CONFIG", "fwd_ctas_per_sm=4")
    assert norm_config(1536).fwd_ctas_per_sm == 4
    with pytest.raises(ValueError, match="fwd_ctas_per_sm"):  # padded: one program per block
        norm_config(4096)
    with pytest.raises(ValueError, match="fwd_ctas_per_sm"):
        NormConfig(block_g=64, block_m=1, bwd_block_m=1, chunk=64, fwd_ctas_per_sm=33)


def test_persistent_forward_grid():
    """fwd_ctas_per_sm: about that many forward programs per SM over all groups, at most one
    per row block; 0: one per row block."""
    from dataclasses import replace

    from mamba2_cutile.norm.plan import fwd_programs, norm_shape_config, problem_plans
    from support.variants import kernel_arg
    cfg = replace(norm_shape_config(1536), block_m=2)
    assert fwd_programs(16384, 1, cfg, 132) == 8192
    per = replace(cfg, fwd_ctas_per_sm=4)
    assert fwd_programs(16384, 1, per, 132) == 528
    assert fwd_programs(16384, 8, per, 132) == 66
    assert fwd_programs(5, 1, per, 132) == 3
    fwd, _ = problem_plans(rows=16384, hidden=1536, config=per)
    assert fwd[0].grid == (528, 1, 1) and kernel_arg(fwd[0], "PERSISTENT") is True
    fwd, _ = problem_plans(rows=16384, hidden=1536, config=cfg)
    assert fwd[0].grid == (8192, 1, 1) and kernel_arg(fwd[0], "PERSISTENT") is False


def test_chunk_must_divide_the_group():
    """A chunk that does not cut the group into whole chunks (at most 32) is refused by the
    plan with an error naming chunk, before any launch."""
    from dataclasses import replace

    from mamba2_cutile.norm.plan import check_chunk, norm_shape_config, problem_plans
    cfg = replace(norm_shape_config(1536), chunk=1024)
    with pytest.raises(ValueError, match="chunk"):
        check_chunk(cfg, 1536)
    with pytest.raises(ValueError, match="chunk"):
        problem_plans(rows=64, hidden=1536, config=cfg)
    with pytest.raises(ValueError, match="chunk"):
        check_chunk(replace(cfg, chunk=64), 64 * 33)
    check_chunk(replace(cfg, chunk=512), 1536)
    check_chunk(replace(cfg, chunk=0), 1000)


# ---------------------------------------------------------------------------- ops and compile

def test_opcheck():
    """Both ops (fake impls, autograd registration, AOT dispatch), x and z as strided rows."""
    wide = torch.randn(5, 40)
    x, z = wide[:, :12], wide[:, 20:32]
    _, w, b, _ = make((5,), 12, torch.float32)
    ops = torch.ops.mamba2_cutile
    for bb, zz, nbg in ((b, z, False), (None, None, True)):
        args = (x.clone().requires_grad_(), w.clone().requires_grad_(), bb, zz, 1e-6, 4, nbg)
        torch.library.opcheck(ops.rmsnorm_gated_fwd, args)
        _, rstd = ops.rmsnorm_gated_fwd(x, w, bb, zz, 1e-6, 4, nbg)
        torch.library.opcheck(ops.rmsnorm_gated_bwd,
                              (torch.randn(5, 12), x, w, bb, zz, rstd, 4, nbg))


def test_torch_compile_fullgraph():
    """The function traces without a graph break (aot_eager: the custom ops and their
    autograd, without inductor's compile time) and gives the eager results."""
    torch._dynamo.reset()
    x, w, _, zin = make((2, 5), 16, torch.float32)
    proj = torch.cat([zin, x], dim=-1).requires_grad_()
    w.requires_grad_()

    def step(proj, w):
        z, x = proj[..., :16], proj[..., 16:]
        return rmsnorm_fn(x, w, None, z=z, eps=1e-5, group_size=8, norm_before_gate=False)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(proj, w)
    g = torch.autograd.grad(out.square().sum(), (proj, w))
    out_e = step(proj, w)
    g_e = torch.autograd.grad(out_e.square().sum(), (proj, w))
    torch.testing.assert_close(out, out_e, rtol=0, atol=0)
    for a, e in zip(g, g_e):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------- benchmark

def test_bench_helpers():
    """The benchmark's byte counts and its sweep space (every override a valid config)."""
    from dataclasses import replace

    from mamba2_cutile.bench import norm as bench
    from mamba2_cutile.norm.plan import norm_shape_config, padded_shape_config
    fwd, bwd = bench.norm_bytes(16384, 4096, 8, elem=2, has_z=True)
    assert fwd == 16384 * 4096 * 2 * 3 + 4096 * 4 + 16384 * 8 * 4
    assert bwd == 16384 * 4096 * 2 * 5 + 16384 * 8 * 4 + 2 * 4096 * 4
    for gs in (1, 320, 1536, 8192, 16384):
        rule = norm_shape_config(gs)
        f, b = bench.sweep_space(rule)
        assert len(f) >= 6 and len(b) >= 12
        for over in f + b:
            replace(rule, **over)
    for gs in (1536, 2560, 3072, 5120, 1024, 1000, 37):
        rule, padded = norm_shape_config(gs), padded_shape_config(gs)
        f, b = bench.candidate_space(gs)
        assert {} in f and {} in b
        for over, fields in [(o, bench._FWD_FIELDS) for o in f] + \
                [(o, bench._BWD_FIELDS) for o in b]:
            assert set(over) <= set(fields)
            replace(rule, **over)
        if rule.chunk:              # the padded kernels under their own rule are a candidate
            assert replace(rule, **f[0]) == replace(padded, **{
                k: getattr(rule, k) for k in bench._BWD_FIELDS if k != "chunk"})
            assert f[0]["chunk"] == 0 and b[0]["chunk"] == 0
        assert len(f) == len({tuple(sorted(o.items())) for o in f})
    rows = [dict(tokens=1, hidden=2, ngroups=1, kind="fwd", overrides={}, ms=2.0, gb_s=1.0,
                 rel_err_vs_rule=0.0),
            dict(tokens=1, hidden=2, ngroups=1, kind="fwd", overrides={"block_m": 2}, ms=1.0,
                 gb_s=2.0, rel_err_vs_rule=0.0)]
    assert bench.best_of_sweep(rows) == [rows[1]]
    assert bench._parse_shapes("16384x1536x1,64x8192x8") == [(16384, 1536, 1), (64, 8192, 8)]
    for bad in ("", "16384x1536", "1x10x3", "axbxc"):
        with pytest.raises(argparse.ArgumentTypeError, match="TOKENSxHIDDENxGROUPS"):
            bench._parse_shapes(bad)
    assert "block_m" in bench.format_rows(rows)


def test_sweep_loop_on_the_cpu_path(monkeypatch):
    """The candidate sweep's loop, on CPU tensors (the PyTorch path: every candidate gives the
    rule's result) with a stub timer: one row per candidate and pass, none failed, each
    candidate's overrides in MAMBA2_CUTILE_NORM_CONFIG while it runs and the variable restored
    after; a compile warm-up task that fails reports itself instead of raising."""
    from mamba2_cutile.bench import norm as bench
    from mamba2_cutile.bench import timing

    def cpu_inputs(tokens, hidden, dtype=torch.float32, has_z=True, seed=0):
        x, w, _, z = make((tokens,), hidden, torch.float32, seed=seed, bias=False)
        return x, z, w, torch.randn(tokens, hidden)
    seen = []

    def fake_time(call, reps):
        call()
        seen.append(os.environ.get("MAMBA2_CUTILE_NORM_CONFIG"))
        return {"median_ms": 1.0}
    monkeypatch.setattr(bench, "make_inputs", cpu_inputs)
    monkeypatch.setattr(timing, "time_graph", fake_time)
    monkeypatch.setenv("MAMBA2_CUTILE_NORM_CONFIG", "block_m=1")
    shapes = [(33, 1536, 1), (33, 2048, 2)]
    rows = bench.sweep_norm(shapes=shapes, dtype=torch.float32, reps=1)
    want = sum(len(f) + len(b) for f, b in (bench.candidate_space(h // g) for _, h, g in shapes))
    assert len(rows) == want and not any("error" in r for r in rows)
    assert all(r["rel_err_vs_rule"] == 0 for r in rows)
    assert seen == [bench._env_spec(r["overrides"]) for r in rows]
    assert os.environ["MAMBA2_CUTILE_NORM_CONFIG"] == "block_m=1"
    # the gate-first order: its own rule as the candidates' base, the order in each row
    seen.clear()
    rows = bench.sweep_norm(shapes=shapes[:1], dtype=torch.float32, reps=1,
                            norm_before_gate=False)
    assert len(rows) == sum(map(len, bench.candidate_space(1536, gate_first=True)))
    assert not any("error" in r for r in rows)
    assert all(r["norm_before_gate"] is False and r["rel_err_vs_rule"] == 0 for r in rows)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert bench._warm((33, 1536, 1, "bwd", {"chunk": 0}, torch.float32, True)) is None
    assert bench._warm((33, 1536, 1, "fwd", {}, torch.float32, False)) is None
    monkeypatch.setattr(bench, "make_inputs", lambda *a: 1 / 0)
    assert "ZeroDivisionError" in bench._warm((33, 1536, 1, "fwd", {}, torch.float32, True))


def test_shape_rule_values():
    """The dispatcher's tiles at the group sizes it was timed at (512, 4096) and around them:
    forward block_m rows of the padded group at occupancy 4 (2 up from 8192 channels),
    backward 4096-channel tiles up to 1024-channel groups, one row from 2048, two programs
    per SM."""
    from mamba2_cutile.norm.plan import norm_shape_config
    got = {gs: norm_shape_config(gs) for gs in (256, 512, 2048, 4096, 8192, 1000)}
    assert [(c.block_g, c.block_m, c.occupancy) for c in got.values()] == [
        (256, 16, 4), (512, 8, 4), (2048, 2, 4), (4096, 2, 4), (8192, 1, 2), (1024, 4, 4)]
    # groups of 1024: occupancy 8 (timed at 8 x 1024), one row with the norm first, two with
    # the gate first; 1000 keeps its padded rule
    c = norm_shape_config(1024)
    assert (c.block_m, c.occupancy, c.warps, c.bwd_block_m) == (1, 8, 4, 4)
    c = norm_shape_config(1024, gate_first=True)
    assert (c.block_m, c.occupancy, c.warps, c.bwd_block_m) == (2, 8, 4, 4)
    assert [(c.bwd_block_m, c.bwd_occupancy, c.bwd_ctas_per_sm) for c in got.values()] == [
        (16, 2, 2), (8, 2, 2), (1, 2, 2), (1, 2, 2), (1, 1, 2), (4, 2, 2)]
    assert got[8192].warps == 8 and got[8192].bwd_warps == 8 and got[4096].warps == 0
    assert all(c.chunk == 0 for c in got.values())         # powers of two and 1000: padded


def test_chunked_rule_values():
    """Group widths m * 2^k (m odd) up to 10240 take the chunked kernels with 2^k-channel
    chunks (at most 1024); widths whose chunks would be under 64 channels or more than 32,
    and widths above 10240, keep the padded kernels; forward rows per tile the power of two
    <= 8192 / S, the backward's <= 4096 / S below 2048 channels; the hints timed at 1536, 2560
    and 5120 channels (8 warps forward at 1536; four backward programs per SM at occupancy 4
    from 1024 to 2560; occupancy 4 / 2 at 5120; two forward rows at occupancy 6, 4 warps at
    2560), and the gate-first order's own (timed at 1536, 2560, 5120)."""
    from dataclasses import replace

    from mamba2_cutile.norm.plan import (_chunked_base_config, group_chunk, norm_shape_config,
                                         padded_shape_config)
    chunks = {s: group_chunk(s) for s in (1536, 2560, 3072, 5120, 7680, 10240, 15360, 320,
                                          1000, 1030, 37, 1, 4096, 64 * 33)}
    assert chunks == {1536: 512, 2560: 512, 3072: 1024, 5120: 1024, 7680: 0, 10240: 1024,
                      15360: 0, 320: 64, 1000: 0, 1030: 0, 37: 0, 1: 0, 4096: 0,
                      64 * 33: 0}
    got = {s: norm_shape_config(s) for s in (320, 1536, 2560, 5120, 7680, 10240)}
    assert [(c.chunk, c.block_m, c.occupancy, c.warps) for c in got.values()] == [
        (64, 16, 4, 0), (512, 4, 4, 8), (512, 2, 6, 4), (1024, 1, 4, 0), (0, 1, 2, 8),
        (1024, 1, 2, 8)]
    assert [(c.bwd_block_m, c.bwd_occupancy, c.bwd_warps) for c in got.values()] == [
        (8, 2, 0), (1, 4, 4), (1, 4, 4), (1, 2, 8), (1, 1, 8), (1, 1, 8)]
    assert [c.bwd_ctas_per_sm for c in got.values()] == [2, 4, 4, 2, 2, 2]
    # the gate-first order's own hints, timed in that order (its 5120 backward keeps the base
    # tiles)
    # (and, with the approximate sigmoid, occupancy 8 at 1536 and one row at occupancy 8 at 3072)
    first = {s: norm_shape_config(s, gate_first=True) for s in (1536, 2560, 3072, 5120, 7680)}
    assert [(c.chunk, c.block_m, c.occupancy, c.warps) for c in first.values()] == [
        (512, 2, 8, 4), (512, 2, 6, 4), (1024, 1, 8, 4), (1024, 1, 6, 4), (0, 1, 2, 8)]
    assert [(c.bwd_block_m, c.bwd_ctas_per_sm, c.bwd_occupancy, c.bwd_warps)
            for c in first.values()] == [(1, 3, 3, 4), (1, 3, 3, 4), (1, 2, 2, 0), (1, 2, 1, 8),
                                         (1, 2, 1, 8)]
    assert all(c.approx == 1 for c in first.values())
    # the backward's load latency hint: timed faster only at 5120
    assert [c.bwd_latency for c in first.values()] == [0, 0, 0, 4, 0]
    # below 1024 channels the gate-first order keeps the base hints (nothing timed there)
    # (but for the backward's plain stores, which every chunked rule takes)
    assert norm_shape_config(768, gate_first=True) == replace(_chunked_base_config(768, 256),
                                                              bwd_tma=2)
    assert all(c.bwd_tma == 2 for c in (*got.values(), *first.values()) if c.chunk)
    # 7680 (15 * 512, a 1/16 padding in 8192) takes the padded kernels: timed 1.6-2.2x faster
    assert norm_shape_config(7680) == norm_shape_config(7680, gate_first=True) == \
        padded_shape_config(7680)
    assert norm_shape_config(4096, gate_first=True) == norm_shape_config(4096)   # padded


def test_sweep_configs_parse():
    """`bench.norm --configs`: each pass's override lists led by the rule; bad items name
    the flag."""
    from mamba2_cutile.bench.norm import parse_configs
    fwd, bwd = parse_configs("fwd:warps=8,occupancy=4; bwd:bwd_block_m=1 ;bwd:bwd_warps=8")
    assert fwd == [{}, {"warps": 8, "occupancy": 4}]
    assert bwd == [{}, {"bwd_block_m": 1}, {"bwd_warps": 8}]
    for bad in ("warps=8", "fwd:warps", "up:warps=8"):
        with pytest.raises(ValueError, match="--configs"):
            parse_configs(bad)


def test_approximate_sigmoid_only_for_16bit_inputs():
    """The kernels' APPROX (the gate's sigmoid through the approximate exp2 and reciprocal) is
    on for 16-bit x and z under the default config, off for a float32 x or z and under
    approx=0, in the forward and the backward launch alike."""
    from dataclasses import replace

    from mamba2_cutile.norm.plan import norm_shape_config, problem_plans
    from support.variants import kernel_arg
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    cases = [(dict(dtype=bf), True), (dict(dtype=f16), True), (dict(dtype=f32), False),
             (dict(dtype=bf, z_dtype=f32), False),
             (dict(dtype=bf, config=replace(norm_shape_config(1536), approx=0)), False)]
    for kw, want in cases:
        fwd, bwd = problem_plans(rows=64, hidden=1536, **kw)
        assert kernel_arg(fwd[0], "APPROX") is want, kw
        assert kernel_arg(bwd[0], "APPROX") is want, kw
    with pytest.raises(ValueError, match="approx"):
        replace(norm_shape_config(1536), approx=2)
    with pytest.raises(ValueError, match="bwd_regate"):
        replace(norm_shape_config(4096), bwd_regate=1)       # padded: no chunks to re-read


def test_backward_plain_stores_option():
    """bwd_tma=2 (TMA loads, plain stores) reaches the chunked backward kernel as TMA=2; the
    padded kernels, which have no such variant, take it as TMA loads and stores."""
    from dataclasses import replace

    from mamba2_cutile.norm.plan import norm_shape_config, problem_plans
    from support.variants import kernel_arg
    for tma in (0, 1, 2):
        cfg = replace(norm_shape_config(1536, True), bwd_tma=tma)
        _, bwd = problem_plans(rows=64, hidden=1536, norm_before_gate=False, config=cfg)
        assert kernel_arg(bwd[0], "TMA") == tma
    for tma, want in ((0, False), (1, True), (2, True)):          # padded: a bool
        cfg = replace(norm_shape_config(4096), bwd_tma=tma)
        _, bwd = problem_plans(rows=64, hidden=4096, config=cfg)
        assert kernel_arg(bwd[0], "TMA") is want
    with pytest.raises(ValueError, match="bwd_tma"):
        replace(norm_shape_config(1536), bwd_tma=3)


def test_backward_latency_hint_reaches_both_kernels():
    """NormConfig.bwd_latency is the backward kernels' LATENCY (padded and chunked alike; 0,
    the default, leaves the compiler's choice), and a hint outside 0..10 is refused."""
    from dataclasses import replace

    from mamba2_cutile.norm.plan import norm_shape_config, problem_plans
    from support.variants import kernel_arg
    for hidden in (4096, 1536):                       # padded, chunked (3 x 512)
        base = norm_shape_config(hidden)
        _, bwd = problem_plans(rows=64, hidden=hidden)
        assert kernel_arg(bwd[0], "LATENCY") == 0
        _, bwd = problem_plans(rows=64, hidden=hidden, config=replace(base, bwd_latency=4))
        assert kernel_arg(bwd[0], "LATENCY") == 4, hidden
    with pytest.raises(ValueError, match="bwd_latency"):
        replace(norm_shape_config(1536), bwd_latency=11)


def test_eager_call_equals_the_op():
    """An eager call with gradients runs `_EagerNorm` (the op's body and backward, no
    dispatch): output and gradients bit-equal to the op's; a double backward raises on both
    paths; without gradients the body alone."""
    from mamba2_cutile.norm import custom_ops

    wide = torch.randn(5, 40, dtype=torch.float64)
    _, w, b, _ = make((5,), 12, torch.float64)
    g = torch.randn(5, 12, dtype=torch.float64)
    results = []
    for path in ("eager", "op"):
        x, z, ww, bb = (t.clone().requires_grad_() for t in (wide[:, :12], wide[:, 20:32], w, b))
        fn = (custom_ops.rmsnorm_gated if path == "eager"
              else torch.ops.mamba2_cutile.rmsnorm_gated_fwd)
        out, rstd = fn(x, ww, bb, z, 1e-6, 4, False)
        assert (type(out.grad_fn).__name__ == "_EagerNormBackward") == (path == "eager")
        results.append((out, rstd) + torch.autograd.grad(out, [x, ww, bb, z], g, retain_graph=True))
        (gx,) = torch.autograd.grad(out, [x], g, create_graph=True)
        with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD[path]):
            gx.sum().backward()
    for a, b_ in zip(*results):
        torch.testing.assert_close(a, b_, rtol=0, atol=0)
    with torch.no_grad():
        assert custom_ops.rmsnorm_gated(wide[:, :12], w, b, None, 1e-6, 4, True)[0].grad_fn is None
