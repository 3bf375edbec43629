"""CPU: `mamba_split_conv1d_scan_combined` against the float64 composition written from the
formulas (`reference.layer`: F.conv1d, the token recurrence, the explicit norm), outputs and
the gradients of every input; the custom ops pass opcheck; bad arguments name themselves."""

import math

import pytest
import torch
from support.grads import DOUBLE_BACKWARD

from layer_cases import TENSORS, Case, call, cotangents, leaves, make_inputs, reference
from mamba2_cutile.layer import mamba_split_conv1d_scan_combined as fused
from mamba2_cutile.layer import custom_ops, parts

#: float64: the chunked scan and the recurrence agree to rounding (measured at most 1.2e-15 on
#: the outputs and 3.1e-15 on the gradients over CASES); the final states are float32
#: (measured at most 3.6e-8: float32 rounding)
F64_TOL, FINAL_F32_TOL = 2e-14, 2e-7
#: float32 inputs, float32 arithmetic in the chunked scan and the parts: measured at most
#: 6.2e-7 on outputs, 1.3e-6 on final states and 2.2e-6 on gradients over CASES
F32_TOL = 5e-6

CASES = {
    "norm-before-gate": Case(),
    "norm-after-gate-mlp-seq-init-limit-Dp": Case(d_mlp=3, norm_before_gate=False,
                                                  D_per_channel=True, seq=True, init=True,
                                                  dt_limit=(0.02, 1.5), proj_bias=True),
    "z-in-scan-seq-init": Case(norm=False, seq=True, init=True),
    "z-in-scan-mlp-no-proj-no-act": Case(norm=False, d_mlp=2, out_dim=0, activation=None,
                                         conv_bias=False),
    "groups-norm-multi-chunk": Case(b=1, l=150, h=4, g=2, p=4, n=3, width=3, seq=True,
                                    init=True, proj_bias=True),
    "mlp-norm-no-proj-width2": Case(d_mlp=4, out_dim=0, width=2, norm_before_gate=False,
                                    D_per_channel=True, dt_limit=(0.0, 0.5)),
}


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def run_case(c, dtype, seed=0):
    t, seq = make_inputs(c, dtype=dtype, seed=seed)
    ours = leaves(t)
    out, final = call(fused, c, ours, seq, chunk_size=c.chunk_size, return_final_states=True)
    dout, dfin = cotangents(out.shape, final.shape, seed=seed + 1)
    ref_out, ref_final, ref_grads = reference(c, t, seq, dout, dfin)
    names = [k for k in TENSORS if ours[k] is not None]
    got = torch.autograd.grad([out, final], [ours[k] for k in names],
                              [dout.to(out.dtype), dfin.float()])
    return out, final, dict(zip(names, got)), ref_out, ref_final, ref_grads


@pytest.mark.parametrize("name", list(CASES))
def test_against_definition_float64(name):
    c = CASES[name]
    out, final, grads, ref_out, ref_final, ref_grads = run_case(c, torch.float64)
    assert out.dtype == torch.float64 and final.dtype == torch.float32
    assert out.shape == ref_out.shape and final.shape == ref_final.shape
    assert rel(out, ref_out) < F64_TOL
    assert rel(final, ref_final) < FINAL_F32_TOL
    assert set(grads) == set(ref_grads)
    for k, g in grads.items():
        assert g.dtype == torch.float64 and g.shape == ref_grads[k].shape, k
        assert rel(g, ref_grads[k]) < F64_TOL, f"d{k}: {rel(g, ref_grads[k]):.2e}"


@pytest.mark.parametrize("name", ["norm-after-gate-mlp-seq-init-limit-Dp", "z-in-scan-seq-init"])
def test_against_definition_float32(name):
    c = CASES[name]
    out, final, grads, ref_out, ref_final, ref_grads = run_case(c, torch.float32, seed=3)
    assert out.dtype == torch.float32
    assert rel(out, ref_out) < F32_TOL
    assert rel(final, ref_final) < F32_TOL
    for k, g in grads.items():
        assert g.dtype == torch.float32, k
        assert rel(g, ref_grads[k]) < F32_TOL, f"d{k}: {rel(g, ref_grads[k]):.2e}"


def test_return_conventions_and_unused_final():
    c = CASES["norm-before-gate"]
    t, seq = make_inputs(c)
    out = call(fused, c, t, seq, chunk_size=64)
    assert isinstance(out, torch.Tensor) and out.shape == (c.b, c.l, c.out_dim)
    # only out in the loss: the final state's cotangent is None, the gradients still match
    ours = leaves(t)
    y = call(fused, c, ours, seq, chunk_size=64)
    dout, _ = cotangents(y.shape, (c.b, c.h, c.p, c.n))
    names = [k for k in TENSORS if ours[k] is not None]
    got = torch.autograd.grad(y, [ours[k] for k in names], dout)
    _, _, ref = reference(c, t, seq, dout, torch.zeros(c.b, c.h, c.p, c.n, dtype=torch.float64))
    for k, g in zip(names, got):
        assert rel(g, ref[k]) < F64_TOL, k


