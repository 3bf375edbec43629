"""`kernels.sum_partials` (the backwards' sum of per-program partials, cast to the parameter's
dtype): the kernel's source emulated in float64 against `parts.sum(0)`, on shapes that are not
multiples of its tiles (rows past P, columns past N), several row tiles per program, a second
pair with fewer rows (the conv1d's bias beside its dweight) and a transposed output view; and
its CPU compile for sm_90."""

import pytest
import torch

from mamba2_cutile.runtime import sum_partials_call
from support import emulator

F64 = torch.float64


def _parts(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


#: (P, R, N, sms): one row tile (P <= its rows), several (N large at sms=1: 256 columns, 16
#: rows a tile), column tails, one column
CASES = [(13, 1, 24, 132), (37, 1, 2048, 1), (37, 3, 50, 132), (5, 2, 1, 132),
         (528, 1, 1536, 132), (100, 4, 700, 132)]


@pytest.mark.parametrize("p, r, n, sms", CASES)
@pytest.mark.parametrize("second", [False, True])
def test_emulated_sum(p, r, n, sms, second):
    parts = _parts(p, r, n)
    out = torch.full((r, n), float("nan"), dtype=F64)
    parts2 = _parts(p, 1, n, seed=1) if second else None
    out2 = torch.full((1, n), float("nan"), dtype=F64) if second else None
    call = sum_partials_call(parts, out, parts2, out2, sms)
    emulator.emulate_launch([call])
    torch.testing.assert_close(out, parts.sum(0), rtol=1e-14, atol=1e-13)
    if second:
        torch.testing.assert_close(out2, parts2.sum(0), rtol=1e-14, atol=1e-13)
    from mamba2_cutile.kernels.sum_partials import sum_partials
    from mamba2_cutile.runtime import SUM_PARTIALS_OCCUPANCY, with_hints
    assert call.kernel is with_hints(sum_partials, SUM_PARTIALS_OCCUPANCY)
    if (p, n, sms) == (37, 2048, 1):
        block_p, block_n = call.args[4:6]
        assert (block_p, block_n) == (16, 256) and p > 2 * block_p    # three row tiles


def test_emulated_sum_transposed_out():
    """The conv1d's dweight (dim, width) written through its (width, dim) transposed view."""
    parts = _parts(9, 4, 70)
    dweight = torch.full((70, 4), float("nan"), dtype=F64)
    emulator.emulate_launch([sum_partials_call(parts, dweight.t())])
    torch.testing.assert_close(dweight, parts.sum(0).t(), rtol=1e-14, atol=1e-13)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("second", [False, True])
def test_compiles(dtype, second):
    pytest.importorskip("cuda.tile")
    from mamba2_cutile.bench import compile as cpu_compile
    meta = dict(device="meta")
    parts = torch.empty(528, 1, 1536, dtype=torch.float32, **meta)
    out = torch.empty(1, 1536, dtype=dtype, **meta)
    args = (parts, out, parts, out) if second else (parts, out)
    assert cpu_compile.compile_call(sum_partials_call(*args)) > 0
    dweight = torch.empty(5376, 4, dtype=dtype, **meta)
    assert cpu_compile.compile_call(sum_partials_call(
        torch.empty(33, 4, 5376, dtype=torch.float32, **meta), dweight.t())) > 0
