"""CPU: gradients. The reference's autograd (float64) against finite differences; the public
function's autograd (the custom op's registered backward, `chunked_backward`) against the
float64 recurrence's autograd; the op passes torch.library.opcheck; torch.compile traces a
model that calls it without a graph break."""

import pytest
import torch
from support.grads import DOUBLE_BACKWARD

from mamba2_cutile import mamba_chunk_scan_combined, reference
from mamba2_cutile.eager import eager_call_ok

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def tiny(seed=0, b=1, l=7, h=2, g=1, p=3, n=2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(x=r(b, l, h, p), dt=r(b, l, h) * 0.5, A=-torch.rand(h, generator=gen,
                dtype=dtype) - 0.5, B=r(b, l, g, n), C=r(b, l, g, n), D=r(h, p),
                z=r(b, l, h, p), dt_bias=r(h) * 0.1, initial_states=r(b, h, p, n))


@pytest.mark.parametrize("with_seq", [False, True])
def test_reference_gradcheck(with_seq):
    inp = tiny()
    seq = torch.tensor([[0, 0, 0, 1, 1, 2, 2]], dtype=torch.int32) if with_seq else None
    keys = list(inp)

    def f(*ts):
        kw = dict(zip(keys, ts))
        y, h, _ = reference.ssd_recurrence(**kw, seq_idx=seq, dt_softplus=True,
                                           dt_limit=(0.05, 2.0))
        return y, h

    ts = tuple(t.requires_grad_(True) for t in inp.values())
    assert torch.autograd.gradcheck(f, ts, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_public_function_gradients(dtype):
    inp = tiny(l=150, b=2, h=4, g=2, p=5, n=6, seed=1, dtype=dtype)
    seq = torch.zeros(2, 150, dtype=torch.int32)
    seq[0, 40:] = 1
    seq[0, 64:] = 2
    kw = dict(seq_idx=seq, dt_softplus=True, dt_limit=(0.01, 1.0))
    gen = torch.Generator().manual_seed(5)
    g_out = torch.randn(2, 150, 4, 5, generator=gen, dtype=torch.float64)
    g_fin = torch.randn(2, 4, 5, 6, generator=gen).double()   # final_states are float32

    ref_leaves = {k: v.double().clone().requires_grad_(True) for k, v in inp.items()}
    y, h, _ = reference.ssd_recurrence(**ref_leaves, **kw)
    ref = torch.autograd.grad([y, h], [ref_leaves[k] for k in NAMES], [g_out, g_fin])

    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
    y2, h2 = mamba_chunk_scan_combined(**leaves, chunk_size=64, return_final_states=True, **kw)
    got = torch.autograd.grad([y2, h2], [leaves[k] for k in NAMES],
                              [g_out.to(y2.dtype), g_fin.float()])
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    for k, r, g in zip(NAMES, ref, got):
        assert g.dtype == dtype
        err = ((g.double() - r).abs().max() / r.abs().max()).item()
        assert err < tol, f"d{k}: relative error {err:.2e}"


def test_varlen_states_carry_no_gradient():
    inp = {k: v.requires_grad_(True) for k, v in tiny(l=20).items()}
    seq = torch.zeros(1, 20, dtype=torch.int32)
    seq[0, 8:] = 1
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    y, v = mamba_chunk_scan_combined(**inp, chunk_size=64, seq_idx=seq, cu_seqlens=cu,
                                     return_varlen_states=True)
    assert y.requires_grad and not v.requires_grad


def _op_args(inp, seq=None, cu=None):
    return (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 64, inp["D"], inp["z"],
            inp["dt_bias"], inp["initial_states"], seq, cu, True, 0.01, 2.0, torch.float64)


def test_opcheck():
    inp = {k: v.requires_grad_(True) for k, v in tiny(l=20, b=2, h=2, g=1).items()}
    seq = torch.zeros(2, 20, dtype=torch.int32)
    seq[:, 9:] = 1
    torch.library.opcheck(torch.ops.mamba2_cutile.ssd_forward.default, _op_args(inp, seq))
    one = {k: (v[:1] if v.dim() > 1 and v.shape[0] == 2 and k not in ("D",) else v)
           for k, v in tiny(l=20, b=1).items()}
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    torch.library.opcheck(torch.ops.mamba2_cutile.ssd_forward.default,
                          _op_args(one, seq[:1], cu))


def test_torch_compile_no_graph_break():
    inp = tiny(l=40, b=2, h=4, g=2, p=4, n=3, dtype=torch.float32)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.zeros(4))
            self.D = torch.nn.Parameter(torch.ones(4))

        def forward(self, x, dt, B, C):
            return mamba_chunk_scan_combined(x, dt, -torch.exp(self.A_log), B, C, 64, D=self.D,
                                             dt_softplus=True)

    model = Block()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    args = [inp["x"].requires_grad_(True), inp["dt"], inp["B"], inp["C"]]
    y_eager = model(*args)
    y_comp = compiled(*args)
    torch.testing.assert_close(y_comp, y_eager)
    y_comp.sum().backward()
    g_comp = model.A_log.grad.clone()
    model.A_log.grad = None
    y_eager.sum().backward()
    torch.testing.assert_close(g_comp, model.A_log.grad)


@pytest.fixture
def cutile_backward_on_cpu(monkeypatch):
    """The CUDA backward's plumbing on the CPU: `backward_impl` says "cutile", and the kernels'
    entry point is replaced by the PyTorch stages (the same math), so the opaque op
    `mamba2_cutile::ssd_backward_cuda`, its fake impl and the autograd glue run here."""
    from mamba2_cutile.reference import chunked_backward
    from mamba2_cutile.ssd import backward, custom_ops as ops

    calls = []

    def stages(x, dt, A, B, C, chunk_size, dout, dfinal_states=None, **kw):
        calls.append(type(x).__name__)
        kw.pop("state_dtype", None), kw.pop("config", None)
        if dout is None:
            dout = torch.zeros_like(x)
        return chunked_backward.ssd_chunked_backward(x, dt, A, B, C, chunk_size, dout,
                                                     dfinal_states, dtype=torch.float64, **kw)
    monkeypatch.setattr(ops, "backward_impl", lambda x: "cutile")
    monkeypatch.setattr(backward, "ssd_backward_cuda", stages)
    return calls


def test_backward_op_opcheck(cutile_backward_on_cpu):
    inp = tiny(l=20, b=2)
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(inp["x"].shape, generator=gen, dtype=torch.float64)
    dfin = torch.randn(inp["initial_states"].shape, generator=gen, dtype=torch.float64)
    op = torch.ops.mamba2_cutile.ssd_backward_cuda.default
    torch.library.opcheck(op, (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 64, dout, dfin,
                               inp["D"], inp["z"], inp["dt_bias"], inp["initial_states"], None,
                               True, 0.01, 2.0))
    # absent optional inputs: empty placeholders, mapped back to None by the autograd glue
    torch.library.opcheck(op, (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 64, dout, None,
                               None, None, None, None, None, False, 0.0, float("inf")))


def test_compiled_step_with_cuda_backward_path(cutile_backward_on_cpu):
    """torch.compile (fullgraph) of forward + backward through the opaque backward op gives the
    eager gradients: the op's fake impl traces, nothing traces into the kernels."""
    inp = tiny(l=40, b=2, h=4, g=2, p=4, n=3)
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}

    def loss(**kw):
        y = mamba_chunk_scan_combined(**kw, chunk_size=64, dt_softplus=True)
        return (y * y).sum()
    eager = torch.autograd.grad(loss(**leaves), list(leaves.values()))
    assert cutile_backward_on_cpu == ["Tensor"]
    leaves2 = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
    step = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(step(**leaves2), list(leaves2.values()))
    for k, a, b in zip(leaves, eager, got):
        torch.testing.assert_close(b, a, msg=f"d{k}")
    assert cutile_backward_on_cpu == ["Tensor", "Tensor"]   # run, never traced into


