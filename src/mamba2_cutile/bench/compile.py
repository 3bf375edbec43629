"""Compile kernels on the CPU (no GPU needed) from the same plans the GPU path launches."""

from __future__ import annotations

import io
import typing

import torch
import cuda.tile as ct
from cuda.tile.compilation import (ArrayConstraint, CallingConvention, ConstantConstraint,
                                   KernelSignature, ScalarConstraint, export_kernel)

_DT = {torch.float16: ct.float16, torch.bfloat16: ct.bfloat16, torch.float32: ct.float32,
       torch.int32: ct.int32, torch.int64: ct.int64}


def _is_constant(annotation) -> bool:
    return any(isinstance(m, ct.ConstantAnnotation)
               for m in getattr(annotation, "__metadata__", ()))


def _is_int64(annotation) -> bool:
    return any(isinstance(m, ct.ArrayAnnotation) and m.index_dtype == ct.int64
               for m in getattr(annotation, "__metadata__", ()))


def _array_constraint(t: torch.Tensor, index_dtype) -> ArrayConstraint:
    """What the JIT would know of a freshly allocated tensor: unit strides are constants, 16-byte divisibility of strides and of sizes, a 16-byte aligned base (torch's
    allocations are). So the CPU compile picks the same TMA/vector paths as the GPU one."""
    per16 = max(1, 16 // t.element_size())
    return ArrayConstraint(
        _DT[t.dtype], t.dim(), index_dtype=index_dtype, stride_lower_bound_incl=0,
        alias_groups=(), may_alias_internally=False,
        stride_constant=tuple(1 if s == 1 else None for s in t.stride()),
        stride_divisible_by=tuple(per16 if s % per16 == 0 else 1 for s in t.stride()),
        shape_divisible_by=tuple(16 if d % 16 == 0 else 1 for d in t.shape),
        base_addr_divisible_by=16)


#: ct.launch refuses an array argument without ct.IndexedWithInt64 whose size or stride in any
#: dimension leaves the int32 range ("shape is too big" / "stride is too big")
INT32_MAX = 2**31 - 1


def check_int32_range(fn_name, name, t: torch.Tensor) -> None:
    """Raise what ct.launch would refuse: a 32-bit-indexed array argument with a size or
    stride past the int32 range (an argument the kernel never reads is checked too)."""
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if size > INT32_MAX or abs(stride) > INT32_MAX:
            raise ValueError(
                f"{fn_name}: argument {name!r} (shape {tuple(t.shape)}, strides {t.stride()}) "
                f"has {'size' if size > INT32_MAX else 'stride'} {max(size, abs(stride))} in "
                f"dimension {dim}, past the int32 index range of a parameter without "
                f"ct.IndexedWithInt64: ct.launch would refuse it")


def signature_of(kernel, args) -> KernelSignature:
    """The compile signature of a planned launch, checking each 32-bit-indexed array against
    the int32 range as ct.launch does."""
    fn = kernel._annotated_function.pyfunc
    hints = typing.get_type_hints(fn, include_extras=True)
    names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
    constraints = []
    for name, value in zip(names, args, strict=True):
        ann = hints.get(name)
        if _is_constant(ann):
            constraints.append(ConstantConstraint(value))
        elif isinstance(value, torch.Tensor):
            int64 = _is_int64(ann)
            if not int64:
                check_int32_range(fn.__name__, name, value)
            constraints.append(_array_constraint(value, ct.int64 if int64 else ct.int32))
        elif isinstance(value, bool):
            constraints.append(ConstantConstraint(value))
        elif isinstance(value, float):
            constraints.append(ScalarConstraint(ct.float32))
        elif isinstance(value, int):
            constraints.append(ScalarConstraint(ct.int32))
        else:
            raise TypeError(f"cannot build a constraint for {name}={value!r}")
    return KernelSignature(constraints, CallingConvention.cutile_python_v1(), None)


def compile_cubin(call, gpu_code: str = "sm_90") -> bytes:
    """Compile one planned launch to a cubin in memory."""
    buf = io.BytesIO()
    export_kernel(call.kernel, [signature_of(call.kernel, call.args)], buf,
                  gpu_code=gpu_code, output_format="cubin")
    return buf.getvalue()


def compile_call(call, gpu_code: str = "sm_90") -> int:
    """Compile one planned launch to a cubin in memory; returns its size in bytes."""
    return len(compile_cubin(call, gpu_code))
