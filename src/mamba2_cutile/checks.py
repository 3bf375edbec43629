"""Argument checks shared by the public functions (scan, decode): errors name the argument and
say what was expected."""

from __future__ import annotations

import operator
import os
import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
GPU_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def plain_int(v):
    """v as a Python int where it is an integer of another kind (numpy, a 0-d integer tensor),
    so that it can become a kernel constant; anything else (bool included) unchanged, for the
    caller's own check to name."""
    if isinstance(v, (bool, int)) or v is None or (isinstance(v, torch.Tensor)
                                                    and v.dtype == torch.bool):
        return v
    try:
        return operator.index(v)
    except TypeError:
        return v


def plain_flag(v):
    """v as a Python bool where it is a flag of another kind: None (off, as mamba_ssm's
    kernels read it), a numpy bool, a 0-d bool tensor; anything else unchanged, for the
    caller's own check to name."""
    if v is None:
        return False
    if isinstance(v, bool):
        return v
    if isinstance(v, torch.Tensor):
        return bool(v) if v.dim() == 0 and v.dtype == torch.bool else v
    if type(v).__module__ == "numpy" and str(getattr(v, "dtype", "")) == "bool" \
            and getattr(v, "shape", None) == ():
        return bool(v)
    return v


def shape_of(t):
    return tuple(t.shape)


def check_not_expanded(name, t):
    """`t`, written in place, has no expanded (stride-0) dimension of size > 1: its rows would
    share memory, each write overwriting the others'."""
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} is written in place and must not be an expanded (stride-0) "
                         f"view, got strides {t.stride()} for shape {shape_of(t)}")


def check_tensor(name, t, ndims, kinds, optional=False):
    """`t` is a tensor with one of `ndims` dimensions and a dtype in `kinds`."""
    if t is None:
        if optional:
            return
        raise ValueError(f"{name} is required")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ndims = (ndims,) if isinstance(ndims, int) else tuple(ndims)
    if t.dim() not in ndims:
        want = " or ".join(str(d) for d in ndims)
        raise ValueError(f"{name} must have {want} dimensions, got shape {shape_of(t)}")
    if t.dtype not in kinds:
        what = "a floating-point" if kinds is FLOATS else "an integer"
        raise TypeError(f"{name} must be {what} tensor, got dtype {t.dtype}")


def expect_shape(name, t, shape, meaning):
    if shape_of(t) != tuple(shape):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(shape)}, "
                         f"got {shape_of(t)}")


def check_same_device(tensors: dict, ref_name="x"):
    """Every tensor of {name: tensor or None} is on the device of tensors[ref_name]."""
    dev = tensors[ref_name].device
    for name, t in tensors.items():
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {dev}: "
                             "all tensors must be on one device")


def check_gpu_dtypes(tensors: dict):
    """The kernels load fp16, bf16 or fp32 (no fp64 on the GPU path)."""
    for name, t in tensors.items():
        if t is not None and t.is_cuda and t.dtype not in GPU_FLOATS:
            raise TypeError(f"{name} must be float16, bfloat16 or float32 on the GPU, "
                            f"got {t.dtype}")


def check_cu_seqlens(cu_seqlens, seqlen, values: bool):
    """cu_seqlens (num_seqs + 1,) integer; with `values` (value checks enabled: they read the
    tensor) also non-decreasing from 0 to seqlen."""
    check_tensor("cu_seqlens", cu_seqlens, 1, INTS)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have num_seqs + 1 >= 2 entries, got "
                         f"{shape_of(cu_seqlens)}")
    if values:
        cu = cu_seqlens.to("cpu", torch.int64)
        if int(cu[0]) != 0 or int(cu[-1]) != seqlen or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to seqlen ({seqlen}), "
                             f"got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")


def value_checks_enabled(on_cuda: bool) -> bool:
    """Whether to run the checks that read tensor values: always for CPU inputs; on the GPU
    only with MAMBA2_CUTILE_CHECK=1, because they synchronize (the default GPU path can be
    captured in a CUDA graph); never while torch.compile traces (a value read breaks the
    graph)."""
    if torch.compiler.is_compiling():
        return False
    return not on_cuda or os.environ.get("MAMBA2_CUTILE_CHECK", "") not in ("", "0")
