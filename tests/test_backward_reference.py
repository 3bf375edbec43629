"""CPU: gradients. The reference's autograd (float64) against finite differences, and the
GPU path's interim backward (`reference_backward`, chunked PyTorch in float32) against the
float64 recurrence's autograd."""

import pytest
import torch

from mamba2_cutile import reference
from mamba2_cutile.interface import reference_backward

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


@pytest.mark.parametrize("chunk_size", [64, 128])
def test_reference_backward_matches_recurrence(chunk_size):
    inp = tiny(l=150, b=2, h=4, g=2, p=5, n=6, seed=1)
    seq = torch.zeros(2, 150, dtype=torch.int32)
    seq[0, 40:] = 1
    seq[0, 64:] = 2
    kw = dict(seq_idx=seq, dt_softplus=True, dt_limit=(0.01, 1.0))
    gen = torch.Generator().manual_seed(5)
    g_out = torch.randn(2, 150, 4, 5, generator=gen, dtype=torch.float64)
    g_fin = torch.randn(2, 4, 5, 6, generator=gen, dtype=torch.float64)

    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
    y, h, _ = reference.ssd_recurrence(**leaves, **kw)
    ref = torch.autograd.grad([y, h], [leaves[k] for k in NAMES], [g_out, g_fin])

    got = reference_backward(inp, dict.fromkeys(NAMES, True), g_out, g_fin, chunk_size, **kw)
    for k, r in zip(NAMES, ref):
        scale = r.abs().max()
        err = (got[k] - r).abs().max() / scale
        assert got[k].dtype == inp[k].dtype
        assert err < 1e-4, f"d{k}: relative error {err:.2e}"


def test_reference_backward_partial_requests():
    inp = tiny(l=20)
    got = reference_backward(inp, {"x": True}, torch.ones(1, 20, 2, 3, dtype=torch.float64),
                             None, 64)
    assert got["x"] is not None and got["A"] is None
    assert reference_backward(inp, {}, None, None, 64)["x"] is None
