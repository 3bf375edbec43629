"""The fused Mamba-2 layer written out from its formulas: the definition the fused function
(`mamba2_cutile.layer`) is checked against. Differentiable with autograd; run it in float64.

    zxbcdt = [zx0 (2 d_mlp) | z (dim) | xBC (dim + 2 g n) | dt (h)]          dim = h p
    xBC'   = act(bias + causal depthwise conv(xBC, weight))     (F.conv1d; act = silu or none)
    x, B, C = split(xBC')
    y, h_T = SSD recurrence(x, softplus(dt + dt_bias) clamped to dt_limit, A, B, C, D
                            [, z when there is no norm], initial_states, seq_idx)
    y      = gated RMSNorm(y, z) with group size dim / g       (when rmsnorm_weight is given)
    y      = [silu(zx0[:d_mlp]) * zx0[d_mlp:] | y]              (when d_mlp > 0)
    out    = y W^T + b                                          (when outproj_weight is given)

With seq_idx the convolution does not mix tokens of different sequences either: a tap that
reaches into the previous sequence reads 0, as causal-conv1d does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .recurrence import ssd_recurrence


def causal_conv1d_ref(x, weight, bias=None, seq_idx=None, activation=None):
    """x (b, l, c) channel-last, weight (c, w), bias (c,): out[t] = bias + sum_k weight[:, k]
    * x[t - (w - 1) + k] (0 before token 0 and across seq_idx changes; 0 at tokens whose
    seq_idx is negative, padding, as causal-conv1d), then silu if activation is "silu"/"swish".
    F.conv1d when there is no seq_idx; taps one by one with it."""
    b, l, c = x.shape
    w = weight.shape[1]
    if seq_idx is None:
        out = F.conv1d(x.transpose(1, 2), weight[:, None, :], bias, padding=w - 1, groups=c)
        out = out[..., :l].transpose(1, 2)
    else:
        out = torch.zeros_like(x) if bias is None else bias.expand(b, l, c).clone()
        for k in range(w):
            shift = w - 1 - k
            xs = F.pad(x, (0, 0, shift, 0))[:, :l]
            same = seq_idx == F.pad(seq_idx, (shift, 0), value=-1)[:, :l]
            out = out + weight[:, k] * xs * same[..., None].to(x.dtype)
        out = out * (seq_idx >= 0)[..., None].to(x.dtype)      # negative id: a padding token
    return F.silu(out) if activation in ("silu", "swish") else out


def gated_rmsnorm_ref(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Per group of `group_size` channels (default: all): u = x (x * silu(z) when gating
    before the norm), u / sqrt(mean(u^2) + eps) * weight, times silu(z) when
    norm_before_gate."""
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    gs = x.shape[-1] if group_size is None else group_size
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // gs, gs)
    rstd = torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)
    out = (xg * rstd).reshape(x.shape) * weight
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out


def split_sizes(d_in_proj, nheads, headdim, ngroups, dstate):
    """(d_mlp, dim, conv_dim) of a zxbcdt whose last dimension is d_in_proj."""
    dim = nheads * headdim
    conv_dim = dim + 2 * ngroups * dstate
    return (d_in_proj - dim - conv_dim - nheads) // 2, dim, conv_dim


def mamba_split_conv1d_scan_ref(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                initial_states=None, seq_idx=None,
                                dt_limit=(0.0, float("inf")), activation="silu",
                                rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None,
                                outproj_bias=None, headdim=None, ngroups=1,
                                norm_before_gate=True, dtype=torch.float64):
    """The layer of the module docstring, in `dtype`. Returns (out, final_states)."""
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight,
     outproj_weight, outproj_bias) = map(cast, (
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight,
        outproj_weight, outproj_bias))
    nheads = A.shape[0]
    headdim = D.shape[1] if D.dim() == 2 else headdim
    bsz, l, d_in_proj = zxbcdt.shape
    dstate = (conv1d_weight.shape[0] - nheads * headdim) // (2 * ngroups)
    d_mlp, dim, conv_dim = split_sizes(d_in_proj, nheads, headdim, ngroups, dstate)
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_mlp, dim, conv_dim, nheads], dim=-1)
    xBC = causal_conv1d_ref(xBC, conv1d_weight, conv1d_bias, seq_idx, activation)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    y, final, _ = ssd_recurrence(
        x.reshape(bsz, l, nheads, headdim), dt, A, B.reshape(bsz, l, ngroups, dstate),
        C.reshape(bsz, l, ngroups, dstate), D=D,
        z=None if rmsnorm_weight is not None else z.reshape(bsz, l, nheads, headdim),
        dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True,
        dt_limit=dt_limit, dtype=dtype)
    y = y.reshape(bsz, l, dim)
    if rmsnorm_weight is not None:
        y = gated_rmsnorm_ref(y, rmsnorm_weight, z, rmsnorm_eps, dim // ngroups,
                              norm_before_gate)
    if d_mlp > 0:
        y = torch.cat([F.silu(zx0[..., :d_mlp]) * zx0[..., d_mlp:], y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return y, final
