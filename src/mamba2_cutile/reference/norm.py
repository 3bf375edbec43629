"""Gated RMSNorm in PyTorch: the definition (differentiable, for the tests' float64 ground truth),
the forward with its saved statistics, and the explicit backward (the CPU backward and the
blueprint of the backward kernel).

For a row x of `hidden` channels split into groups of `group_size` channels, gate z (like x),
weight w and optional bias b:

    silu(z)  = z * sigmoid(z)
    u        = x * silu(z)  if z is given and not norm_before_gate, else x
    rstd_g   = 1 / sqrt(mean_{j in group g}(u_j^2) + eps)                   (one per row and group)
    xhat_j   = u_j * rstd_g
    y_j      = xhat_j * w_j (+ b_j)
    out_j    = y_j * silu(z_j)  if z is given and norm_before_gate, else y_j

Backward, per row and group of n = group_size channels, for the gradient dout of out:

    dy       = dout * silu(z)  (norm_before_gate with z), else dout
    dz       = dout * y * silu'(z)              (norm_before_gate with z)
    dw      += dy * xhat,   db += dy            (summed over rows)
    c        = sum_j xhat_j * w_j * dy_j / n
    du       = (w * dy - xhat * c) * rstd
    dx       = du * silu(z), dz = du * x * silu'(z)   (gate before the norm), else dx = du

with silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z))).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _grouped(t, group_size):
    """(..., hidden) -> (..., hidden // group_size, group_size), a view."""
    return t.unflatten(-1, (t.shape[-1] // group_size, group_size))


def rmsnorm_gated_ref(x, weight, bias=None, z=None, eps=1e-6, group_size=None,
                      norm_before_gate=True, dtype=torch.float64):
    """The gated RMSNorm above, computed in `dtype` (float64: the ground truth) and returned in
    `dtype`; x (..., hidden), weight and bias (hidden,), z like x. Differentiable."""
    hidden = x.shape[-1]
    gs = hidden if group_size is None else group_size
    u = x.to(dtype)
    gate = F.silu(z.to(dtype)) if z is not None else None
    if gate is not None and not norm_before_gate:
        u = u * gate
    ug = _grouped(u, gs)
    rstd = torch.rsqrt(ug.square().mean(dim=-1, keepdim=True) + eps)
    y = (ug * rstd).flatten(-2) * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y


def rmsnorm_gated_forward(x, weight, bias, z, eps, group_size, norm_before_gate, dtype):
    """The forward on rows: x and z (M, hidden). Returns (out in `dtype`, rstd (ngroups, M)
    in `dtype`); rstd is what the backward needs besides the inputs."""
    m, hidden = x.shape
    u = x.to(dtype)
    gate = F.silu(z.to(dtype)) if z is not None else None
    if gate is not None and not norm_before_gate:
        u = u * gate
    ug = _grouped(u, group_size)                                        # (M, G, S)
    rstd = torch.rsqrt(ug.square().mean(dim=-1) + eps)                  # (M, G)
    y = (ug * rstd[..., None]).reshape(m, hidden) * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y, rstd.transpose(0, 1).contiguous()


def rmsnorm_gated_backward(dout, x, weight, bias, z, rstd, group_size, norm_before_gate, dtype):
    """The explicit backward above on rows: dout, x, z (M, hidden), rstd (ngroups, M) from
    `rmsnorm_gated_forward`. Returns (dx, dweight, dbias or None, dz or None), in `dtype`."""
    m, hidden = x.shape
    g = hidden // group_size
    xf, dy = x.to(dtype), dout.to(dtype)
    w = weight.to(dtype)
    r = rstd.to(dtype).transpose(0, 1)[..., None]                       # (M, G, 1)
    dz = None
    if z is not None:
        zf = z.to(dtype)
        sg = torch.sigmoid(zf)
        gate = zf * sg
        dgate = sg * (1 + zf * (1 - sg))
    u = xf * gate if z is not None and not norm_before_gate else xf
    xhat = (_grouped(u, group_size) * r).reshape(m, hidden)
    if z is not None and norm_before_gate:
        y = xhat * w
        if bias is not None:
            y = y + bias.to(dtype)
        dz = dy * y * dgate
        dy = dy * gate
    dweight = (dy * xhat).sum(0)
    dbias = dy.sum(0) if bias is not None else None
    wdy = (w * dy).reshape(m, g, group_size)
    xh = xhat.reshape(m, g, group_size)
    c = (xh * wdy).sum(-1, keepdim=True) / group_size
    du = ((wdy - xh * c) * r).reshape(m, hidden)
    if z is not None and not norm_before_gate:
        dz = du * xf * dgate
        dx = du * gate
    else:
        dx = du
    return dx, dweight, dbias, dz
