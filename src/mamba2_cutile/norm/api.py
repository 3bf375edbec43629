"""`rmsnorm_fn`, gated RMSNorm with mamba_ssm's signature (`mamba_ssm.ops.triton.layernorm_gated`).

Arguments are validated here (shapes, dtypes, devices, group size; no tensor values are read,
so the GPU path never synchronizes), x and z are seen as (M, hidden) rows without a copy where
their strides allow it, then the custom op `torch.ops.mamba2_cutile.rmsnorm_gated_fwd`
(`custom_ops.py`) runs: the cuTile kernels for CUDA tensors, PyTorch for CPU tensors (an
eager call runs its body and autograd without the dispatch: `custom_ops.rmsnorm_gated`).
"""

from __future__ import annotations

import math
import numbers

import torch

from . import custom_ops  # registers torch.ops.mamba2_cutile.rmsnorm_gated_*
from ..checks import FLOATS, check_gpu_dtypes, check_same_device, check_tensor, expect_shape, \
    plain_int, shape_of
from .plan import MAX_GROUP_SIZE, MAX_GROUPS


def _validate(x, weight, bias, z, eps, group_size, norm_before_gate):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dimension (..., hidden), got shape "
                         f"{shape_of(x)}")
    check_tensor("x", x, x.dim(), FLOATS)
    hidden = x.shape[-1]
    if hidden < 1:
        raise ValueError(f"x's last dimension (hidden) must be at least 1, got shape "
                         f"{shape_of(x)}")
    check_tensor("weight", weight, 1, FLOATS)
    expect_shape("weight", weight, (hidden,), "(hidden,)")
    check_tensor("bias", bias, 1, FLOATS, optional=True)
    if bias is not None:
        expect_shape("bias", bias, (hidden,), "(hidden,)")
    if z is not None:
        check_tensor("z", z, x.dim(), FLOATS)
        expect_shape("z", z, x.shape, "x's shape")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a number, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    if group_size is None:
        group_size = hidden
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int or None, got {type(group_size).__name__}")
    if group_size < 1 or hidden % group_size:
        raise ValueError(f"group_size must be a positive divisor of hidden ({hidden}, x's last "
                         f"dimension), got {group_size}")
    if not isinstance(norm_before_gate, bool) and norm_before_gate not in (0, 1):
        raise TypeError(f"norm_before_gate must be a bool, got {norm_before_gate!r}")
    check_same_device({"x": x, "weight": weight, "bias": bias, "z": z})
    check_gpu_dtypes({"x": x, "weight": weight, "bias": bias, "z": z})
    if x.is_cuda:
        if group_size > MAX_GROUP_SIZE:
            raise ValueError(f"group_size must be at most {MAX_GROUP_SIZE} on the GPU, got "
                             f"{group_size} (hidden {hidden}): pass a smaller group_size")
        if hidden // group_size > MAX_GROUPS:
            raise ValueError(f"hidden // group_size (the number of groups) must be at most "
                             f"{MAX_GROUPS} on the GPU, got {hidden // group_size}")
    return group_size


def _rows(t, hidden):
    """t (..., hidden) as (M, hidden) rows with a unit channel stride: a view where the strides
    allow one (a slice of a wider tensor stays a view), a copy otherwise."""
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rmsnorm_fn(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Gated RMSNorm over each group of `group_size` channels of x's last dimension.

    x (..., hidden), any leading dimensions and strides; weight and bias (hidden,); z like x or
    None; group_size divides hidden (None: hidden, one group). With z and norm_before_gate:
    rmsnorm(x) * weight (+ bias) * silu(z); with z and not norm_before_gate:
    rmsnorm(x * silu(z)) * weight (+ bias); without z: plain RMSNorm. The statistics are in
    float32; the result has x's shape and dtype. Differentiable in x, weight, bias and z.
    """
    gs = _validate(x, weight, bias, z, eps, plain_int(group_size), norm_before_gate)
    hidden = x.shape[-1]
    out, _ = custom_ops.rmsnorm_gated(
        _rows(x, hidden), weight, bias, None if z is None else _rows(z, hidden), float(eps),
        gs, bool(norm_before_gate))
    return out.view(x.shape)
