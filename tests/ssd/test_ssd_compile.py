"""CPU: every forward and backward kernel variant the dispatchers pick compiles for sm_90 (and the
all-options variants for sm_100; the rest of sm_100 is marked slow).

Kernels are compiled from the same plans the GPU path launches, on `meta` tensors, so a compile
error shows here before any GPU time is spent. A launch whose machine code an earlier one
already decides (same kernel, hints, constants and array constraints; see
`support.variants.signature_key`) is compiled once: the backward's recompute launches are the
forward's kernels, and most variants share most kernels.
"""

import pytest

pytest.importorskip("cuda.tile")

from mamba2_cutile.bench import compile as cpu_compile  # noqa: E402
from mamba2_cutile.bench import plans  # noqa: E402
from support import variants  # noqa: E402

pytestmark = pytest.mark.compile

FAMILIES = ("forward", "backward")
CASES = [pytest.param(arch, fam, name, i, id=f"{arch}-{tid}",
                      marks=() if arch == "sm_90" or variants.SM100_DEFAULT[fam](name)
                      else (pytest.mark.slow,))
         for arch in ("sm_90", "sm_100")
         for tid, fam, name, i in variants.distinct_launches(FAMILIES, arch)]


@pytest.mark.parametrize("arch, family, name, index", CASES)
def test_launch_compiles(arch, family, name, index):
    assert cpu_compile.compile_call(variants.launch_of(family, name, index), arch) > 0


def test_plans_have_their_launches():
    """Each forward plan holds the 3 forward launches, each backward plan the 6 backward ones
    (2 recompute + 4 backward kernels)."""
    for name, problem in variants.forward_variants():
        assert len(plans.forward_problem_plan(**problem)) == 3, name
    for name, problem in variants.backward_variants():
        assert len(plans.backward_problem_plan(**problem)) == 6, name
