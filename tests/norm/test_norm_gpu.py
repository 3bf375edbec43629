"""GPU: the cuTile gated RMSNorm against the float64 definition (`reference.norm`) on the same
rounded inputs, forward and backward, over dtypes, gate orders, bias, groups, hidden sizes that
are not powers of two and row counts that are not multiples of the tiles; strided x and z (the
Mamba-2 layer's slices of its input projection); the chunked kernels (group widths m * 2^k)
at real model widths, every config the candidate sweep times, chunked against padded;
determinism; CUDA-graph capture; torch.compile; 64-bit indexing (padded and chunked); and
mamba_ssm's Triton rmsnorm_fn on the same inputs (skipped
when mamba_ssm is not importable or MAMBA2_TEST_COMPARE_MAMBA=0).

Tolerances, on max|got - ref| / max|ref| (support.gpu.rel_err), from the error each result
must carry; every check logs its error (support.gpu.log_result) so that a GPU run records them:

- results stored in bf16 / fp16 (out, dx, dz, and dweight / dbias of bf16 parameters) are the
  float32 value rounded once: at most the unit roundoff times max|ref|, 2^-8 = 3.9e-3 and
  2^-11 = 4.9e-4, plus float32 arithmetic; the bounds are 2x that, 8e-3 and 1e-3 (the same
  checks on the CPU path, which rounds the same way, measured at most 3.7e-3 and 4.3e-4);
- float32 results carry float32 arithmetic only: the CPU path measured at most 3.6e-7 on
  these tests (sums of up to 16384 squares, exp, one division); the bound is 2e-6;
- float32 dweight / dbias are sums over all rows (per-program partials, then a sum over the
  programs): the CPU path measured at most 2.6e-7; the bound is 2e-6.
"""

import pytest
import torch

from mamba2_cutile.norm import rmsnorm_fn
from mamba2_cutile.reference.norm import rmsnorm_gated_ref
from support.gpu import _require, log_result, rel_err

pytestmark = pytest.mark.gpu

BF, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
TOL = {BF: 8e-3, F16: 1e-3, F32: 2e-6}
PARAM_SUM_TOL = 2e-6         # float32 dweight / dbias
MAMBA_FACTOR = 1.5           # ours may be at most 1.5x mamba_ssm's error, plus a tenth of TOL


def tol_of(dtype, reduced=False):
    return PARAM_SUM_TOL if reduced and dtype == F32 else TOL[dtype]


#: (rows, hidden, group_size): the Mamba-2 sizes (1 and 8 groups), hidden not a power of two,
#: rows not a multiple of any tile, a tiny odd hidden, groups of 1, the largest group
SHAPES = [(1000, 1536, None), (333, 5120, None), (517, 2560, 320), (1025, 8192, 1024),
          (77, 37, None), (300, 64, 1), (129, 16384, None), (2049, 4096, 512)]
OPTIONS = [(True, True, False), (True, False, True), (False, True, True), (True, True, True)]


def make(rows, hidden, dtype, has_z=True, has_bias=False, param_dtype=F32, seed=0,
         row_stride=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    stride = row_stride or hidden
    x = (r(rows, stride) * 2 + 0.3).to(dtype)[:, :hidden]
    z = (r(rows, stride) * 2).to(dtype)[:, stride - hidden:] if has_z else None
    w = (1 + 0.5 * r(hidden)).to(param_dtype)
    b = (0.3 * r(hidden)).to(param_dtype) if has_bias else None
    return x, w, b, z


def reference(x, w, b, z, eps, gs, nbg, dout=None):
    """The float64 definition on the same (rounded) inputs; with dout also its gradients."""
    leaves = [None if t is None else t.detach().to(F64).requires_grad_() for t in (x, w, b, z)]
    out = rmsnorm_gated_ref(leaves[0], leaves[1], leaves[2], leaves[3], eps=eps, group_size=gs,
                            norm_before_gate=nbg)
    if dout is None:
        return out.detach(), None
    out.backward(dout.to(F64))
    return out.detach(), [None if t is None else t.grad for t in leaves]


def ours(x, w, b, z, eps, gs, nbg, dout=None):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w, b, z)]
    out = rmsnorm_fn(leaves[0], leaves[1], leaves[2], z=leaves[3], eps=eps, group_size=gs,
                     norm_before_gate=nbg)
    if dout is None:
        return out.detach(), None
    out.backward(dout)
    return out.detach(), [None if t is None else t.grad for t in leaves]


