"""CPU: the decode step (`selective_state_update`): the PyTorch path against the float64
definition, the dispatcher's variant choice, error messages, and (marked compile) every kernel
variant the dispatcher can choose compiles for sm_90 and sm_100.
"""

import math

import numpy as np
import pytest
import torch

from mamba2_cutile import mamba_chunk_scan_combined
from mamba2_cutile.bench import plans
from mamba2_cutile.decode import api as decode_api, plan as decode_plan
from mamba2_cutile.decode import selective_state_update
from mamba2_cutile.reference import selective_state_update_ref
from support import variants


def make(b=3, k=None, h=6, g=3, p=10, n=12, nslots=None, layout="head", opts=("D", "z", "bias"),
         idx=None, out=False, state_dtype=torch.float32, dtype=torch.float32, seed=0):
    """A decode problem. layout "head": dt, A, D, dt_bias are stride-0 per-head expansions;
    "general": full tensors; "mixed": per-head dt with per-channel dt_bias and general A."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    lead = (b,) if k is None else (b, k)
    nslots = nslots or b
    kw = {}
    if layout == "head":
        A = (-torch.exp(u(h) * math.log(16.0)))[:, None, None].expand(h, p, n)
        dt = (u(*lead, h) * 0.1)[..., None].expand(*lead, h, p)
        D = r(h)[:, None].expand(h, p)
        bias = (0.1 * r(h))[:, None].expand(h, p)
    else:
        A = -torch.exp(u(h, p, n) * math.log(16.0))
        dt = (u(*lead, h) * 0.1)[..., None].expand(*lead, h, p)
        if layout == "general":
            dt = dt + 0.01 * u(*lead, h, p)
        D, bias = r(h, p), 0.1 * r(h, p)
    inp = dict(state=r(nslots, h, p, n).to(state_dtype), x=r(*lead, h, p).to(dtype), dt=dt,
               A=A, B=r(*lead, g, n).to(dtype), C=r(*lead, g, n).to(dtype))
    if "D" in opts:
        kw["D"] = D
    if "z" in opts:
        kw["z"] = r(*lead, h, p).to(dtype)
    if "bias" in opts:
        kw["dt_bias"] = bias
        kw["dt_softplus"] = True
        inp["dt"] = inp["dt"] - 3.0     # softplus(dt + bias) small, as in a real model
    if idx is not None:
        kw["state_batch_indices"] = torch.tensor(idx, dtype=torch.int32)
    if out:
        kk = 1 if k is None else k
        kw["out_states"] = torch.full((b, kk, h, p, n), 7.0, dtype=state_dtype)
    return inp, kw


from mamba2_cutile.bench.accuracy import rel_err  # noqa: E402


def run_and_check(inp, kw, tol=1e-5):
    y_ref, state_ref, per_step = selective_state_update_ref(**inp, **kw)
    before = inp["state"].clone()
    state = inp["state"].clone()
    out_before = kw["out_states"].clone() if "out_states" in kw else None
    y = selective_state_update(**{**inp, "state": state}, **kw)
    assert y.shape == inp["x"].shape and y.dtype == inp["x"].dtype
    assert rel_err(y, y_ref) <= tol
    assert rel_err(state, state_ref) <= tol
    idx = kw.get("state_batch_indices")
    b = inp["x"].shape[0]
    rows = list(range(b)) if idx is None else [int(v) for v in idx]
    valid = [r for r in range(b) if rows[r] >= 0]
    untouched = sorted(set(range(state.shape[0])) - {rows[r] for r in valid})
    assert torch.equal(state[untouched], before[untouched])      # other slots: bit-exact
    pad = [r for r in range(b) if rows[r] < 0]
    if pad:
        assert (y[pad] == 0).all()
    if out_before is not None:
        out = kw["out_states"]
        out5 = out if out.dim() == 5 else out[:, None]
        if valid:
            assert rel_err(out5[valid], per_step[valid]) <= tol
        if pad:
            assert torch.equal(out[pad], out_before[pad])
    return y, state


# ---------------------------------------------------------------------------------------------
# the PyTorch path against the definition

@pytest.mark.parametrize("layout", ["head", "general", "mixed"])
@pytest.mark.parametrize("opts", [(), ("D",), ("z",), ("bias",), ("D", "z", "bias")],
                         ids=lambda o: "+".join(o) or "none")
def test_options(layout, opts):
    run_and_check(*make(layout=layout, opts=opts))


@pytest.mark.parametrize("k", [None, 1, 4])
@pytest.mark.parametrize("idx", [None, [4, 0, 2], [3, -1, 0], [-1, -1, -1]],
                         ids=["no-idx", "permuted", "padded", "all-padding"])
def test_steps_and_indices(k, idx):
    run_and_check(*make(k=k, nslots=5, idx=idx, out=True))


def test_bf16_state_and_inputs():
    inp, kw = make(k=3, nslots=4, idx=[2, 0, 3], out=True, state_dtype=torch.bfloat16,
                   dtype=torch.bfloat16)
    run_and_check(inp, kw, tol=1e-2)


def test_D_and_bias_per_head_shapes():
    """D and dt_bias given as (h,) equal their (h, p) expansions and full copies."""
    inp, kw = make(k=2)
    y1, s1 = run_and_check(inp, kw)
    kw2 = dict(kw, D=kw["D"][:, 0].clone(), dt_bias=kw["dt_bias"][:, 0].clone())
    y2, s2 = run_and_check(inp, kw2)
    kw3 = dict(kw, D=kw["D"].contiguous(), dt_bias=kw["dt_bias"].contiguous())
    inp3 = dict(inp, A=inp["A"].contiguous(), dt=inp["dt"].contiguous())
    y3, s3 = run_and_check(inp3, kw3)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(y1, y3)
    torch.testing.assert_close(s1, s3)


def test_3d_is_k1():
    inp, kw = make(k=None, out=True)
    inp4 = {k: (v[:, None] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    kw4 = dict(kw, z=kw["z"][:, None], out_states=kw["out_states"].clone())
    kw3 = dict(kw, out_states=kw["out_states"][:, 0].clone())     # (b, h, p, n) for 3-D x
    y3, s3 = run_and_check(inp, kw3)
    y4, s4 = run_and_check(inp4, kw4)
    assert y3.dim() == 3 and y4.dim() == 4
    torch.testing.assert_close(y3, y4[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(s3, s4, rtol=0, atol=0)


def test_k_steps_equal_k_calls():
    inp, kw = make(k=3, nslots=4, idx=[1, 3, 0])
    state_a = inp["state"].clone()
    ya = selective_state_update(**{**inp, "state": state_a}, **kw)
    state_b = inp["state"].clone()
    for t in range(3):
        step = {k: (v[:, t] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
        yb = selective_state_update(**{**step, "state": state_b}, **dict(kw, z=kw["z"][:, t]))
        torch.testing.assert_close(yb, ya[:, t], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state_a, state_b, rtol=1e-6, atol=1e-6)


def test_no_autograd_graph():
    """A decode step records nothing for autograd, even from inputs that require grad: the
    state written in place carries no graph from step to step (a generation loop outside
    torch.no_grad() would otherwise hold every step's tensors)."""
    inp, kw = make(k=2, out=True)
    x = inp["x"].requires_grad_()
    for _ in range(3):
        y = selective_state_update(**{**inp, "x": x}, **kw)
    assert not y.requires_grad and y.grad_fn is None
    assert inp["state"].grad_fn is None and kw["out_states"].grad_fn is None
    ref = make(k=2, out=True)[0]["state"].clone()
    assert not torch.equal(inp["state"], ref)            # the steps did write the state


def test_empty_batch():
    inp, kw = make(b=0, nslots=2, opts=())
    before = inp["state"].clone()
    y = selective_state_update(**inp)
    assert y.shape == (0, 6, 10)
    assert torch.equal(inp["state"], before)


def test_prefill_then_decode_equals_longer_prefill():
    """The chunk scan over T tokens, then k decode steps == the scan over T + k tokens."""
    b, T, k, h, g, p, n = 2, 37, 3, 4, 2, 8, 16
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, z = r(b, T + k, h, p), r(b, T + k, h, p)
    dt = torch.rand(b, T + k, h, generator=gen) * 0.1 - 3.0
    A, D, bias = -torch.rand(h, generator=gen) * 4 - 0.5, r(h), 0.1 * r(h)
    Bm, Cm = r(b, T + k, g, n), r(b, T + k, g, n)
    common = dict(D=D, z=None, dt_bias=bias, dt_softplus=True)
    y_all, h_all = mamba_chunk_scan_combined(x, dt, A, Bm, Cm, 64, return_final_states=True,
                                             **dict(common, z=z))
    y_pre, h_pre = mamba_chunk_scan_combined(x[:, :T], dt[:, :T], A, Bm[:, :T], Cm[:, :T], 64,
                                             return_final_states=True, **dict(common, z=z[:, :T]))
    state = h_pre.clone()
    y_dec = selective_state_update(
        state, x[:, T:], dt[:, T:, :, None].expand(b, k, h, p), A[:, None, None].expand(h, p, n),
        Bm[:, T:], Cm[:, T:], D=D[:, None].expand(h, p), z=z[:, T:],
        dt_bias=bias[:, None].expand(h, p), dt_softplus=True)
    torch.testing.assert_close(y_dec, y_all[:, T:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, h_all, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# the dispatcher

def _flags(**problem):
    (call,) = plans.decode_problem_plan(**problem)
    return call, variants.variant_of(call)


def test_dispatch_per_head_layout():
    call, f = _flags(layout="head", options=plans.DECODE_OPTIONS, k=2)
    assert f["DT_HEAD"] and f["A_HEAD"] and f["D_MODE"] == 1 and f["BIAS_MODE"] == 1
    assert f["HAS_Z"] and f["SOFTPLUS"] and f["HAS_IDX"] and f["HAS_OUT"] and not f["int64"]
    args = call.args
    assert args[2].shape == (4, 2, 128) and args[3].shape == (128,)   # compact dt and A


def test_dispatch_general_layout():
    _, f = _flags(layout="general", options=("D", "bias"))
    assert not f["DT_HEAD"] and not f["A_HEAD"] and f["D_MODE"] == 2 and f["BIAS_MODE"] == 2
    assert not (f["HAS_Z"] or f["SOFTPLUS"] or f["HAS_IDX"] or f["HAS_OUT"])
    _, f = _flags(layout="mixed", options=("D", "bias"))
    assert f["DT_HEAD"] and not f["A_HEAD"] and f["D_MODE"] == 1 and f["BIAS_MODE"] == 2
    _, f = _flags(layout="head", options=())
    assert f["D_MODE"] == 0 and f["BIAS_MODE"] == 0


def test_dispatch_int64_and_grid():
    call, f = _flags(int64=True)
    assert f["int64"]
    assert call.args[0].numel() >= 2**31
    call, f = _flags(batch=1, nheads=128, headdim=64, dstate=128)
    bp, np_ = f["BLOCK_P"], f["NP"]
    assert np_ == 128 and bp & (bp - 1) == 0
    assert call.grid == (1, 128, 64 // bp)
    # the H200 measurements behind the dispatcher: 64-channel tiles without TMA, 4 programs
    # per SM for big grids, 2 for small ones
    # (and, the tiles dividing the state exactly, no bounds checks)
    assert bp == 64 and call.kernel is not None
    assert (f["LOAD_TMA"], f["STORE_TMA"], f["IN_BOUNDS"]) == (False, False, True)
    assert decode_plan.decode_config(1, 128, 64, 128).occupancy == 2
    assert decode_plan.decode_config(64, 128, 64, 128).occupancy == 4


@pytest.mark.parametrize("b, h, p, n", [(1, 24, 64, 128), (256, 128, 64, 128), (2, 6, 80, 96),
                                        (1, 2, 1, 1), (8, 16, 128, 256), (1, 1, 300, 16)])
def test_default_config(b, h, p, n):
    cfg = decode_plan.decode_config(b, h, p, n)
    for v in (cfg.block_p, cfg.dstate_pad):
        assert v & (v - 1) == 0
    assert cfg.dstate_pad >= n and min(4, p) <= cfg.block_p <= 64
    assert cfg.block_p * cfg.dstate_pad <= decode_plan.TILE_ELEMS


def test_config_env_override(monkeypatch):
    monkeypatch.setenv("MAMBA2_CUTILE_DECODE_CONFIG", "block_p=32")
    assert decode_plan.decode_config(1, 8, 64, 128).block_p == 32
    monkeypatch.setenv("MAMBA2_CUTILE_DECODE_CONFIG", "nope=1")
    with pytest.raises(ValueError, match="nope"):
        decode_plan.decode_config(1, 8, 64, 128)


# ---------------------------------------------------------------------------------------------
# errors

def _bad(change_inp=None, change_kw=None, k=None):
    inp, kw = make(k=k, nslots=4)
    inp.update(change_inp or {})
    kw.update(change_kw or {})
    return inp, kw


@pytest.mark.parametrize("inp_change, kw_change, exc, match", [
    (dict(state=torch.randn(4, 6, 10)), {}, ValueError, "state must have 4"),
    (dict(state=torch.ones(4, 6, 10, 12, dtype=torch.int32)), {}, TypeError,
     "state must be a floating"),
    (dict(state=torch.randn(4, 6, 10, 1).expand(4, 6, 10, 12)), {}, ValueError,
     "state is written in place"),
    (dict(x=torch.randn(3, 6, 11)), {}, ValueError, "x must have shape"),
    (dict(x=torch.randn(3, 6)), {}, ValueError, "x must have 3 or 4"),
    (dict(x="nope"), {}, TypeError, "x must be a torch.Tensor"),
    (dict(dt=torch.rand(3, 6)), {}, ValueError, "dt must have 3"),
    (dict(dt=torch.rand(3, 5, 10)), {}, ValueError, "dt must have shape"),
    (dict(dt=torch.ones(3, 6, 10, dtype=torch.int64)), {}, TypeError, "dt must be a floating"),
    (dict(A=-torch.rand(6)), {}, ValueError, "A must have 3"),
    (dict(A=-torch.rand(6, 10, 13)), {}, ValueError, "A must have shape"),
    (dict(B=torch.randn(2, 3, 12)), {}, ValueError, "B must have shape"),
    (dict(B=torch.randn(3, 3, 13)), {}, ValueError, "B must have shape"),
    (dict(C=torch.randn(3, 2, 12)), {}, ValueError, "C must have shape"),
    (dict(B=torch.randn(3, 4, 12), C=torch.randn(3, 4, 12)), {}, ValueError,
     "ngroups .* must divide nheads"),
    ({}, dict(D=torch.randn(6, 3)), ValueError, "D must have shape"),
    ({}, dict(z=torch.randn(3, 6, 9)), ValueError, "z must have shape"),
    ({}, dict(dt_bias=torch.randn(5)), ValueError, "dt_bias must have shape"),
    ({}, dict(dt_softplus="yes"), TypeError, "dt_softplus"),
    ({}, dict(state_batch_indices=torch.zeros(3)), TypeError,
     "state_batch_indices must be an integer"),
    ({}, dict(state_batch_indices=torch.zeros(2, dtype=torch.int32)), ValueError,
     "state_batch_indices must have shape"),
    ({}, dict(state_batch_indices=torch.tensor([0, 4, 1], dtype=torch.int32)), ValueError,
     "must be < nslots"),
    ({}, dict(state_batch_indices=torch.tensor([0, 2, 2], dtype=torch.int32)), ValueError,
     "must not repeat"),
    (dict(state=torch.randn(2, 6, 10, 12)), {}, ValueError, "state has 2 slots"),
    ({}, dict(out_states=torch.randn(3, 2, 6, 10, 12)), ValueError, "out_states must have shape"),
    ({}, dict(out_states=torch.randn(3, 6, 10)), ValueError, "out_states must have 4 or 5"),
])
def test_bad_arguments(inp_change, kw_change, exc, match):
    inp, kw = _bad(inp_change, kw_change)
    with pytest.raises(exc, match=match):
        selective_state_update(**inp, **kw)


def test_bad_arguments_k_steps():
    inp, kw = _bad(k=2)
    with pytest.raises(ValueError, match="dt must have 4"):
        selective_state_update(**dict(inp, dt=inp["dt"][:, 0]), **kw)
    with pytest.raises(ValueError, match="B must have shape"):
        selective_state_update(**dict(inp, B=inp["B"][:, :1]), **kw)
    with pytest.raises(ValueError, match="out_states must have 5"):
        selective_state_update(**inp, **dict(kw, out_states=torch.randn(3, 6, 10, 12)))


def test_padding_rows_may_repeat():
    """Negative indices are padding and may repeat; y of those rows is zero."""
    inp, kw = make(nslots=4, idx=[-1, 2, -1])
    run_and_check(inp, kw)


def test_device_mismatch_error():
    inp, kw = make()
    inp["A"] = inp["A"].to("meta")
    with pytest.raises(ValueError, match="A is on meta"):
        selective_state_update(**inp, **kw)


# ---------------------------------------------------------------------------------------------
# every variant the dispatcher picks compiles (tileiras, no GPU)

@pytest.mark.compile
@pytest.mark.parametrize("arch, family, name, index", [
    pytest.param(arch, fam, name, i, id=f"{arch}-{tid}",
                 marks=(pytest.mark.slow,) if slow else ())
    for arch in ("sm_90", "sm_100")
    for tid, fam, name, i, slow in variants.distinct_launches(("decode",), arch)])
def test_variant_compiles(arch, family, name, index):
    pytest.importorskip("cuda.tile")
    from mamba2_cutile.bench import compile as cpu_compile

    assert len(plans.decode_problem_plan(**dict(variants.decode_variants())[name])) == 1
    assert cpu_compile.compile_call(variants.launch_of(family, name, index), arch) > 0


@pytest.mark.parametrize("spec, match", [("warps=2", "warps=2"), ("flat=2", "flat=2"),
                                         ("flat=1,persistent=2", "flat=1")])
def test_config_rejects(spec, match, monkeypatch):
    monkeypatch.setenv("MAMBA2_CUTILE_DECODE_CONFIG", spec)
    with pytest.raises(ValueError, match=match):
        decode_plan.decode_config(1, 8, 64, 128)


@pytest.mark.parametrize("spec, mem, persistent, grid", [
    # (LATENCY, LOAD_TMA, STORE_TMA, VEC_TMA, IN_BOUNDS: no bounds checks, every state tile
    # inside the state); the grid is (b, h, p tiles), or a 1-D one walked in memory order
    # (persistent: a fixed number per SM; flat: one program per tile)
    (dict(tma=1), (0, True, True, True, True), False, (4, 128, 2)),
    (dict(tma=0), (0, False, False, True, True), False, (4, 128, 2)),
    (dict(tma=0, unchecked=0), (0, False, False, True, False), False, (4, 128, 2)),
    (dict(tma=2), (0, True, False, True, True), False, (4, 128, 2)),
    (dict(tma=0, tma_vec=0, latency=5), (5, False, False, False, True), False, (4, 128, 2)),
    (dict(tma=0, flat=1), (0, False, False, True, True), True, (4 * 128 * 2, 1, 1)),
    (dict(tma=1, persistent=2), (0, True, True, True, True), True, (2 * 132, 1, 1)),
])
def test_memory_flags_and_grids(spec, mem, persistent, grid):
    cfg = decode_plan.DecodeConfig(block_p=32, dstate_pad=128, occupancy=4, **spec)
    (call,) = plans.decode_problem_plan(config=cfg)
    f = variants.variant_of(call)
    got = tuple(f[k] for k in ("LATENCY", "LOAD_TMA", "STORE_TMA", "VEC_TMA", "IN_BOUNDS"))
    assert got == mem and f["PERSISTENT"] == persistent and call.grid == grid


@pytest.mark.parametrize("headdim, dstate, block_n, k, checked", [
    (64, 128, 0, None, False), (80, 128, 0, None, True), (64, 96, 0, None, True),
    (64, 128, 32, None, False), (64, 96, 32, None, False), (64, 96, 64, None, True),
    (16, 16, 0, None, False),
    # block_n is for one-token calls only: with k = 3 the (padded) whole state is the tile
    (64, 96, 32, 3, True), (64, 128, 32, 3, False)])
def test_bounds_checks_only_where_a_tile_can_stick_out(headdim, dstate, block_n, k, checked):
    """The kernel drops its state bounds checks only when every tile lies inside the state:
    headdim a multiple of block_p and dstate of the state tile's width (the padded dstate, or
    block_n when walking dstate in slices)."""
    cfg = decode_plan.decode_config(4, 8, headdim, dstate)
    cfg = decode_plan.DecodeConfig(block_p=min(32, cfg.block_p), dstate_pad=cfg.dstate_pad,
                              tma=0, block_n=block_n)
    (call,) = plans.decode_problem_plan(batch=4, nheads=8, ngroups=2, headdim=headdim,
                                      dstate=dstate, k=k, config=cfg)
    assert variants.variant_of(call)["IN_BOUNDS"] == (not checked)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.int64])
def test_slots_to_int32_keep_their_meaning(dtype):
    """Every integer dtype the API takes converts to the kernel's int32 without an error, and
    without turning a padding or out-of-range slot into a real one."""
    vals = [0, 5, 100] + ([-1, -7] if dtype != torch.uint8 else [])
    if dtype == torch.int64:
        vals += [2**32 + 1, 2**40, -(2**40)]
    got = decode_api._slots_int32(torch.tensor(vals, dtype=dtype)).tolist()
    for v, g in zip(vals, got):
        if v < 0:
            assert g < 0, (v, g)                         # still a padding row
        else:
            assert g == min(v, 2**31 - 1), (v, g)        # the slot, or one past any state


@pytest.mark.parametrize("version, unchecked", [("13.4.92", True), ("13.10", True),
                                                ("13.3.0", False), ("unknown", False)])
def test_bounds_checks_kept_before_tileiras_13_4(version, unchecked, monkeypatch):
    """`check_bounds=False` needs tileiras 13.4; cuda-tile 1.7 also runs with 13.2/13.3."""
    monkeypatch.setattr(decode_plan, "tileiras_version", lambda: version)
    decode_plan._unchecked_supported.cache_clear()
    decode_plan._PLAN_CACHE.clear()
    try:
        (call,) = plans.decode_problem_plan(batch=4)
        assert variants.variant_of(call)["IN_BOUNDS"] == unchecked
    finally:
        decode_plan._unchecked_supported.cache_clear()
        decode_plan._PLAN_CACHE.clear()


def test_form_without_heads():
    """mamba_ssm's form without a head dimension (state (nslots, dim, n), x (batch, dim), ...)
    against its definition, with state slots, a padding row and out_states; y (batch, dim)."""
    F64 = torch.float64
    gen = torch.Generator().manual_seed(9)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    b, dim, n = 3, 5, 6
    state = r(4, dim, n)
    x, z, dt = r(b, dim), r(b, dim), torch.rand(b, dim, generator=gen, dtype=F64)
    A = -torch.rand(dim, n, generator=gen, dtype=F64)
    B, C, D, dt_bias = r(b, n), r(b, n), r(dim), r(dim)
    idx = torch.tensor([2, -1, 0])
    st, outs = state.clone(), torch.zeros(b, dim, n, dtype=F64)
    y = selective_state_update(st, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                               state_batch_indices=idx, out_states=outs)
    assert y.shape == (b, dim)
    want = state.clone()
    for row, slot in enumerate(idx.tolist()):
        if slot < 0:
            assert torch.equal(y[row], torch.zeros(dim, dtype=F64))
            continue
        d = torch.nn.functional.softplus(dt[row] + dt_bias)[:, None]
        want[slot] = state[slot] * torch.exp(d * A) + d * x[row][:, None] * B[row]
        yr = (want[slot] * C[row]).sum(-1) + D * x[row]
        # over 30 seeds: y within 8.9e-16, the state bit-equal
        torch.testing.assert_close(y[row], yr * z[row] * torch.sigmoid(z[row]), rtol=0,
                                   atol=5e-15)
        torch.testing.assert_close(outs[row], want[slot], rtol=0, atol=0)
    torch.testing.assert_close(st, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="dt must have 2 dimensions"):
        selective_state_update(st, x, dt[:, None], A, B, C)
    with pytest.raises(ValueError, match="state must have 4 dimensions"):
        selective_state_update(st, x[:, None], dt, A, B, C)


@pytest.mark.parametrize("flag,same_as", [(None, False), (np.bool_(True), True),
                                          (np.bool_(False), False), (torch.tensor(True), True)])
def test_dt_softplus_of_other_kinds(flag, same_as):
    """None (mamba_ssm's kernels read it as off), numpy bools and a 0-d bool tensor are flags."""
    inp, kw = make()
    want = selective_state_update(**{**inp, "state": inp["state"].clone()},
                                  **{**kw, "dt_softplus": same_as})
    got = selective_state_update(**{**inp, "state": inp["state"].clone()},
                                 **{**kw, "dt_softplus": flag})
    assert torch.equal(got, want)
    on = selective_state_update(**{**inp, "state": inp["state"].clone()},
                                **{**kw, "dt_softplus": not same_as})
    assert not torch.equal(on, want)