def test_final_state_only_gradient():
    """Only the final state in the loss (out's cotangent None): the gradient flows through the
    scan and the convolution alone."""
    c = Case(init=True, seq=True)
    t, seq = make_inputs(c)
    ours = leaves(t)
    _, final = call(fused, c, ours, seq, chunk_size=64, return_final_states=True)
    _, dfin = cotangents((c.b, c.l, c.out_dim), final.shape, seed=4)
    got = torch.autograd.grad(final, [ours["zxbcdt"], ours["A"]], dfin.float())
    _, _, ref = reference(c, t, seq, torch.zeros(c.b, c.l, c.out_dim, dtype=torch.float64),
                          dfin)
    assert rel(got[0], ref["zxbcdt"]) < F64_TOL and rel(got[1], ref["A"]) < F64_TOL


def test_strided_zxbcdt_slice():
    """zxbcdt as a slice of a wider projection output (non-contiguous): same result."""
    c = CASES["z-in-scan-seq-init"]
    t, seq = make_inputs(c)
    wide = torch.randn(c.b, c.l, t["zxbcdt"].shape[-1] + 7, dtype=torch.float64)
    wide[..., 3:3 + t["zxbcdt"].shape[-1]] = t["zxbcdt"]
    view = dict(t, zxbcdt=wide[..., 3:3 + t["zxbcdt"].shape[-1]])
    assert not view["zxbcdt"].is_contiguous()
    torch.testing.assert_close(call(fused, c, view, seq, chunk_size=64),
                               call(fused, c, t, seq, chunk_size=64), rtol=0, atol=0)


def test_swiglu_parts_gradcheck():
    zx0 = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 4, dtype=torch.float64)
    (ref,) = torch.autograd.grad(parts.swiglu_forward(zx0), zx0, g)
    torch.testing.assert_close(parts.swiglu_backward(g, zx0.detach()), ref, rtol=0, atol=1e-14)


def _op_args(c, t, seq):
    return (t["zxbcdt"], t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"],
            t["initial_states"], seq, t["rmsnorm_weight"], t["outproj_weight"], t["outproj_bias"],
            c.chunk_size, c.p, c.g, c.dim // c.g, 1e-5, c.norm_before_gate, c.activation is not None,
            float(c.dt_limit[0]), float(c.dt_limit[1]))


@pytest.mark.parametrize("name", ["norm-after-gate-mlp-seq-init-limit-Dp",
                                  "z-in-scan-mlp-no-proj-no-act"])
def test_opcheck(name):
    c = CASES[name]
    t, seq = make_inputs(c)
    t = leaves(t)
    args = _op_args(c, t, seq)
    torch.library.opcheck(torch.ops.mamba2_cutile.split_conv1d_scan.default, args)
    dout, dfin = cotangents((c.b, c.l, c.out_dim or c.d_mlp + c.dim), (c.b, c.h, c.p, c.n))
    bwd_args = (dout, dfin.float()) + tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                            for a in args)
    torch.library.opcheck(torch.ops.mamba2_cutile.split_conv1d_scan_backward.default, bwd_args)


def test_torch_compile_fullgraph():
    c = CASES["norm-after-gate-mlp-seq-init-limit-Dp"]
    t, seq = make_inputs(c, dtype=torch.float32)

    def loss(**kw):
        out, final = call(fused, c, kw, seq, chunk_size=64, return_final_states=True)
        return (out * out).sum() + final.sum()
    a = leaves(t)
    eager = torch.autograd.grad(loss(**a), [a[k] for k in TENSORS if a[k] is not None])
    b = leaves(t)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(**b), [b[k] for k in TENSORS if b[k] is not None])
    for x, y in zip(got, eager):
        torch.testing.assert_close(x, y)


# --- errors --------------------------------------------------------------------------------

def _good():
    c = CASES["norm-after-gate-mlp-seq-init-limit-Dp"]
    t, seq = make_inputs(c)
    kw = dict(t)
    kw.update(seq_idx=seq, chunk_size=64, headdim=None, ngroups=c.g, dt_limit=c.dt_limit)
    return c, kw


def _call_kw(kw):
    kw = dict(kw)
    args = [kw.pop(k) for k in ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D",
                                "chunk_size")]
    return fused(*args, **kw)