NAMES = ("dx", "dweight", "dbias", "dz")


def _check_grads(tag, got, ref, dtypes):
    for name, g, rf, dt in zip(NAMES, got, ref, dtypes):
        if rf is None:
            assert g is None, name
            continue
        assert g.dtype == dt, (name, g.dtype, dt)
        e = rel_err(g, rf)
        t = tol_of(dt, reduced=name in ("dweight", "dbias"))
        log_result(f"{tag} {name} err {e:.3e} tol {t:.1e}")
        assert e <= t, (name, e, t)


@pytest.mark.parametrize("rows, hidden, gs", SHAPES)
@pytest.mark.parametrize("has_z, nbg, has_bias", OPTIONS)
@pytest.mark.parametrize("dtype", [BF, F16, F32])
def test_forward_backward_against_float64(rows, hidden, gs, has_z, nbg, has_bias, dtype):
    x, w, b, z = make(rows, hidden, dtype, has_z, has_bias)
    dout = torch.randn(rows, hidden, device="cuda").to(dtype)
    out, grads = ours(x, w, b, z, 1e-5, gs, nbg, dout)
    ref, rgrads = reference(x, w, b, z, 1e-5, gs, nbg, dout)
    assert out.dtype == dtype and out.shape == x.shape
    e = rel_err(out, ref)
    log_result(f"out err {e:.3e} tol {TOL[dtype]:.1e}")
    assert e <= TOL[dtype]
    _check_grads("", grads, rgrads, (dtype, w.dtype, None if b is None else b.dtype,
                                     None if z is None else z.dtype))


@pytest.mark.parametrize("param_dtype, z_dtype", [(BF, BF), (F32, F32), (BF, F32)])
def test_mixed_dtypes(param_dtype, z_dtype):
    """bf16 x with bf16 or fp32 weight/bias and an fp32 z: each gradient in its input's dtype."""
    x, w, b, _ = make(700, 1536, BF, has_z=False, has_bias=True, param_dtype=param_dtype)
    z = torch.randn(700, 1536, device="cuda").to(z_dtype)
    dout = torch.randn(700, 1536, device="cuda").to(BF)
    out, grads = ours(x, w, b, z, 1e-6, 192, True, dout)
    ref, rgrads = reference(x, w, b, z, 1e-6, 192, True, dout)
    assert rel_err(out, ref) <= TOL[BF]
    _check_grads("mixed", grads, rgrads, (BF, param_dtype, param_dtype, z_dtype))


