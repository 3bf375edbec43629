"""Argument checks and host-side helpers shared by the public functions (scan, decode,
backward): errors name the argument and say what was expected."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
GPU_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def shape_of(t):
    return tuple(t.shape)


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


def as_kernel_input(t, dtype=None):
    """A tensor the kernels can load: unit innermost stride (for TMA), no stride-0 (expanded)
    dimension (TMA descriptors want strides that grow with the dimension), optional dtype
    cast. Views that already qualify, such as slices of one projection, are not copied."""
    if t is None:
        return None
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.dim() and (t.stride(-1) != 1 or any(
            st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape))):
        t = t.contiguous()
    return t


def config_from_env(cfg, env_var: str, frozen=()):
    """`cfg` (a dataclass of ints) with the overrides of env_var="field=value,...", for tuning
    experiments. Fields in `frozen` (fixed by the problem) cannot be overridden."""
    spec = os.environ.get(env_var, "").strip()
    if not spec or spec == "default":
        return cfg
    fields = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in type(cfg).__dataclass_fields__ or key in frozen:
            raise ValueError(f"{env_var}: unknown field {key!r}")
        fields[key] = int(value)
    return replace(cfg, **fields)
