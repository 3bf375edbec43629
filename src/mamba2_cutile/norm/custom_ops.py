"""Gated RMSNorm as `torch.library` custom ops with fake (meta) implementations and autograd, so
`torch.compile(fullgraph=True)` traces models that call it without a graph break.

`mamba2_cutile::rmsnorm_gated_fwd(x, weight, bias, z, eps, group_size, norm_before_gate)` takes
validated rows (see `api`): x and z (M, hidden) with a unit channel stride. It returns
(out (M, hidden) in x's dtype, rstd (hidden // group_size, M)), rstd in float32 (float64 for
float64 inputs, so that a float64 gradcheck sees exact statistics). CUDA tensors run the cuTile
kernel (`plan`), other devices the PyTorch forward of `reference.norm`, in float32 (float64
for float64 inputs).

The backward is the op `mamba2_cutile::rmsnorm_gated_bwd` (opaque to the compiler):
the cuTile backward kernel on CUDA tensors, the explicit PyTorch backward of `reference.norm`
elsewhere. Both recompute the normalised value from x and rstd; nothing else is saved. There is
no double backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..eager import eager_dispatch, eager_function, opaque_backward

from ..reference.norm import rmsnorm_gated_backward, rmsnorm_gated_forward


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def forward_body(x: Tensor, weight: Tensor, bias: Optional[Tensor], z: Optional[Tensor],
                 eps: float, group_size: int, norm_before_gate: bool
                 ) -> tuple[Tensor, Tensor]:
    if x.is_cuda:
        from .plan import rmsnorm_forward_cuda
        return rmsnorm_forward_cuda(x, weight, bias, z, eps, group_size, norm_before_gate)
    out, rstd = rmsnorm_gated_forward(x, weight, bias, z, eps, group_size, norm_before_gate,
                                      _compute_dtype(x))
    # the fake impl promises contiguous outputs
    return out.to(x.dtype).contiguous(), rstd.to(_compute_dtype(x)).contiguous()


rmsnorm_gated_fwd = torch.library.custom_op("mamba2_cutile::rmsnorm_gated_fwd", forward_body,
                                            mutates_args=())


@rmsnorm_gated_fwd.register_fake
def _(x, weight, bias, z, eps, group_size, norm_before_gate):
    m, hidden = x.shape
    return (x.new_empty((m, hidden)),
            x.new_empty((hidden // group_size, m), dtype=_compute_dtype(x)))


def backward_body(dout: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  z: Optional[Tensor], rstd: Tensor, group_size: int,
                  norm_before_gate: bool) -> list[Tensor]:
    """[dx, dweight, dbias, dz], an empty tensor for dbias / dz without bias / z."""
    if x.is_cuda:
        from .plan import rmsnorm_backward_cuda
        dx, dw, db, dz = rmsnorm_backward_cuda(dout, x, weight, bias, z, rstd, group_size,
                                               norm_before_gate)
    else:
        dx, dw, db, dz = rmsnorm_gated_backward(dout, x, weight, bias, z, rstd, group_size,
                                                norm_before_gate, _compute_dtype(x))
        dx, dw = dx.to(x.dtype), dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        dz = None if dz is None else dz.to(z.dtype)
    # a fresh empty tensor for each absent gradient: outputs may not alias one another
    return [dx.contiguous(), dw.contiguous(),
            x.new_empty((0,)) if db is None else db.contiguous(),
            x.new_empty((0,)) if dz is None else dz.contiguous()]


rmsnorm_gated_bwd = torch.library.custom_op("mamba2_cutile::rmsnorm_gated_bwd", backward_body,
                                            mutates_args=())


@rmsnorm_gated_bwd.register_fake
def _(dout, x, weight, bias, z, rstd, group_size, norm_before_gate):
    def like(t):
        return x.new_empty((0,)) if t is None else torch.empty_like(
            t, memory_format=torch.contiguous_format)
    return [like(x), like(weight), like(bias), like(z)]


def _setup_context(ctx, inputs, output):
    x, weight, bias, z, eps, group_size, norm_before_gate = inputs
    ctx.save_for_backward(x, weight, bias, z, output[1])
    ctx.group_size, ctx.norm_before_gate = group_size, norm_before_gate
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, g_out, g_rstd, bwd=None):
    """`bwd`: how the backward is called, the opaque op by default (what torch.compile must
    see), its body in eager calls."""
    x, weight, bias, z, rstd = ctx.saved_tensors
    if g_out is None:
        return None, None, None, None, None, None, None
    dx, dw, db, dz = (bwd or rmsnorm_gated_bwd)(g_out, x, weight, bias, z, rstd,
                                                ctx.group_size, ctx.norm_before_gate)
    # inputs: x weight bias z eps group_size norm_before_gate
    return (dx, dw, None if bias is None else db, None if z is None else dz, None, None, None)


torch.library.register_autograd("mamba2_cutile::rmsnorm_gated_fwd", _backward,
                                setup_context=_setup_context)


_EagerNorm = eager_function(
    "_EagerNorm", forward_body, _setup_context,
    opaque_backward(lambda ctx, g_out, g_rstd: _backward(ctx, g_out, g_rstd, backward_body),
                    "the gated RMSNorm"))

#: `torch.ops.mamba2_cutile.rmsnorm_gated_fwd(*args)` with its autograd, eager calls without
#: the dispatch (`mamba2_cutile.eager`)
rmsnorm_gated = eager_dispatch(rmsnorm_gated_fwd, forward_body, _EagerNorm)
