"""CPU: the chunked PyTorch SSD (what CPU tensors run) against the token-by-token recurrence."""

import pytest
import torch

from mamba2_cutile import mamba_chunk_scan_combined, reference


def make_inputs(b=2, l=150, h=4, g=2, p=5, n=7, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(x=r(b, l, h, p), dt=r(b, l, h).abs() * 0.3, A=-torch.rand(h, generator=gen,
                dtype=dtype) - 0.5, B=r(b, l, g, n), C=r(b, l, g, n))


def make_seq_idx(b, l):
    seq = torch.zeros(b, l, dtype=torch.int32)
    for cut in (17, 64, 65, 130):
        if cut < l:
            seq[0, cut:] += 1
    if b > 1:
        seq[1, l // 2:] = 3
    return seq


OPTIONS = {
    "none": {},
    "D_head": {"D": "h"},
    "D_chan": {"D": "hp"},
    "z": {"z": True},
    "bias_softplus": {"dt_bias": True, "dt_softplus": True},
    "dt_limit": {"dt_limit": (0.05, 0.2)},
    "init": {"initial_states": True},
    "seq_idx": {"seq_idx": True},
    "all": {"D": "hp", "z": True, "dt_bias": True, "dt_softplus": True,
            "dt_limit": (0.01, 1.0), "initial_states": True, "seq_idx": True},
}


def build_kwargs(inp, opts, seed=1):
    gen = torch.Generator().manual_seed(seed)
    b, l, h, p = inp["x"].shape
    n = inp["B"].shape[-1]
    kw = {}
    if opts.get("D") == "h":
        kw["D"] = torch.randn(h, generator=gen, dtype=inp["x"].dtype)
    if opts.get("D") == "hp":
        kw["D"] = torch.randn(h, p, generator=gen, dtype=inp["x"].dtype)
    if opts.get("z"):
        kw["z"] = torch.randn(b, l, h, p, generator=gen, dtype=inp["x"].dtype)
    if opts.get("dt_bias"):
        kw["dt_bias"] = torch.randn(h, generator=gen, dtype=inp["x"].dtype) - 2.0
    if "dt_softplus" in opts:
        kw["dt_softplus"] = opts["dt_softplus"]
    if "dt_limit" in opts:
        kw["dt_limit"] = opts["dt_limit"]
    if opts.get("initial_states"):
        kw["initial_states"] = torch.randn(b, h, p, n, generator=gen, dtype=inp["x"].dtype)
    if opts.get("seq_idx"):
        kw["seq_idx"] = make_seq_idx(b, l)
    return kw


@pytest.mark.parametrize("chunk_size", [64, 128])
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_chunked_matches_recurrence(opt, chunk_size):
    inp = make_inputs()
    kw = build_kwargs(inp, OPTIONS[opt])
    y_ref, h_ref, _ = reference.ssd_recurrence(**inp, **kw)
    y, h = mamba_chunk_scan_combined(**inp, chunk_size=chunk_size, return_final_states=True, **kw)
    assert y.dtype == torch.float64 and h.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(h, h_ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("l", [1, 63, 64, 200])
def test_lengths(l):
    inp = make_inputs(l=l, seed=l)
    y_ref, h_ref, _ = reference.ssd_recurrence(**inp)
    y, h = mamba_chunk_scan_combined(**inp, chunk_size=64, return_final_states=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(h, h_ref.float(), rtol=1e-5, atol=1e-5)


def test_empty_sequence():
    inp = make_inputs(l=0)
    h0 = torch.randn(2, 4, 5, 7, dtype=torch.float64)
    y, h = mamba_chunk_scan_combined(**inp, chunk_size=64, initial_states=h0,
                                     return_final_states=True)
    assert y.shape == (2, 0, 4, 5)
    torch.testing.assert_close(h, h0.float())


@pytest.mark.parametrize("with_init", [False, True])
def test_varlen_states(with_init):
    inp = make_inputs(b=1, l=200)
    cu = torch.tensor([0, 30, 64, 64, 129, 200], dtype=torch.int32)
    seq = torch.zeros(1, 200, dtype=torch.int32)
    for s, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        seq[0, a:e] = s
    kw = dict(seq_idx=seq)
    if with_init:
        kw["initial_states"] = torch.randn(1, 4, 5, 7, dtype=torch.float64)
    y_ref, h_ref, v_ref = reference.ssd_recurrence(**inp, cu_seqlens=cu, **kw)
    y, h, v = mamba_chunk_scan_combined(**inp, chunk_size=64, cu_seqlens=cu,
                                        return_final_states=True, return_varlen_states=True,
                                        state_dtype=torch.float64, **kw)
    assert v.shape == (5, 4, 5, 7) and v.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(v, v_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(v[-1].float(), h[0], rtol=1e-5, atol=1e-5)


def test_low_precision_cpu_dtypes():
    inp = make_inputs(dtype=torch.float32)
    y_ref, _, _ = reference.ssd_recurrence(**inp)
    bf = {k: (v.bfloat16() if k in ("x", "B", "C") else v) for k, v in inp.items()}
    y = mamba_chunk_scan_combined(**bf, chunk_size=64)
    assert y.dtype == torch.bfloat16
    err = (y.double() - y_ref).abs().max() / y_ref.abs().max()
    assert err < 2e-2


def test_cpu_autocast_keeps_float32():
    """Under torch.autocast on the CPU, float32 inputs are computed in float32 (as the kernels
    do, which autocast does not reach), forward and backward: bit-equal to a call outside."""
    inp = make_inputs(dtype=torch.float32)
    x = inp.pop("x").requires_grad_(True)
    y0 = mamba_chunk_scan_combined(x, **inp, chunk_size=64)
    g0, = torch.autograd.grad(y0.square().sum(), x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1 = mamba_chunk_scan_combined(x, **inp, chunk_size=64)
        g1, = torch.autograd.grad(y1.square().sum(), x)
    assert y1.dtype == torch.float32
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    torch.testing.assert_close(g1, g0, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_default_limit_clamps_negative_dt(bias):
    """dt' = clamp(dt + dt_bias, 0, inf) with the default dt_limit, as mamba_ssm's Triton scan
    (its _chunk_cumsum_fwd_kernel clamps on every call): a negative dt' is 0, so no decay
    grows the state, and the output equals that of the clamped dt."""
    inp = make_inputs()
    inp["dt"] = inp["dt"] - 0.2
    h = inp["x"].shape[2]
    dt_bias = torch.linspace(-0.1, 0.1, h, dtype=torch.float64) if bias else None
    raw = inp["dt"] + (0 if dt_bias is None else dt_bias)
    assert (raw < 0).any() and (raw > 0).any()
    D = torch.ones(h, dtype=torch.float64)
    y, fin = mamba_chunk_scan_combined(**inp, chunk_size=64, D=D, dt_bias=dt_bias,
                                       return_final_states=True)
    y0, fin0 = mamba_chunk_scan_combined(**dict(inp, dt=raw.clamp(min=0)), chunk_size=64, D=D,
                                         return_final_states=True)
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin, fin0, rtol=1e-12, atol=1e-12)
    # all negative: no state at all, y = D x
    y1 = mamba_chunk_scan_combined(**dict(inp, dt=-inp["dt"].abs() - 0.01), chunk_size=64, D=D)
    torch.testing.assert_close(y1, inp["x"], rtol=0, atol=0)



def test_numpy_integer_chunk_size():
    """A numpy integer chunk_size (a config's value) gives the Python int's result; a bool is
    refused by name."""
    np = pytest.importorskip("numpy")
    inp = make_inputs()
    want = mamba_chunk_scan_combined(**inp, chunk_size=64)
    torch.testing.assert_close(mamba_chunk_scan_combined(**inp, chunk_size=np.int64(64)), want,
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="chunk_size"):
        mamba_chunk_scan_combined(**inp, chunk_size=True)
