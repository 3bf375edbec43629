"""CPU: every backward kernel variant the dispatcher picks compiles for sm_90 and sm_100.

Kernels are compiled from the same plans the GPU path launches (`backward.backward_plan` on
`meta` tensors): the two recompute launches (forward kernels with fp32 states) and the four
backward kernels. A launch whose kernel and signature were already compiled for that arch in
this session (e.g. decay_cumsum across most variants) is not compiled again.
"""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("cuda.tile")

from mamba2_cutile import backward, compile_check  # noqa: E402

pytestmark = pytest.mark.compile

VARIANTS = backward.backward_compile_variants()
_done = set()


def _key(call, arch):
    def describe(a):
        if hasattr(a, "stride"):
            per16 = max(1, 16 // a.element_size())
            return (a.dtype, a.dim(), tuple(s == 1 for s in a.stride()),
                    tuple(s % per16 == 0 for s in a.stride()), tuple(d % 16 == 0 for d in a.shape))
        return (type(a).__name__, a if isinstance(a, (bool, int)) else None)
    return (id(call.kernel), arch, tuple(describe(a) for a in call.args))


def test_variant_count():
    assert len(VARIANTS) <= 19       # each costs ~12 compiles (6 kernels x 2 archs) in CI


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("name, problem", VARIANTS, ids=[n for n, _ in VARIANTS])
def test_backward_variant_compiles(name, problem, arch):
    calls = backward.backward_plan_for_problem(**problem)
    assert len(calls) == 6
    for call in calls:
        key = _key(call, arch)
        if key in _done:
            continue
        assert compile_check.compile_call(call, arch) > 0
        _done.add(key)


def test_plan_grids_respect_cuda_limits():
    """Axes 1 and 2 of every grid stay within 65535, also for huge batch * heads."""
    calls = backward.backward_plan_for_problem(batch=600, seqlen=3, nheads=128, headdim=4,
                                               dstate=16, chunk_size=64)
    for call in calls:
        assert all(1 <= g for g in call.grid)
        assert all(g <= 65535 for g in call.grid[1:])
        assert call.grid[0] < 2**31


@pytest.mark.parametrize("overrides", [dict(), dict(da_mode=2), dict(bc_fused=0, da_mode=0)],
                         ids=["default", "da_mode2", "unfused"])
def test_int64_variant_whenever_an_argument_needs_it(overrides):
    """Every launch with an array argument of 2^31 elements or more gets its 64-bit variant
    (here the decay-gradient scratch is the largest array: narrow p- and n-tiles)."""
    import cuda.tile as ct

    b, l, h, g, p, n, Q = 1, 31744 * 256, 16, 1, 8, 256, 256
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    x, dt, A = e(b, l, h, p), e(b, l, h, dt=torch.float32), e(h, dt=torch.float32)
    B, C = e(b, l, g, n), e(b, l, g, n)
    cfg = replace(backward.default_backward_config(b, h, g, p, n, Q, torch.bfloat16),
                  dx_block_p=8, bc_block_n=16, **overrides)
    calls = []
    backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg)
    for call in calls:
        fn = call.kernel._annotated_function.pyfunc
        big = max(a.numel() for a in call.args if isinstance(a, torch.Tensor))
        is64 = any(v is ct.IndexedWithInt64 for v in fn.__annotations__.values())
        assert is64 == (big >= 2**31), (fn.__name__, big)
