"""CPU: bad arguments raise ValueError/TypeError naming the argument."""

import pytest
import torch

from mamba2_cutile import mamba_chunk_scan_combined as scan


def inputs(b=2, l=32, h=4, g=2, p=8, n=16):
    return dict(x=torch.randn(b, l, h, p), dt=torch.rand(b, l, h), A=-torch.rand(h),
                B=torch.randn(b, l, g, n), C=torch.randn(b, l, g, n), chunk_size=64)


def test_ok():
    assert scan(**inputs()).shape == (2, 32, 4, 8)


@pytest.mark.parametrize("change, exc, match", [
    (dict(x=torch.randn(2, 32, 4)), ValueError, "x must have 4"),
    (dict(dt=torch.rand(2, 31, 4)), ValueError, "dt must have shape"),
    (dict(A=-torch.rand(3)), ValueError, "A must have shape"),
    (dict(B=torch.randn(3, 32, 2, 16)), ValueError, "B must have shape"),
    (dict(C=torch.randn(2, 32, 2, 8)), ValueError, "C must have shape"),
    (dict(B=torch.randn(2, 32, 3, 16), C=torch.randn(2, 32, 3, 16)), ValueError,
     "multiple of ngroups"),
    (dict(chunk_size=100), ValueError, "chunk_size"),
    (dict(chunk_size=32), ValueError, "chunk_size"),
    (dict(x=torch.randn(2, 32, 4, 300)), ValueError, "headdim"),
    (dict(B=torch.randn(2, 32, 2, 300), C=torch.randn(2, 32, 2, 300)), ValueError, "dstate"),
    (dict(x=torch.ones(2, 32, 4, 8, dtype=torch.int64)), TypeError, "x must be a floating"),
    (dict(dt=torch.ones(2, 32, 4, dtype=torch.int32)), TypeError, "dt must be a floating"),
    (dict(D=torch.randn(5)), ValueError, "D must have shape"),
    (dict(z=torch.randn(2, 32, 4, 7)), ValueError, "z must have shape"),
    (dict(dt_bias=torch.randn(4, 1)), ValueError, "dt_bias must have 1"),
    (dict(initial_states=torch.randn(2, 4, 8, 15)), ValueError, "initial_states must have shape"),
    (dict(seq_idx=torch.zeros(2, 32)), TypeError, "seq_idx must be an integer"),
    (dict(seq_idx=torch.zeros(2, 31, dtype=torch.int32)), ValueError, "seq_idx must have shape"),
    (dict(return_varlen_states=True), ValueError, "requires cu_seqlens"),
    (dict(return_varlen_states=True, cu_seqlens=torch.tensor([0, 32], dtype=torch.int32)),
     ValueError, "requires batch 1"),
    (dict(dt_limit=(1.0, 0.5)), ValueError, "dt_limit"),
    (dict(dt_limit=3), TypeError, "dt_limit"),
    (dict(state_dtype=torch.int32), TypeError, "state_dtype"),
    (dict(x="nope"), TypeError, "x must be a torch.Tensor"),
])
def test_bad_arguments(change, exc, match):
    kw = inputs()
    kw.update(change)
    with pytest.raises(exc, match=match):
        scan(**kw)


def test_seq_idx_must_be_non_decreasing():
    seq = torch.zeros(2, 32, dtype=torch.int32)
    seq[0, 10:] = 2
    seq[0, 20:] = 1
    with pytest.raises(ValueError, match="seq_idx must be non-decreasing"):
        scan(**inputs(), seq_idx=seq)


def test_cu_seqlens_values():
    kw = inputs(b=1)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing from 0"):
        scan(**kw, return_varlen_states=True, cu_seqlens=torch.tensor([0, 40], dtype=torch.int32))


def test_kernel_inputs_copy_only_what_tma_cannot_read():
    from mamba2_cutile.runtime import as_kernel_input

    proj = torch.randn(2, 10, 40)
    view = proj[..., 8:24].view(2, 10, 2, 8)          # a slice of one projection: kept as is
    assert as_kernel_input(view) is view
    shared = torch.randn(1, 10, 1, 8).expand(2, 10, 1, 8)    # stride 0 over the batch: copied
    got = as_kernel_input(shared)
    assert got.is_contiguous() and torch.equal(got, shared)
    assert as_kernel_input(proj.transpose(1, 2)).stride(-1) == 1       # innermost stride fixed
