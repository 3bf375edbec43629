"""The layer's pointwise and small parts in PyTorch, forward and explicit backward: the causal
depthwise convolution and the SwiGLU branch. The fused function's CPU path
runs their forwards; its backward (every device) runs their backwards on what it recomputes.

Tensors are channel-last, (batch, seqlen, channels); each function computes in the dtype of
its inputs (the callers pass float32, or float64 for float64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_grad(x):
    """d silu(x) / dx = s (1 + x (1 - s)) with s = sigmoid(x)."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _tap_masks(seq_idx, width, seqlen):
    """For each tap k (shift = width - 1 - k tokens back), a (b, l, 1) mask: token t - shift
    exists and belongs to token t's sequence; None without seq_idx (only the start pads)."""
    if seq_idx is None:
        return [None] * width
    masks = []
    for k in range(width):
        shift = width - 1 - k
        prev = F.pad(seq_idx, (shift, 0), value=-1)[:, :seqlen]
        masks.append((prev == seq_idx)[..., None])
    return masks


def _shift_back(t, shift):
    """t[:, i - shift] along dim 1 (0 before the start)."""
    return F.pad(t, (0, 0, shift, 0))[:, :t.shape[1]] if shift else t


def _shift_forward(t, shift):
    """t[:, i + shift] along dim 1 (0 past the end)."""
    return F.pad(t, (0, 0, 0, shift))[:, shift:] if shift else t


def conv_forward(x, weight, bias=None, seq_idx=None):
    """The pre-activation causal depthwise convolution: x (b, l, c), weight (c, w), bias (c,)

        pre[t] = bias + sum_k weight[:, k] x[t - (w - 1 - k)]      (taps outside t's sequence: 0)
    """
    w = weight.shape[1]
    masks = _tap_masks(seq_idx, w, x.shape[1])
    pre = torch.zeros_like(x) if bias is None else bias.expand_as(x).clone()
    for k in range(w):
        tap = _shift_back(x, w - 1 - k)
        if masks[k] is not None:
            tap = tap.masked_fill(~masks[k], 0)
        pre = pre + weight[:, k] * tap
    return pre


def conv_backward(dpre, x, weight, seq_idx=None, with_bias=True):
    """Gradients of `conv_forward` for the cotangent dpre (b, l, c):

        dx[s]      = sum_k weight[:, k] dpre[s + w - 1 - k]   (same-sequence taps only)
        dweight[k] = sum_{b, t} dpre[t] x[t - (w - 1 - k)]
        dbias      = sum_{b, t} dpre[t]

    Returns (dx, dweight, dbias or None)."""
    w = weight.shape[1]
    masks = _tap_masks(seq_idx, w, x.shape[1])
    dx = torch.zeros_like(x)
    dweight = []
    for k in range(w):
        shift = w - 1 - k
        g = dpre if masks[k] is None else dpre.masked_fill(~masks[k], 0)
        dx = dx + weight[:, k] * _shift_forward(g, shift)
        dweight.append((g * _shift_back(x, shift)).sum(dim=(0, 1)))
    dbias = dpre.sum(dim=(0, 1)) if with_bias else None
    return dx, torch.stack(dweight, dim=1), dbias


def swiglu_forward(zx0):
    """silu(a) * b for zx0 = [a | b] (split in halves along the last dimension)."""
    a, b = zx0.chunk(2, dim=-1)
    return F.silu(a) * b


def swiglu_backward(dy, zx0):
    """Gradient of `swiglu_forward`: [dy b silu'(a) | dy silu(a)]."""
    a, b = zx0.chunk(2, dim=-1)
    return torch.cat([dy * b * silu_grad(a), dy * F.silu(a)], dim=-1)