def _op_call(inp, seq=None):
    """The public function's outputs and gradients, through the custom op itself."""
    op = torch.ops.mamba2_cutile.ssd_forward
    y, fin, _ = op(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 64, inp["D"], inp["z"],
                   inp["dt_bias"], inp["initial_states"], seq, None, True, 0.0, float("inf"),
                   torch.float64)
    return y, fin


def test_eager_call_bypasses_the_op_and_equals_it(cutile_backward_on_cpu):
    """An eager call with gradients runs `_EagerScan` (the op's body and backward, no
    dispatch): outputs and gradients bit-equal to the op's; without gradients the body alone;
    a double backward through the CUDA backward raises as through the op, whether or not the
    cotangent has a graph (never a silent constant)."""
    inp = tiny(l=70, b=2, h=4, g=2, p=3, n=5, seed=4)
    seq = torch.zeros(2, 70, dtype=torch.int32)
    seq[1, 30:] = 1
    gen = torch.Generator().manual_seed(9)
    g_out = torch.randn(2, 70, 4, 3, generator=gen, dtype=torch.float64)
    g_fin = torch.randn(2, 4, 3, 5, generator=gen, dtype=torch.float32)
    results = []
    for path in ("eager", "op"):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
        if path == "eager":
            y, fin = mamba_chunk_scan_combined(**leaves, chunk_size=64, seq_idx=seq,
                                               dt_softplus=True, return_final_states=True)
            assert type(y.grad_fn).__name__ == "_EagerScanBackward"
        else:
            y, fin = _op_call(leaves, seq)
        grads = torch.autograd.grad([y, fin], list(leaves.values()), [g_out, g_fin])
        results.append((y, fin) + grads)
    assert cutile_backward_on_cpu == ["Tensor", "Tensor"]      # both took the CUDA branch
    for name, a, b in zip(("y", "final") + NAMES, *results):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

    with torch.no_grad():
        y = mamba_chunk_scan_combined(**inp, chunk_size=64)
    assert y.grad_fn is None and eager_call_ok((inp["x"], 3))

    for path in ("eager", "op"):      # a constant cotangent, then one that has a graph
        for cot in (lambda y: g_out, lambda y: 2 * y):
            leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
            y = (mamba_chunk_scan_combined(**leaves, chunk_size=64, dt_softplus=True)
                 if path == "eager" else _op_call(leaves)[0])
            (gx,) = torch.autograd.grad(y, [leaves["x"]], cot(y), create_graph=True)
            assert gx.requires_grad
            with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD[path]):
                gx.sum().backward()


