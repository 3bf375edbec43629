"""CPU: every kernel variant the dispatcher picks compiles for sm_90 and sm_100 (tileiras).

Kernels are compiled from the same plans the GPU path launches, on `meta` tensors, so a
compile error shows here before any GPU time is spent.
"""


import pytest

pytest.importorskip("cuda.tile")

from mamba2_cutile import compile_check, launch  # noqa: E402

pytestmark = pytest.mark.compile




@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("name, problem", launch.compile_variants(),
                         ids=[n for n, _ in launch.compile_variants()])
def test_variant_compiles(name, problem, arch):
    calls = launch.plan_for_problem(**problem)
    assert len(calls) == 3
    for call in calls:
        assert compile_check.compile_call(call, arch) > 0
