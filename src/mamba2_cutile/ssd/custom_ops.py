"""The SSD chunked scan as a `torch.library` custom op, with a fake (meta) implementation and
its autograd, so `torch.compile` traces models that call it without a graph break.

`mamba2_cutile::ssd_forward` takes validated arguments (see `api`), runs the cuTile
kernels on CUDA tensors (`forward`) and the chunked PyTorch SSD on CPU tensors, and returns
(out, final_states, varlen_states); varlen_states is an empty tensor unless cu_seqlens is given.

Backward: on CUDA tensors the cuTile kernels (`backward.ssd_backward_cuda`, wrapped in the
opaque op `mamba2_cutile::ssd_backward_cuda` so that torch.compile traces around it); elsewhere,
or with MAMBA2_CUTILE_BACKWARD=torch, the explicit chunked backward
(`reference.chunked_backward`, plain
PyTorch stages, float32; float64 for float64 inputs), the blueprint of those kernels. Both
recompute what they need from the saved inputs: nothing larger than the inputs is kept.
There is no double backward (create_graph=True through the CUDA backward raises).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from ..eager import eager_dispatch, eager_function, opaque_backward, unpacked
from ..reference import chunked_backward
from ..reference.chunked import ssd_chunked


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _forward_impl(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                  D: Optional[Tensor], z: Optional[Tensor], dt_bias: Optional[Tensor],
                  initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], dt_softplus: bool, dt_lo: float, dt_hi: float,
                  state_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    if x.is_cuda:
        from .forward import ssd_forward_cuda
        out, final, varlen = ssd_forward_cuda(x, dt, A, B, C, chunk_size, D, z, dt_bias,
                                              initial_states, seq_idx, cu_seqlens, dt_softplus,
                                              (dt_lo, dt_hi), state_dtype)
    else:
        out, final, varlen = ssd_chunked(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
            initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
            dt_softplus=dt_softplus, dt_limit=(dt_lo, dt_hi), dtype=_compute_dtype(x))
        out = out.to(x.dtype).contiguous()      # the fake impl promises contiguous outputs
        final = final.to(torch.float32).contiguous()
    if varlen is None:
        varlen = x.new_empty((0,), dtype=state_dtype)
    return out, final, varlen.to(state_dtype).contiguous()


ssd_forward = torch.library.custom_op("mamba2_cutile::ssd_forward", _forward_impl,
                                      mutates_args=())


@ssd_forward.register_fake
def _forward_fake(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                  dt_softplus, dt_lo, dt_hi, state_dtype):
    b, l, h, p = x.shape
    n = B.shape[3]
    out = x.new_empty((b, l, h, p))
    final = x.new_empty((b, h, p, n), dtype=torch.float32)
    if cu_seqlens is None:
        varlen = x.new_empty((0,), dtype=state_dtype)
    else:
        varlen = x.new_empty((cu_seqlens.shape[0] - 1, h, p, n), dtype=state_dtype)
    return out, final, varlen


_GRAD_INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def _setup_context(ctx, inputs, output):
    (x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
     dt_softplus, dt_lo, dt_hi, state_dtype) = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
    ctx.chunk_size, ctx.dt_softplus, ctx.dt_limit = chunk_size, dt_softplus, (dt_lo, dt_hi)
    ctx.mark_non_differentiable(output[2])


def backward_impl(x) -> str:
    """Which backward runs: "cutile" (the cuTile kernels of `ssd/backward.py`) for CUDA tensors,
    "torch" (`reference/chunked_backward.py`, PyTorch ops) on other devices or when
    MAMBA2_CUTILE_BACKWARD=torch."""
    want = os.environ.get("MAMBA2_CUTILE_BACKWARD", "cutile").strip().lower()
    if want not in ("torch", "cutile"):
        raise ValueError(f"MAMBA2_CUTILE_BACKWARD must be 'torch' or 'cutile', got {want!r}")
    return "cutile" if want == "cutile" and x.is_cuda else "torch"


def _backward_cuda_impl(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                        dout: Optional[Tensor], dfinal: Optional[Tensor], D: Optional[Tensor],
                        z: Optional[Tensor], dt_bias: Optional[Tensor],
                        initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
                        dt_softplus: bool, dt_lo: float, dt_hi: float) -> list[Tensor]:
    """The cuTile backward as an opaque op (torch.compile must not trace into its launches):
    the gradients of _GRAD_INPUTS in order, an empty tensor for each absent input."""
    from .backward import ssd_backward_cuda
    grads = ssd_backward_cuda(x, dt, A, B, C, chunk_size, dout, dfinal, D=D, z=z,
                              dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
                              dt_softplus=dt_softplus, dt_limit=(dt_lo, dt_hi))
    return [x.new_empty((0,)) if grads[k] is None else grads[k].contiguous()
            for k in _GRAD_INPUTS]


ssd_backward_op = torch.library.custom_op("mamba2_cutile::ssd_backward_cuda",
                                          _backward_cuda_impl, mutates_args=())


@ssd_backward_op.register_fake
def _(x, dt, A, B, C, chunk_size, dout, dfinal, D, z, dt_bias, initial_states, seq_idx,
      dt_softplus, dt_lo, dt_hi):
    return [x.new_empty((0,)) if t is None else torch.empty_like(
        t, memory_format=torch.contiguous_format)
        for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)]


def _backward(ctx, g_out, g_final, g_varlen, cuda_backward=None):
    """The gradients of the 16 inputs. `cuda_backward`: how the cuTile backward is called,
    the opaque op by default (what torch.compile must see), its body in eager calls."""
    x, dt, A, B, C, D, z, dt_bias, h0, seq_idx = ctx.saved_tensors
    if backward_impl(x) == "cutile":
        inputs = (x, dt, A, B, C, D, z, dt_bias, h0)
        out = (cuda_backward or ssd_backward_op)(
            x, dt, A, B, C, ctx.chunk_size, g_out, g_final, D, z, dt_bias, h0, seq_idx,
            ctx.dt_softplus, *ctx.dt_limit)
        grads = {k: None if t is None else g for k, t, g in zip(_GRAD_INPUTS, inputs, out)}
    else:
        grads = chunked_backward.ssd_chunked_backward(
            x, dt, A, B, C, ctx.chunk_size, g_out, g_final, D=D, z=z, dt_bias=dt_bias,
            initial_states=h0, seq_idx=seq_idx, dt_softplus=ctx.dt_softplus,
            dt_limit=ctx.dt_limit, dtype=_compute_dtype(x))
    g = [grads[k] for k in _GRAD_INPUTS]
    # inputs: x dt A B C chunk_size D z dt_bias initial_states seq_idx cu_seqlens softplus lo
    #         hi state_dtype
    return (g[0], g[1], g[2], g[3], g[4], None, g[5], g[6], g[7], g[8], None, None, None, None,
            None, None)


torch.library.register_autograd("mamba2_cutile::ssd_forward", _backward,
                                setup_context=_setup_context)


_cuda_backward_eager = opaque_backward(
    lambda ctx, g_out, g_final, g_varlen: _backward(ctx, g_out, g_final, g_varlen,
                                                    _backward_cuda_impl),
    "the CUDA backward of the scan (MAMBA2_CUTILE_BACKWARD=torch has one)")


def _backward_eager(ctx, g_out, g_final, g_varlen):
    # the PyTorch stages build their graph (a double backward works through them)
    ctx = unpacked(ctx)
    if backward_impl(ctx.saved_tensors[0]) == "cutile":
        return _cuda_backward_eager(ctx, g_out, g_final, g_varlen)
    return _backward(ctx, g_out, g_final, g_varlen)


_EagerScan = eager_function("_EagerScan", _forward_impl, _setup_context, _backward_eager)

#: `torch.ops.mamba2_cutile.ssd_forward(*args)` with its autograd, as the public function
#: calls it; eager calls without the dispatch (`mamba2_cutile.eager`)
ssd_scan = eager_dispatch(ssd_forward, _forward_impl, _EagerScan)
