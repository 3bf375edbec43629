"""CPU: the backward's plans on `meta` tensors: grid limits and 64-bit variants (their compiles
are in test_ssd_compile.py)."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("cuda.tile")

from mamba2_cutile.bench import plans  # noqa: E402
from mamba2_cutile.ssd import backward  # noqa: E402


def test_plan_grids_respect_cuda_limits():
    """Axes 1 and 2 of every grid stay within 65535, also for huge batch * heads."""
    calls = plans.backward_problem_plan(batch=600, seqlen=3, nheads=128, headdim=4, dstate=16,
                                        chunk_size=64)
    for call in calls:
        assert all(1 <= g for g in call.grid)
        assert all(g <= 65535 for g in call.grid[1:])
        assert call.grid[0] < 2**31


@pytest.mark.parametrize("overrides", [dict(), dict(da_mode=2), dict(bc_fused=0, da_mode=0),
                                       dict(dx_cb=1)],
                         ids=["default", "da_mode2", "unfused", "dx_cb"])
def test_int64_variant_whenever_an_argument_needs_it(overrides):
    """Every launch with an array argument of 2^31 elements or more gets its 64-bit variant
    (here the decay-gradient scratch is the largest array: narrow p- and n-tiles)."""
    import cuda.tile as ct

    b, l, h, g, p, n, Q = 1, 31744 * 256, 16, 1, 8, 256, 256
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    x, dt, A = e(b, l, h, p), e(b, l, h, dt=torch.float32), e(h, dt=torch.float32)
    B, C = e(b, l, g, n), e(b, l, g, n)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16),
                  dx_block_p=8, bc_block_n=16, **overrides)
    calls = []
    backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg)
    for call in calls:
        fn = call.kernel._annotated_function.pyfunc
        big = max(a.numel() for a in call.args if isinstance(a, torch.Tensor))
        is64 = any(v is ct.IndexedWithInt64 for v in fn.__annotations__.values())
        assert is64 == (big >= 2**31), (fn.__name__, big)


def _kernel_names(calls):
    return [c.kernel._annotated_function.pyfunc.__name__.removesuffix("_fn") for c in calls]


def _meta_problem(b, l, h, g, p, n):
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    return (e(b, l, h, p), e(b, l, h, dt=torch.float32), e(h, dt=torch.float32), e(b, l, g, n),
            e(b, l, g, n))


@pytest.mark.parametrize("Q, block_q", [(128, 64), (256, 32), (64, 64)])
def test_dx_cb_plan(Q, block_q):
    """dx_cb=1: chunk_cb runs right before bwd_chunk_dx over (nc * B * G, Q / BQ, Q / BQ)
    into a (B, nc, G, Q, Q) fp32 scratch counted in the buffers' bytes, which bwd_chunk_dx
    gets with DX_CB set; dx_cb=0 has neither (and passes DX_CB False)."""
    b, l, h, g, p, n = 2, 1000, 8, 2, 64, 128
    x, dt, A, B, C = _meta_problem(b, l, h, g, p, n)
    plans_, bufs_ = {}, {}
    for dx_cb in (0, 1):
        cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16),
                      chunk_size=Q, dx_block_q=block_q, dx_cb=dx_cb)
        calls = []
        backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg,
                              on_buffers=lambda bf, k=dx_cb: bufs_.__setitem__(k, bf))
        plans_[dx_cb] = calls
    names0, names1 = _kernel_names(plans_[0]), _kernel_names(plans_[1])
    assert "chunk_cb" not in names0 and len(names0) == 6 and bufs_[0].cb is None
    i = names1.index("chunk_cb")
    assert names1[:i] + names1[i + 1:] == names0 and names1[i + 1] == "bwd_chunk_dx"
    nc = -(-l // Q)
    cb = bufs_[1].cb
    assert cb.shape == (b, nc, g, Q, Q) and cb.dtype == torch.float32
    assert bufs_[1].nbytes() - bufs_[0].nbytes() == cb.numel() * 4
    cb_call, dx_call = plans_[1][i], plans_[1][i + 1]
    assert tuple(cb_call.grid) == (nc * b * g, Q // block_q, Q // block_q)
    assert cb_call.args[2] is cb and cb_call.args[4] == block_q
    fn = dx_call.kernel._annotated_function.pyfunc
    params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    args1 = dict(zip(params, dx_call.args))
    args0 = dict(zip(params, plans_[0][names0.index("bwd_chunk_dx")].args))
    assert args1["cb_buf"] is cb and args1["DX_CB"] is True and args0["DX_CB"] is False


def test_dx_cb_scratch_alone_picks_int64():
    """A problem where only the S buffer (B * Lp * G * Q elements) reaches 2^31: chunk_cb
    and bwd_chunk_dx (which reads it) take their 64-bit variants, the others stay 32-bit."""
    import cuda.tile as ct

    b, l, h, g, p, n, Q = 1, 2**21 + 5, 8, 8, 8, 16, 128
    x, dt, A, B, C = _meta_problem(b, l, h, g, p, n)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16), dx_cb=1)
    calls, bufs_ = [], {}
    backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg,
                          on_buffers=lambda bf: bufs_.setdefault("b", bf))
    assert bufs_["b"].cb.numel() >= 2**31
    for call in calls:
        fn = call.kernel._annotated_function.pyfunc
        is64 = any(v is ct.IndexedWithInt64 for v in fn.__annotations__.values())
        name = fn.__name__.removesuffix("_fn")
        assert is64 == (name in ("chunk_cb", "bwd_chunk_dx")), name
        big = max(a.numel() for a in call.args if isinstance(a, torch.Tensor))
        assert is64 == (big >= 2**31), (name, big)


@pytest.mark.parametrize("value", [2, -1])
def test_dx_cb_must_be_0_or_1(value):
    cfg = backward.backward_config(1, 4, 1, 64, 128, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="dx_cb"):
        replace(cfg, dx_cb=value)