@pytest.mark.parametrize("dtype", [BF, F32])
@pytest.mark.parametrize("nbg", [True, False])
def test_layer_slices_of_projection(dtype, nbg):
    """The Mamba-2 layer's call: y (batch, seqlen, dim) and z a strided slice of the input
    projection (read in place), group_size = dim // ngroups; gradients reach the projection."""
    batch, seqlen, dim, ngroups = 2, 1031, 2560, 8
    gen = torch.Generator(device="cuda").manual_seed(3)
    proj = (torch.randn(batch, seqlen, 2 * dim + 300, generator=gen, device="cuda")).to(dtype)
    y = torch.randn(batch, seqlen, dim, generator=gen, device="cuda").to(dtype)
    w = (1 + 0.5 * torch.randn(dim, generator=gen, device="cuda"))
    dout = torch.randn(batch, seqlen, dim, generator=gen, device="cuda").to(dtype)
    results = {}
    for impl in ("ours", "ref"):
        p = proj.detach().clone().to(F64 if impl == "ref" else dtype).requires_grad_()
        yy = y.detach().clone().to(F64 if impl == "ref" else dtype).requires_grad_()
        ww = w.detach().clone().to(F64 if impl == "ref" else F32).requires_grad_()
        z = p[..., :dim]
        if impl == "ours":
            out = rmsnorm_fn(yy, ww, None, z=z, eps=1e-5, group_size=dim // ngroups,
                             norm_before_gate=nbg)
        else:
            out = rmsnorm_gated_ref(yy, ww, None, z, eps=1e-5, group_size=dim // ngroups,
                                    norm_before_gate=nbg)
        out.backward(dout.to(out.dtype))
        results[impl] = (out.detach(), yy.grad, ww.grad, p.grad)
    for name, g, r in zip(("out", "dy", "dweight", "dproj"), results["ours"], results["ref"]):
        e = rel_err(g, r)
        t = tol_of(g.dtype, reduced=name == "dweight")
        log_result(f"{name} err {e:.3e} tol {t:.1e}")
        assert e <= t, (name, e)
    assert float(results["ours"][3][..., dim:].abs().max()) == 0.0   # only z's part has a grad


@pytest.mark.parametrize("hidden", [2048, 1536])       # the padded and the chunked kernels
def test_deterministic(hidden):
    x, w, b, z = make(4099, hidden, BF, has_bias=True)
    dout = torch.randn(4099, hidden, device="cuda").to(BF)
    first = ours(x, w, b, z, 1e-5, None, True, dout)
    for _ in range(3):
        again = ours(x, w, b, z, 1e-5, None, True, dout)
        assert torch.equal(again[0], first[0])
        for g1, g2 in zip(again[1], first[1]):
            assert torch.equal(g1, g2)


def test_cuda_graph_capture():
    """Forward + backward captured in one CUDA graph and replayed on new inputs: no host
    synchronization in either, same results as eager."""
    x, w, _, z = make(1000, 1536, BF)
    dout = torch.randn(1000, 1536, device="cuda").to(BF)
    xs, zs, ws = (t.detach().clone().requires_grad_() for t in (x, z, w))

    def step():
        out = rmsnorm_fn(xs, ws, None, z=zs, group_size=192, norm_before_gate=False)
        return (out,) + torch.autograd.grad(out, (xs, ws, zs), dout)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x2, w2, _, z2 = make(1000, 1536, BF, seed=9)
    with torch.no_grad():
        xs.copy_(x2), zs.copy_(z2), ws.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for c, e in zip(captured, eager):
        assert torch.equal(c, e)


def test_torch_compile_inductor():
    torch._dynamo.reset()
    x, w, _, z = make(515, 1024, BF, row_stride=3000)
    dout = torch.randn(515, 1024, device="cuda").to(BF)

    def f(x, w, z):
        return rmsnorm_fn(x * 1.5, w, None, z=z, eps=1e-5, group_size=128) + 1.0
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, z)]
    out_c = torch.compile(f, fullgraph=True)(*leaves)
    g_c = torch.autograd.grad(out_c, leaves, dout)
    leaves_e = [t.detach().clone().requires_grad_() for t in (x, w, z)]
    out_e = f(*leaves_e)
    g_e = torch.autograd.grad(out_e, leaves_e, dout)
    assert rel_err(out_c, out_e) <= TOL[BF] / 10
    for a, e in zip(g_c, g_e):
        assert rel_err(a, e) <= TOL[BF] / 10


