"""Causal depthwise conv1d (causal-conv1d 1.7.0's public functions) in cuTile.

- `causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
  return_final_states=False, final_states_out=None, activation=None)`: the convolution over
  the tokens, with bias and SiLU fused; autograd in x, weight, bias and initial_states.
- `causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
  conv_state_indices=None)`: the decode step, conv_state updated in place.

For the fused Mamba-2 layer: call `causal_conv1d_fn` on the channel-last view of the
projection, ``xBC = zxbcdt[..., a:b].transpose(1, 2)`` (shape (batch, dim, seqlen),
stride(1) == 1), with ``activation="silu"`` and optionally ``seq_idx`` and
``initial_states``. The view is read without a copy and the output comes back channel-last
too (``out.transpose(1, 2)`` is a contiguous (batch, seqlen, dim) tensor, ready to split
into x, B, C). It is autograd-capable on CPU and CUDA tensors (custom ops
`torch.ops.mamba2_cutile.causal_conv1d_fwd` / `causal_conv1d_bwd`, traceable by
`torch.compile(fullgraph=True)`); the gradient w.r.t. the view lands in the projection's
gradient through the slice's own backward.
"""

from .api import UnsupportedActivation, causal_conv1d_fn, causal_conv1d_update
from .plan import Conv1dConfig, conv1d_config

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "Conv1dConfig", "conv1d_config",
           "UnsupportedActivation"]
