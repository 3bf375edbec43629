"""The causal conv1d as `torch.library` custom ops with fake (meta) implementations and a
registered autograd, so `torch.compile(fullgraph=True)` traces models that call it.

- `mamba2_cutile::causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, silu,
  want_final) -> (out, final)`: the cuTile kernel for CUDA tensors (`plan`), the PyTorch path
  (`cpu`) otherwise. out is in x's layout family (`plan.kernel_layout`), final is
  (batch, dim, width-1) contiguous, or an empty tensor when not wanted.
- `mamba2_cutile::causal_conv1d_bwd(...) -> [dx, dweight, dbias, dinitial_states]` (an empty
  tensor for an absent input): the backward as an opaque op, so torch.compile traces around
  its launches.
- `mamba2_cutile::causal_conv1d_update(x, conv_state, ...) -> out`, conv_state mutated.

Arguments arrive validated (`api`), seq_idx / cache_seqlens / conv_state_indices as int32.
No double backward. Eager calls run the ops' bodies without the dispatch (`conv1d_call`,
`conv1d_update_call`, `mamba2_cutile.eager`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..eager import eager_dispatch, eager_function, opaque_backward
from . import cpu
from .plan import empty_like_layout, kernel_layout


def _layout_of(x):
    return kernel_layout(x)[1]


def _forward_body(x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor],
                  initial_states: Optional[Tensor], silu: bool,
                  want_final: bool) -> tuple[Tensor, Tensor]:
    if x.is_cuda:
        from .plan import conv1d_forward_cuda
        out, final = conv1d_forward_cuda(x, weight, bias, seq_idx, initial_states, silu,
                                         want_final)
    else:
        res, final = cpu.conv1d_forward(x, weight, bias, seq_idx, initial_states, silu,
                                        want_final)
        out = empty_like_layout(x, _layout_of(x))    # the layout the fake promises
        out.copy_(res)
        final = None if final is None else final.contiguous()
    if final is None:
        final = x.new_empty((0,))
    return out, final


conv1d_fwd = torch.library.custom_op("mamba2_cutile::causal_conv1d_fwd", _forward_body,
                                     mutates_args=())


@conv1d_fwd.register_fake
def _(x, weight, bias, seq_idx, initial_states, silu, want_final):
    b, d, _ = x.shape
    out = empty_like_layout(x, _layout_of(x))
    final = x.new_empty((b, d, weight.shape[1] - 1)) if want_final else x.new_empty((0,))
    return out, final


def _backward_body(x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor],
                   initial_states: Optional[Tensor], dout: Optional[Tensor],
                   dfinal: Optional[Tensor], silu: bool) -> list[Tensor]:
    if x.is_cuda:
        from .plan import conv1d_backward_cuda
        dx, dw, db, dinit = conv1d_backward_cuda(x, weight, bias, seq_idx, initial_states,
                                                 dout, dfinal, silu)
    else:
        res, dw, db, dinit = cpu.conv1d_backward(x, weight, bias, seq_idx, initial_states,
                                                 dout, dfinal, silu)
        dx = empty_like_layout(x, _layout_of(x))
        dx.copy_(res)
        dw = dw.contiguous()
        dinit = None if dinit is None else dinit.contiguous()
    # a fresh empty tensor per absent gradient: outputs of a custom op may not alias
    return [dx, dw, x.new_empty((0,)) if db is None else db,
            x.new_empty((0,)) if dinit is None else dinit]


conv1d_bwd = torch.library.custom_op("mamba2_cutile::causal_conv1d_bwd", _backward_body,
                                     mutates_args=())


@conv1d_bwd.register_fake
def _(x, weight, bias, seq_idx, initial_states, dout, dfinal, silu):
    return [empty_like_layout(x, _layout_of(x)), torch.empty_like(weight,
            memory_format=torch.contiguous_format),
            x.new_empty((0,)) if bias is None else torch.empty_like(bias),
            x.new_empty((0,)) if initial_states is None else torch.empty_like(
                initial_states, memory_format=torch.contiguous_format)]


def _setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, initial_states, silu, want_final = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
    ctx.silu, ctx.want_final = silu, want_final


def _backward(ctx, g_out, g_final, bwd=None):
    """`bwd`: how the backward is called, the opaque op by default (what torch.compile must
    see), its body in eager calls."""
    x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
    dfinal = g_final if ctx.want_final else None
    dx, dw, db, dinit = (bwd or conv1d_bwd)(x, weight, bias, seq_idx, initial_states, g_out,
                                            dfinal, ctx.silu)
    return (dx, dw, None if bias is None else db, None,
            None if initial_states is None else dinit, None, None)


torch.library.register_autograd("mamba2_cutile::causal_conv1d_fwd", _backward,
                                setup_context=_setup_context)


def _update_body(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor],
                 silu: bool, cache_seqlens: Optional[Tensor],
                 conv_state_indices: Optional[Tensor]) -> Tensor:
    """x (batch, dim, k) -> out (batch, dim, k) contiguous; conv_state updated in place."""
    if x.is_cuda:
        from .plan import conv1d_update_cuda
        return conv1d_update_cuda(x, conv_state, weight, bias, silu, cache_seqlens,
                                  conv_state_indices)
    return cpu.conv1d_update(x, conv_state, weight, bias, silu, cache_seqlens,
                             conv_state_indices).contiguous()


conv1d_update = torch.library.custom_op("mamba2_cutile::causal_conv1d_update", _update_body,
                                        mutates_args=("conv_state",))


@conv1d_update.register_fake
def _(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_EagerConv = eager_function(
    "_EagerConv", _forward_body, _setup_context,
    opaque_backward(lambda ctx, g_out, g_final: _backward(ctx, g_out, g_final, _backward_body),
                    "the causal conv1d's backward"))

#: `torch.ops.mamba2_cutile.causal_conv1d_fwd(*args)` with its autograd, eager calls without
#: the dispatch (`mamba2_cutile.eager`)
conv1d_call = eager_dispatch(conv1d_fwd, _forward_body, _EagerConv)


#: `torch.ops.mamba2_cutile.causal_conv1d_update(*args)`: an eager call without a gradient (a
#: decode step, one call per layer and token) runs the body without the dispatch
conv1d_update_call = eager_dispatch(conv1d_update, _update_body)