@pytest.mark.parametrize("hidden, gs", [(2048, 256), (1536, 1536)])   # padded, chunked
def test_int64_indexing(hidden, gs):
    """2**31 + elements: the 64-bit variants. Rows are independent, so the first and the last
    rows (addresses past 2**31 elements) are checked against the float64 definition of those
    rows alone, forward and dx, dz."""
    rows = 2**31 // hidden + 7
    if torch.cuda.get_device_properties(0).total_memory < 60 * 2**30:
        pytest.skip("needs 60 GiB of GPU memory")
    x = torch.randn(rows, hidden, device="cuda", dtype=BF).requires_grad_()
    z = torch.randn(rows, hidden, device="cuda", dtype=BF).requires_grad_()
    w = torch.rand(hidden, device="cuda") + 0.5
    dout = torch.randn(rows, hidden, device="cuda", dtype=BF)
    out = rmsnorm_fn(x, w, None, z=z, group_size=gs)
    dx, dz = torch.autograd.grad(out, (x, z), dout)
    for part in (slice(0, 3000), slice(rows - 3000, rows)):
        ref, (rdx, _, _, rdz) = reference(x[part], w, None, z[part], 1e-6, gs, True,
                                          dout[part])
        for name, got, want in (("out", out[part], ref), ("dx", dx[part], rdx),
                                ("dz", dz[part], rdz)):
            e = rel_err(got, want)
            log_result(f"rows {part.start}.. {name} err {e:.3e} tol {TOL[BF]:.1e}")
            assert e <= TOL[BF], (part, name, e)


# ------------------------------------------------------------ chunked and padded kernels, configs

#: (rows, hidden, group_size): the chunked kernels at the other widths m * 2^k of real models
#: (3072 = 3 * 1024, 10240 = 5 * 2048 in 1024-chunks, six groups of 1536) and widths the rule
#: pads (7680 = 15 * 512 in 8192; 15360 = 15 * 1024, past the chunked limit; 1000 = 125 * 8);
#: rows not multiples of the tiles
CHUNKED_SHAPES = [(1001, 3072, None), (257, 7680, None), (129, 10240, None), (65, 15360, None),
                  (333, 9216, 1536), (300, 1000, None)]


@pytest.mark.parametrize("rows, hidden, gs", CHUNKED_SHAPES)
@pytest.mark.parametrize("has_z, nbg, has_bias", [(True, True, False), (True, False, True)])
def test_chunked_widths_against_float64(rows, hidden, gs, has_z, nbg, has_bias):
    from mamba2_cutile.norm.plan import norm_config
    x, w, b, z = make(rows, hidden, BF, has_z, has_bias)
    dout = torch.randn(rows, hidden, device="cuda").to(BF)
    out, grads = ours(x, w, b, z, 1e-5, gs, nbg, dout)
    ref, rgrads = reference(x, w, b, z, 1e-5, gs, nbg, dout)
    e = rel_err(out, ref)
    tag = f"chunk {norm_config(gs or hidden).chunk}"
    log_result(f"{tag} out err {e:.3e} tol {TOL[BF]:.1e}")
    assert e <= TOL[BF]
    _check_grads(tag, grads, rgrads, (BF, w.dtype, None if b is None else b.dtype, BF))


@pytest.mark.parametrize("rows, hidden, nbg", [(257, 7680, False), (129, 10240, True)])
def test_chunked_fp32_large_groups(rows, hidden, nbg):
    """float32 chunks of large groups (their staging fills the shared memory), with a bias."""
    x, w, b, z = make(rows, hidden, F32, True, True)
    dout = torch.randn(rows, hidden, device="cuda")
    out, grads = ours(x, w, b, z, 1e-5, None, nbg, dout)
    ref, rgrads = reference(x, w, b, z, 1e-5, None, nbg, dout)
    e = rel_err(out, ref)
    log_result(f"out err {e:.3e} tol {TOL[F32]:.1e}")
    assert e <= TOL[F32]
    _check_grads("fp32", grads, rgrads, (F32, F32, F32, F32))


def _sweep_candidates():
    from mamba2_cutile.bench.norm import candidate_space
    out = []
    for hidden, gs in ((1536, 1536), (5120, 5120), (2048, 1024)):
        fwd, bwd = candidate_space(gs)
        for i, over in enumerate(fwd + [o for o in bwd if o not in fwd]):
            spec = ",".join(f"{k}={v}" for k, v in over.items()) or "default"
            out.append(pytest.param(hidden, gs, spec, id=f"{hidden}-g{gs}-{spec}"))
    return out


