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


def signature_of(kernel, args) -> KernelSignature:
    fn = kernel._annotated_function.pyfunc
    hints = typing.get_type_hints(fn, include_extras=True)
    names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
    constraints = []
    for name, value in zip(names, args, strict=True):
        ann = hints.get(name)
        if _is_constant(ann):
            constraints.append(ConstantConstraint(value))
        elif isinstance(value, torch.Tensor):
            constraints.append(ArrayConstraint(
                _DT[value.dtype], value.dim(),
                index_dtype=ct.int64 if _is_int64(ann) else ct.int32,
                stride_lower_bound_incl=0, alias_groups=(), may_alias_internally=False))
        elif isinstance(value, bool):
            constraints.append(ConstantConstraint(value))
        elif isinstance(value, float):
            constraints.append(ScalarConstraint(ct.float32))
        elif isinstance(value, int):
            constraints.append(ScalarConstraint(ct.int32))
        else:
            raise TypeError(f"cannot build a constraint for {name}={value!r}")
    return KernelSignature(constraints, CallingConvention.cutile_python_v1(), None)


def compile_call(call, gpu_code: str = "sm_90") -> int:
    """Compile one planned launch to a cubin in memory; returns its size in bytes."""
    buf = io.BytesIO()
    export_kernel(call.kernel, [signature_of(call.kernel, call.args)], buf,
                  gpu_code=gpu_code, output_format="cubin")
    return len(buf.getvalue())