def test_eager_call_double_backward_on_the_torch_backward():
    """Off the CUDA backward (the PyTorch stages), the eager path keeps the op's double
    backward: the second derivative equals the op's."""
    inp = tiny(l=30, seed=2)
    out = []
    for path in ("eager", "op"):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
        y = (mamba_chunk_scan_combined(**leaves, chunk_size=64, dt_softplus=True)
             if path == "eager" else _op_call(leaves)[0])
        (gx,) = torch.autograd.grad((y * y).sum(), [leaves["x"]], create_graph=True)
        out.append(torch.autograd.grad(gx.sum(), [leaves["dt"]])[0])
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def test_fake_and_meta_tensors_take_the_op():
    """Under FakeTensorMode, and for meta tensors, the call goes through the op (its fake
    implementation): shapes come out, nothing runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inp = tiny(l=20, b=2)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in inp.items()}
        assert not eager_call_ok(tuple(fake.values()))
        y, fin = mamba_chunk_scan_combined(**fake, chunk_size=64, return_final_states=True)
        assert y.shape == inp["x"].shape and fin.shape == inp["initial_states"].shape
    meta = {k: v.to("meta") for k, v in inp.items()}
    assert not eager_call_ok(tuple(meta.values()))
    assert mamba_chunk_scan_combined(**meta, chunk_size=64).device.type == "meta"


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    """torch.utils.checkpoint (non-reentrant: transformers' gradient_checkpointing_enable(),
    which allows one unpack of each saved tensor) gives the plain run's gradients."""
    from torch.utils.checkpoint import checkpoint
    inp = tiny(l=70)
    kw = {k: inp[k] for k in ("D", "z", "dt_bias", "initial_states")}

    def grads(ckpt):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
        f = lambda x, B: mamba_chunk_scan_combined(  # noqa: E731
            x, leaves["dt"], leaves["A"], B, leaves["C"], 64, dt_softplus=True,
            **{k: leaves[k] for k in kw})
        y = checkpoint(f, leaves["x"], leaves["B"], use_reentrant=reentrant) if ckpt else \
            f(leaves["x"], leaves["B"])
        (y * torch.linspace(-1, 1, y.shape[1], dtype=y.dtype)[None, :, None, None]).sum() \
            .backward()
        return {k: v.grad for k, v in leaves.items()}

    got, want = grads(True), grads(False)
    for k in NAMES:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def test_opaque_backward_unpacks_saved_tensors_once():
    """The CUDA paths' eager backward (`eager.opaque_backward`) reads ctx.saved_tensors once,
    so a non-reentrant checkpoint around it works (a second unpack raises there)."""
    from torch.utils.checkpoint import checkpoint

    from mamba2_cutile.eager import opaque_backward

    def square_backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (2 * x * g,)

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        backward = staticmethod(opaque_backward(square_backward, "square"))

    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    checkpoint(Square.apply, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())
