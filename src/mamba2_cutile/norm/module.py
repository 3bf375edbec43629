"""`RMSNorm`, the module form of `rmsnorm_fn`, with mamba_ssm's constructor, defaults and
parameter names (`weight`, ones; `bias`, registered as None), so its state dicts load."""

from __future__ import annotations

import torch

from .api import rmsnorm_fn


class RMSNorm(torch.nn.Module):
    """Gated RMSNorm over groups of `group_size` channels (None: all `hidden_size`).

    forward(x, z=None): rmsnorm(x) * weight * silu(z) if norm_before_gate, else
    rmsnorm(x * silu(z)) * weight; without z, rmsnorm(x) * weight.
    """

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                 device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return rmsnorm_fn(x, self.weight, self.bias, z=z, eps=self.eps,
                          group_size=self.group_size, norm_before_gate=self.norm_before_gate)

    def extra_repr(self):
        return (f"{self.weight.shape[0]}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}")
