"""runtime: 64-bit launches never hand cuTile a size-1 dimension whose stride passes int32."""

import pytest
import torch

from mamba2_cutile.bench import plans
from mamba2_cutile.runtime import INT32_LIMIT, KernelCall, narrow_unit_strides


def test_narrow_unit_strides_is_a_view_with_small_unit_strides():
    t = torch.empty(1, 3, 4)
    big = t.as_strided((1, 3, 4), (2**33, 4, 1))
    v = narrow_unit_strides(big)
    assert v.stride() == (4, 4, 1) and v.data_ptr() == big.data_ptr()
    torch.testing.assert_close(v, big, rtol=0, atol=0)
    assert narrow_unit_strides(t) is t          # nothing to change: the same object
    assert narrow_unit_strides(3) == 3 and narrow_unit_strides(None) is None
    lone = torch.empty(1).as_strided((1, 1), (2**32, 2**32))
    assert narrow_unit_strides(lone).stride() == (1, 1)


def test_kernel_call_narrows_only_64_bit_launches():
    big = torch.empty(1, 2, device="meta").as_strided((1, 2), (2**32, 1))
    assert KernelCall(None, (1,), (big, 7), int64=True).args[0].stride() == (1, 1)
    assert KernelCall(None, (1,), (big, 7)).args[0].stride() == (2**32, 1)


def _unit_dim_strides(calls):
    worst = 0
    for call in calls:
        for a in call.args:
            if isinstance(a, torch.Tensor):
                worst = max([worst] + [abs(s) for n, s in zip(a.shape, a.stride()) if n == 1])
    return worst


@pytest.mark.parametrize("builder", ["forward", "backward"])
def test_batch1_sequence_past_int32_plans_fit(builder):
    """x of 1 x 270000 x 128 x 64 (2.2e9 elements): every launch is 64-bit and no size-1
    dimension keeps the 2.2e9 batch stride."""
    kw = dict(batch=1, seqlen=270_000, nheads=128, ngroups=8, chunk_size=256)
    calls = (plans.forward_problem_plan(**kw) if builder == "forward"
             else plans.backward_problem_plan(**kw))
    assert all(c.int64 for c in calls if any(isinstance(a, torch.Tensor) and a.numel() > 2**31
                                             for a in c.args))
    assert _unit_dim_strides(calls) <= INT32_LIMIT