@pytest.mark.parametrize("hidden, gs, spec", _sweep_candidates())
def test_sweep_candidates_against_float64(monkeypatch, hidden, gs, spec):
    """Every config the candidate sweep (`bench.norm.candidate_space`) times, among them the
    padded kernels at chunkable widths (chunk=0) and the chunked kernels at a power-of-two
    group, is correct: forward and backward against float64, rows not a multiple of any
    tile."""
    monkeypatch.setenv("MAMBA2_CUTILE_NORM_CONFIG", spec)
    x, w, b, z = make(515, hidden, BF)
    dout = torch.randn(515, hidden, device="cuda").to(BF)
    out, grads = ours(x, w, b, z, 1e-5, gs, True, dout)
    ref, rgrads = reference(x, w, b, z, 1e-5, gs, True, dout)
    e = rel_err(out, ref)
    log_result(f"{spec} out err {e:.3e} tol {TOL[BF]:.1e}")
    assert e <= TOL[BF]
    _check_grads(spec, grads, rgrads, (BF, w.dtype, None, BF))


def test_chunked_matches_padded(monkeypatch):
    """At 1536 channels the chunked kernels (the rule) and the padded ones (chunk=0) compute
    the same float32 values in another order: their float32 results differ by float32
    rounding only (bound 2e-6 as TOL[F32]), the weight gradient included."""
    x, w, b, z = make(2047, 1536, F32, has_bias=True)
    dout = torch.randn(2047, 1536, device="cuda")
    chunked = ours(x, w, b, z, 1e-5, None, True, dout)
    monkeypatch.setenv("MAMBA2_CUTILE_NORM_CONFIG", "chunk=0")
    padded = ours(x, w, b, z, 1e-5, None, True, dout)
    pairs = [("out", chunked[0], padded[0])] + list(zip(NAMES, chunked[1], padded[1]))
    for name, a, p in pairs:
        if a is None:
            continue
        e = rel_err(a, p)
        log_result(f"{name} chunked vs padded {e:.3e} tol {TOL[F32]:.1e}")
        assert e <= TOL[F32], (name, e)


# ----------------------------------------------------------------------------- against mamba_ssm

def _mamba_rmsnorm():
    try:
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn as f
        return f
    except Exception:  # noqa: BLE001
        return None


@pytest.mark.parametrize("rows, hidden, gs", [(4097, 1536, None), (2049, 2560, 320),
                                              (1025, 8192, 1024), (333, 5120, None)])
@pytest.mark.parametrize("has_z, nbg, has_bias", OPTIONS)
@pytest.mark.parametrize("dtype", [BF, F32])
def test_against_mamba_ssm_rmsnorm(rows, hidden, gs, has_z, nbg, has_bias, dtype):
    mamba = _require(_mamba_rmsnorm, "mamba_ssm.ops.triton.layernorm_gated")
    x, w, b, z = make(rows, hidden, dtype, has_z, has_bias)
    dout = torch.randn(rows, hidden, device="cuda").to(dtype)
    ref, rgrads = reference(x, w, b, z, 1e-5, gs, nbg, dout)
    out, grads = ours(x, w, b, z, 1e-5, gs, nbg, dout)
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w, b, z)]
    m_out = mamba(leaves[0], leaves[1], leaves[2], z=leaves[3], eps=1e-5, group_size=gs,
                  norm_before_gate=nbg)
    m_out.backward(dout)
    m_grads = [None if t is None else t.grad for t in leaves]
    pairs = [("out", out, m_out.detach(), ref)] + [
        (n, g, mg, rg) for n, g, mg, rg in zip(NAMES, grads, m_grads, rgrads) if rg is not None]
    for name, g, mg, rg in pairs:
        e, em = rel_err(g, rg), rel_err(mg, rg)
        bound = MAMBA_FACTOR * em + tol_of(g.dtype, name in ("dweight", "dbias")) / 10
        log_result(f"{name} err {e:.3e} mamba_ssm {em:.3e} bound {bound:.3e}")
        assert e <= bound, (name, e, em)
