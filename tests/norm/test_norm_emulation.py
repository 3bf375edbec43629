"""CPU: the gated-RMSNorm kernels' own source run on the float64 emulation of `ct`
(tests/support/emulator.py), with the plans the GPU path builds, against the float64 definition
and the definition's autograd. Catches tiling mistakes (group offsets, padded channels and rows,
the backward's row-block walk and partial sums) before any GPU time is spent.

The emulation loads padded elements as 0 with PaddingMode.ZERO and NaN otherwise, and fails on a
store by two programs to one element, so a reliance on undefined padding or a race shows up.
"""

from dataclasses import replace

import pytest
import torch

from mamba2_cutile.norm.plan import (backward_plan, bwd_programs, forward_plan,
                                     norm_shape_config, rows_view)
from mamba2_cutile.reference.norm import rmsnorm_gated_ref
from support import emulator

F64 = torch.float64
if not hasattr(emulator.CT, "sqrt"):       # the norm kernels' one op the SSD kernels do not use
    emulator.CT.sqrt = staticmethod(torch.sqrt)
if not hasattr(emulator.CT, "static_iter"):   # the chunked kernels' unrolled loops
    emulator.CT.static_iter = staticmethod(lambda iterable: iterable)


def _problem(m, hidden, has_z, has_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    wide = r(m, hidden + 5)                  # x as a slice of wider rows (row stride hidden + 5)
    x = wide[:, 2:2 + hidden]
    z = r(m, hidden) * 2 if has_z else None
    w = 1 + 0.5 * r(hidden)
    b = 0.3 * r(hidden) if has_bias else None
    return x, w, b, z


def _emulated_forward(x, w, b, z, eps, gs, nbg, cfg, sms=132):
    m, hidden = x.shape
    g = hidden // gs
    out = torch.full((m, hidden), float("nan"), dtype=F64)
    rstd = torch.full((g, m), float("nan"), dtype=F64)
    calls = forward_plan(rows_view(x, gs), None if z is None else rows_view(z, gs),
                         w.view(g, gs), None if b is None else b.view(g, gs),
                         rows_view(out, gs), rstd, eps, nbg, cfg, sms)
    emulator.emulate_launch(calls)
    return out, rstd


def _emulated_backward(dout, x, w, b, z, rstd, gs, nbg, cfg, sms):
    m, hidden = x.shape
    g = hidden // gs
    nan = lambda *s: torch.full(s, float("nan"), dtype=F64)  # noqa: E731
    dx = nan(m, hidden)
    dz = nan(m, hidden) if z is not None else None
    p = bwd_programs(m, g, cfg, sms)
    dw_part, db_part = nan(p, g, gs), nan(p, g, gs) if b is not None else None
    # the partials summed by the plan's own launch (sum_partials) where the config has it
    dw, db = nan(g, gs), nan(g, gs) if b is not None else None
    calls = backward_plan(rows_view(x, gs), None if z is None else rows_view(z, gs),
                          w.view(g, gs), None if b is None else b.view(g, gs), rstd,
                          rows_view(dout, gs), rows_view(dx, gs),
                          None if dz is None else rows_view(dz, gs), dw_part, db_part, nbg, cfg,
                          dw, db, sms)
    emulator.emulate_launch(calls)
    assert len(calls) == 1 + cfg.bwd_reduce
    if not cfg.bwd_reduce:
        dw, db = dw_part.sum(0), None if db_part is None else db_part.sum(0)
    return dx, dw.reshape(hidden), None if db is None else db.reshape(hidden), dz, p


#: (rows, hidden, group_size, config overrides): rows not a multiple of block_m, groups not
#: powers of two, a group of 1, a tile row count of 1; the chunked kernels (chunk > 0) at
#: 3 and 5 chunks per group, one and two groups, a power-of-two group in 4 chunks, and the
#: persistent chunked forward
CASES = [(13, 24, 8, dict(block_m=4, bwd_block_m=2)),
         (10, 30, 10, dict(block_m=8, bwd_block_m=4)),
         (7, 37, 37, dict(block_m=2, bwd_block_m=1)),
         (9, 6, 1, dict(block_m=4, bwd_block_m=4)),
         (5, 64, 64, {}),
         (13, 192, 192, dict(chunk=64, block_m=4, bwd_block_m=2)),
         (10, 640, 320, dict(chunk=64, block_m=8, bwd_block_m=4)),
         (7, 384, 384, dict(chunk=128, block_m=2, bwd_block_m=1)),
         (6, 256, 256, dict(chunk=64, block_m=4, bwd_block_m=4)),
         (11, 640, 320, dict(chunk=64, block_m=2, bwd_block_m=2, fwd_ctas_per_sm=2)),
         (5, 1536, 1536, {})]                   # the shape rule's chunks at 1536 (3 x 512)


@pytest.mark.parametrize("m, hidden, gs, over", CASES)
@pytest.mark.parametrize("has_z, nbg", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_kernels_match_definition(m, hidden, gs, over, has_z, nbg, has_bias):
    _check_kernels(m, hidden, gs, over, has_z, nbg, has_bias)


@pytest.mark.parametrize("m, hidden, gs, over", [CASES[0], CASES[5], CASES[9], CASES[10]])
@pytest.mark.parametrize("nbg", [True, False])
def test_approximate_sigmoid_branch(m, hidden, gs, over, nbg, monkeypatch):
    """The kernels' APPROX branch (the sigmoid through exp2 and a reciprocal; the plan takes
    it for 16-bit x and z, which the float64 emulation is not) against the same definition:
    in float64 the two forms agree to rounding, so this checks the branch's math and wiring."""
    from mamba2_cutile.norm import plan
    monkeypatch.setattr(plan, "_approx", lambda cfg, x3, z3: True)
    _check_kernels(m, hidden, gs, over, True, nbg, True)


@pytest.mark.parametrize("m, hidden, gs, over", [c for c in CASES if c[3].get("chunk")])
@pytest.mark.parametrize("has_bias", [False, True])
def test_regate_backward(m, hidden, gs, over, has_bias):
    """bwd_regate=1 (gate first, chunked): the backward's second pass reloads x and z and
    recomputes the gate, against the same definition."""
    _check_kernels(m, hidden, gs, {**over, "bwd_regate": 1}, True, False, has_bias)


def _check_kernels(m, hidden, gs, over, has_z, nbg, has_bias):
    x, w, b, z = _problem(m, hidden, has_z, has_bias)
    rule = norm_shape_config(gs)
    cfg = replace(rule, **over) if rule.chunk else replace(rule, **{"chunk": 0, **over})
    eps = 1e-5
    # sms=1: a persistent forward (fwd_ctas_per_sm) has fewer programs than row blocks
    out, rstd = _emulated_forward(x, w, b, z, eps, gs, nbg, cfg, sms=1)
    if cfg.fwd_ctas_per_sm:
        again, _ = _emulated_forward(x, w, b, z, eps, gs, nbg, cfg, sms=132)
        torch.testing.assert_close(again, out, rtol=0, atol=0)

    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b, z)]
    ref = rmsnorm_gated_ref(*leaves[:3], leaves[3], eps=eps, group_size=gs,
                            norm_before_gate=nbg)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-14, atol=1e-14)   # measured 1.8e-15
    u = x * torch.nn.functional.silu(z) if has_z and not nbg else x
    want_rstd = torch.rsqrt(u.unflatten(1, (hidden // gs, gs)).square().mean(-1) + eps)
    torch.testing.assert_close(rstd, want_rstd.T, rtol=1e-12, atol=0)

    dout = torch.randn(m, hidden, generator=torch.Generator().manual_seed(1), dtype=F64)
    ref.backward(dout)
    # sms=1: fewer programs than row blocks, so each walks several (the loop's stride)
    for sms in (1, 132):
        dx, dw, db, dz, p = _emulated_backward(dout, x, w, b, z, rstd, gs, nbg, cfg, sms)
        for got, leaf in zip((dx, dw, db, dz), leaves):
            if leaf is None:
                assert got is None
            else:
                torch.testing.assert_close(got, leaf.grad, rtol=5e-14, atol=5e-14)  # measured 1.1e-14
    assert p == min(-(-m // cfg.bwd_block_m),
                    -(-cfg.bwd_ctas_per_sm * 132 // (hidden // gs)))
    assert cfg.chunk == over.get("chunk", rule.chunk)


@pytest.mark.parametrize("m, hidden, gs, over", [CASES[0], CASES[6]])
def test_torch_reduction_path(m, hidden, gs, over):
    """bwd_reduce=0: the plan holds the backward kernel alone and the partials are summed by
    torch (the path the sum_partials launch replaced), against the same definition."""
    _check_kernels(m, hidden, gs, {**over, "bwd_reduce": 0}, True, False, True)