BAD = [
    ("zxbcdt", lambda kw: kw["zxbcdt"][..., :-1], ValueError, "zxbcdt's last dimension"),
    ("zxbcdt", lambda kw: kw["zxbcdt"][0], ValueError, "zxbcdt must have 3"),
    ("zxbcdt", lambda kw: kw["zxbcdt"].to(torch.int32), TypeError, "zxbcdt must be"),
    ("conv1d_weight", lambda kw: kw["conv1d_weight"][:, None], ValueError, "conv1d_weight"),
    ("conv1d_weight", lambda kw: kw["conv1d_weight"][:-1], ValueError, "conv1d_weight"),
    ("conv1d_weight", lambda kw: kw["conv1d_weight"][:, :1], ValueError, "width in 2"),
    ("conv1d_bias", lambda kw: kw["conv1d_bias"][:-1], ValueError, "conv1d_bias"),
    ("dt_bias", lambda kw: kw["dt_bias"][:-1], ValueError, "dt_bias"),
    ("A", lambda kw: kw["A"][:, None], ValueError, "A must have 1"),
    ("D", lambda kw: kw["D"][:-1], ValueError, "D must have shape"),
    ("chunk_size", lambda kw: 100, ValueError, "chunk_size"),
    ("initial_states", lambda kw: kw["initial_states"][:1], ValueError, "initial_states"),
    ("seq_idx", lambda kw: kw["seq_idx"].float(), TypeError, "seq_idx"),
    ("seq_idx", lambda kw: kw["seq_idx"].flip(1), ValueError, "non-decreasing"),
    ("rmsnorm_weight", lambda kw: kw["rmsnorm_weight"][:-1], ValueError, "rmsnorm_weight"),
    ("outproj_weight", lambda kw: kw["outproj_weight"][:, :-1], ValueError, "outproj_weight"),
    ("outproj_bias", lambda kw: kw["outproj_bias"][:-1], ValueError, "outproj_bias"),
    ("ngroups", lambda kw: 3, ValueError, "ngroups"),
    ("headdim", lambda kw: 5, ValueError, "headdim"),
    ("dt_limit", lambda kw: (1.0, 0.5), ValueError, "dt_limit"),
    ("dt_limit", lambda kw: "x", TypeError, "dt_limit"),
    ("activation", lambda kw: "relu", ValueError, "activation"),
    ("rmsnorm_eps", lambda kw: -1.0, ValueError, "rmsnorm_eps"),
    ("rmsnorm_eps", lambda kw: float("inf"), ValueError, "rmsnorm_eps"),
    ("state_dtype", lambda kw: torch.int8, TypeError, "state_dtype"),
]


