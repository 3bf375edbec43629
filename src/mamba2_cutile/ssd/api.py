"""`mamba_chunk_scan_combined`, a drop-in for mamba_ssm's function of that name.

Arguments are validated once here (shapes, dtypes, devices; values only on CPU or with
MAMBA2_CUTILE_CHECK=1, so the GPU path never synchronizes), then the custom op
`torch.ops.mamba2_cutile.ssd_forward` (`custom_ops.py`) runs: the cuTile kernels for CUDA
tensors (`forward.py`), the chunked PyTorch version (`reference.chunked`) for CPU tensors
(correct, slow). Eager calls run the op's implementation and autograd without its dispatch
(`custom_ops.ssd_scan`); torch.compile sees the op.
"""

from __future__ import annotations

import math

from . import custom_ops  # registers torch.ops.mamba2_cutile; ssd_scan calls it
from ..checks import (FLOATS, GPU_FLOATS, INTS, check_cu_seqlens, check_gpu_dtypes,
                      check_same_device, check_tensor, expect_shape, shape_of,
                      plain_int, value_checks_enabled)
from .forward import MAX_DSTATE, MAX_HEADDIM, SUPPORTED_CHUNK_SIZES


def _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
              dt_limit, return_varlen_states, state_dtype):
    check_tensor("x", x, 4, FLOATS)
    b, l, h, p = x.shape
    check_tensor("dt", dt, 3, FLOATS)
    expect_shape("dt", dt, (b, l, h), "(batch, seqlen, nheads)")
    check_tensor("A", A, 1, FLOATS)
    expect_shape("A", A, (h,), "(nheads,)")
    check_tensor("B", B, 4, FLOATS)
    if B.shape[:2] != (b, l):
        raise ValueError(f"B must have shape (batch, seqlen, ngroups, dstate) with batch={b}, "
                         f"seqlen={l}, got {shape_of(B)}")
    g, n = B.shape[2], B.shape[3]
    check_tensor("C", C, 4, FLOATS)
    expect_shape("C", C, (b, l, g, n), "B's shape (batch, seqlen, ngroups, dstate)")
    if g == 0 or h % g != 0:
        raise ValueError(f"nheads ({h}, from x) must be a multiple of ngroups ({g}, from B)")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or \
            chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES}, "
                         f"got {chunk_size!r}")
    if not 1 <= p <= MAX_HEADDIM:
        raise ValueError(f"headdim (x.shape[3]) must be in 1..{MAX_HEADDIM}, got {p}")
    if not 1 <= n <= MAX_DSTATE:
        raise ValueError(f"dstate (B.shape[3]) must be in 1..{MAX_DSTATE}, got {n}")
    check_tensor("D", D, (1, 2), FLOATS, optional=True)
    if D is not None and shape_of(D) not in ((h,), (h, p)):
        raise ValueError(f"D must have shape (nheads,) = ({h},) or (nheads, headdim) = "
                         f"({h}, {p}), got {shape_of(D)}")
    check_tensor("z", z, 4, FLOATS, optional=True)
    if z is not None:
        expect_shape("z", z, (b, l, h, p), "x's shape (batch, seqlen, nheads, headdim)")
    check_tensor("dt_bias", dt_bias, 1, FLOATS, optional=True)
    if dt_bias is not None:
        expect_shape("dt_bias", dt_bias, (h,), "(nheads,)")
    check_tensor("initial_states", initial_states, 4, FLOATS, optional=True)
    if initial_states is not None:
        expect_shape("initial_states", initial_states, (b, h, p, n),
                "(batch, nheads, headdim, dstate)")
    check_tensor("seq_idx", seq_idx, 2, INTS, optional=True)
    if seq_idx is not None:
        expect_shape("seq_idx", seq_idx, (b, l), "(batch, seqlen)")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, l, values=False)
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("return_varlen_states=True requires cu_seqlens")
        if b != 1:
            raise ValueError(f"return_varlen_states=True requires batch 1 (x.shape[0]), got {b}")
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"dt_limit must be a pair of numbers (min, max), got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit must satisfy min <= max, got {dt_limit!r}")
    if state_dtype is not None and state_dtype not in (GPU_FLOATS if x.is_cuda else FLOATS):
        raise TypeError(f"state_dtype must be torch.float16, bfloat16 or float32, got {state_dtype}")

    tensors = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
               "initial_states": initial_states, "seq_idx": seq_idx}
    if return_varlen_states:
        tensors["cu_seqlens"] = cu_seqlens
    check_same_device(tensors)
    check_gpu_dtypes({k: tensors[k] for k in ("x", "dt", "B", "C", "z")})
    if value_checks_enabled(x.is_cuda):
        _check_values(seq_idx, cu_seqlens if return_varlen_states else None, l)


def _check_values(seq_idx, cu_seqlens, seqlen):
    """Checks that read tensor values (they synchronize on a GPU)."""
    if seq_idx is not None and seq_idx.shape[1] > 1:
        if bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
            raise ValueError("seq_idx must be non-decreasing along each row")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, seqlen, values=True)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False,
                              state_dtype=None):
    """Mamba-2 SSD chunked scan, with mamba_ssm's signature and return conventions.

    x (b, l, h, p); dt (b, l, h); A (h,); B, C (b, l, g, n); D (h,) or (h, p); z like x;
    dt_bias (h,); initial_states (b, h, p, n); seq_idx (b, l) int; cu_seqlens (s + 1,) int.
    Returns out (x's dtype), then final_states (float32) if return_final_states, then
    varlen_states (s, h, p, n) in state_dtype (default C's dtype) if return_varlen_states.
    """
    chunk_size = plain_int(chunk_size)
    _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
              dt_limit, return_varlen_states, state_dtype)
    varlen_cu = cu_seqlens if return_varlen_states else None
    keep_dtype = state_dtype if state_dtype is not None else C.dtype
    lo, hi = (float(v) for v in dt_limit)
    out, final, varlen = custom_ops.ssd_scan(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, varlen_cu,
        bool(dt_softplus), lo, hi, keep_dtype)
    result = (out,)
    if return_final_states:
        result += (final,)
    if return_varlen_states:
        result += (varlen,)
    return result[0] if len(result) == 1 else result
