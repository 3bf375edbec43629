"""Gated RMSNorm (mamba_ssm's `rmsnorm_fn` / `RMSNorm` of `ops/triton/layernorm_gated.py`):
`rmsnorm_fn` (api), the module `RMSNorm` (module), the custom ops and their autograd
(custom_ops), the config and launch plans of the cuTile kernels (plan).

Contract for callers such as the fused Mamba-2 layer:

    rmsnorm_fn(y, weight, None, z=z, eps=eps, group_size=dim // ngroups,
               norm_before_gate=norm_before_gate)

- y: (batch * seqlen, dim) or (batch, seqlen, dim), any leading strides with a unit last
  stride (read in place); z: y's shape, may be a strided slice of the input projection (read
  in place, never copied when its last stride is 1); weight (dim,); dim % group_size == 0.
- Returns y's shape in y's dtype (fp16, bf16, fp32; fp64 on the CPU), contiguous;
  statistics in float32.
- Differentiable in y, z, weight (and bias) on CPU and CUDA tensors, through the custom ops
  `torch.ops.mamba2_cutile.rmsnorm_gated_fwd` / `rmsnorm_gated_bwd` (torch.compile traces it
  with fullgraph=True). The CUDA forward and backward are one launch each, plus a `torch.sum`
  of the backward's per-program dweight / dbias partials: deterministic, no host
  synchronization (CUDA-graph safe). The gradient of a strided z reaches the projection
  through autograd's view tracking.
- The ops themselves, for callers that keep their own autograd (both take (M, hidden) rows;
  a unit channel stride is read in place, anything else is copied on the GPU):
  `rmsnorm_gated_fwd(x, weight, bias, z, eps, group_size, norm_before_gate) -> (out, rstd)`
  with out (M, hidden) contiguous in x's dtype and rstd (hidden // group_size, M) float32
  (float64 for float64 inputs); `rmsnorm_gated_bwd(dout, x, weight, bias, z, rstd,
  group_size, norm_before_gate) -> [dx, dweight, dbias, dz]`, contiguous, in the dtypes of
  x, weight, bias, z, with an empty tensor for an absent bias or z.
- GPU limits: group_size <= 16384 and at most 65535 groups; bad arguments raise ValueError
  or TypeError naming the argument.
"""

from .api import rmsnorm_fn
from .module import RMSNorm
from .plan import NormConfig, norm_config

__all__ = ["rmsnorm_fn", "RMSNorm", "NormConfig", "norm_config"]
