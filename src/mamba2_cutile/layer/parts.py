"""The SwiGLU branch of the layer (d_mlp > 0), forward and explicit backward, in PyTorch: the
fused function's forward runs the first, its backward the second on zx0 (recomputed, never
saved). Computed in the dtype of the inputs (the callers pass float32, or float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_grad(x):
    """d silu(x) / dx = s (1 + x (1 - s)) with s = sigmoid(x)."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def swiglu_forward(zx0):
    """silu(a) * b for zx0 = [a | b] (split in halves along the last dimension)."""
    a, b = zx0.chunk(2, dim=-1)
    return F.silu(a) * b


def swiglu_backward(dy, zx0):
    """Gradient of `swiglu_forward`: [dy b silu'(a) | dy silu(a)]."""
    a, b = zx0.chunk(2, dim=-1)
    return torch.cat([dy * b * silu_grad(a), dy * F.silu(a)], dim=-1)