@pytest.mark.parametrize("arg,make,exc,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_argument_named(arg, make, exc, match):
    _, kw = _good()
    kw[arg] = make(kw)
    with pytest.raises(exc, match=match):
        _call_kw(kw)


def test_missing_headdim_and_bias_without_weight():
    c, kw = _good()
    kw["D"] = kw["D"][:, 0].contiguous()            # per head: headdim is needed
    with pytest.raises(ValueError, match="headdim is required"):
        _call_kw(kw)
    _, kw = _good()
    kw["outproj_weight"] = None
    with pytest.raises(ValueError, match="outproj_bias requires outproj_weight"):
        _call_kw(kw)


def test_device_mismatch_named():
    _, kw = _good()
    kw["A"] = kw["A"].to("meta")
    with pytest.raises(ValueError, match="A is on meta"):
        _call_kw(kw)


def test_good_call_passes():
    _, kw = _good()
    out = _call_kw(kw)
    assert torch.isfinite(out).all() and not math.isnan(out.sum().item())


def test_cuda_backward_branch_plumbing(monkeypatch):
    """The backward op's CUDA branch on the CPU: `backward_impl` says "cutile" and the scan's
    cuTile entry point is replaced by its PyTorch stages (the same math), so the call into
    `ssd.backward.ssd_backward_cuda` (arguments, cotangents, gradient dict) runs here."""
    from mamba2_cutile.reference import chunked_backward
    from mamba2_cutile.ssd import backward, custom_ops as ssd_ops

    calls = []

    def stages(x, dt, A, B, C, chunk_size, dout, dfinal_states=None, **kw):
        calls.append(chunk_size)
        return chunked_backward.ssd_chunked_backward(x, dt, A, B, C, chunk_size, dout,
                                                     dfinal_states, dtype=torch.float64, **kw)
    monkeypatch.setattr(ssd_ops, "backward_impl", lambda x: "cutile")
    monkeypatch.setattr(backward, "ssd_backward_cuda", stages)
    c = CASES["norm-after-gate-mlp-seq-init-limit-Dp"]
    out, final, grads, _, _, ref_grads = run_case(c, torch.float64)
    assert calls == [c.chunk_size]
    for k, g in grads.items():
        assert rel(g, ref_grads[k]) < F64_TOL, k


def test_int64_seq_idx_same_result():
    c = CASES["z-in-scan-seq-init"]
    t, seq = make_inputs(c)
    torch.testing.assert_close(call(fused, c, t, seq.long(), chunk_size=64),
                               call(fused, c, t, seq, chunk_size=64), rtol=0, atol=0)


@pytest.mark.parametrize("checked", [True, False])
def test_int64_seq_idx_past_int32_same_result(monkeypatch, checked):
    """ids past int32 are taken, as the scan alone takes them, and keep their sequences apart
    in the convolution (no saturation onto one id), whether values are checked (CPU) or not
    (the GPU's default, torch.compile)."""
    from mamba2_cutile.layer import fused as fused_mod
    c = CASES["z-in-scan-seq-init"]
    t, seq = make_inputs(c)
    want = call(fused, c, t, seq, chunk_size=64)
    if not checked:
        monkeypatch.setattr(fused_mod, "value_checks_enabled", lambda on_cuda: False)
    for base in (2**31, 2**40):
        got = call(fused, c, t, seq.long() + base, chunk_size=64)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("norm", [True, False])
def test_short_and_empty_sequences(norm):
    """One token (shorter than the convolution) against the definition; no tokens: out is
    empty, the final state is the initial one and passes its cotangent straight back."""
    c = Case(l=1, init=True, d_mlp=2, norm=norm)
    out, final, grads, ref_out, ref_final, ref_grads = run_case(c, torch.float64)
    assert rel(out, ref_out) < F64_TOL and rel(final, ref_final) < FINAL_F32_TOL
    for k, g in grads.items():
        assert rel(g, ref_grads[k]) < F64_TOL, k
    c = Case(l=0, init=True, d_mlp=2, norm=norm)
    t = leaves(make_inputs(c)[0])
    out, final = call(fused, c, t, None, chunk_size=64, return_final_states=True)
    assert out.shape == (c.b, 0, c.out_dim)
    torch.testing.assert_close(final, t["initial_states"].detach().float())
    dfin = torch.randn(final.shape)
    g_init, g_A = torch.autograd.grad(final, [t["initial_states"], t["A"]], dfin)
    torch.testing.assert_close(g_init, dfin.double())
    assert (g_A == 0).all()


def test_eager_call_equals_the_op():
    """An eager call with gradients runs `_EagerLayer` (the op's body and backward, no
    dispatch): outputs and every gradient bit-equal to the op's; a double backward raises on
    both paths."""
    c = CASES["norm-after-gate-mlp-seq-init-limit-Dp"]
    t, seq = make_inputs(c)
    dout, dfin = cotangents((c.b, c.l, c.out_dim or c.d_mlp + c.dim), (c.b, c.h, c.p, c.n))
    results = []
    for path in ("eager", "op"):
        lv = leaves(t)
        args = _op_args(c, lv, seq)
        fn = custom_ops.split_conv1d_scan_call if path == "eager" else \
            torch.ops.mamba2_cutile.split_conv1d_scan
        out, fin = fn(*args)
        assert (type(out.grad_fn).__name__ == "_EagerLayerBackward") == (path == "eager")
        wrt = [v for v in lv.values() if v is not None and v.requires_grad]
        results.append((out, fin) + torch.autograd.grad([out, fin], wrt, [dout, dfin.float()],
                                                           retain_graph=True))
        (g0,) = torch.autograd.grad(out, [wrt[0]], dout, create_graph=True)
        with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD[path]):
            g0.sum().backward()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cpu_autocast_keeps_float32():
    """Under torch.autocast on the CPU the float32 layer (no out projection, the one op that
    autocast may lower) computes in float32, as the kernels do: bit-equal to a call outside."""
    c = CASES["z-in-scan-mlp-no-proj-no-act"]
    t, seq = make_inputs(c, dtype=torch.float32, seed=1)
    want = call(fused, c, t, seq, chunk_size=c.chunk_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = call(fused, c, t, seq, chunk_size=c.chunk_size)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_numpy_integer_sizes():
    """numpy integers for chunk_size, headdim and ngroups (a config's values) give the same
    result as Python ints."""
    np = pytest.importorskip("numpy")
    c = CASES["z-in-scan-seq-init"]
    t, seq = make_inputs(c)
    want = call(fused, c, t, seq, chunk_size=64)
    got = call(fused, c, t, seq, chunk_size=np.int64(64))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
