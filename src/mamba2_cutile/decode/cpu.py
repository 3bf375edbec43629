"""The decode step on CPU tensors: the kernel's math in PyTorch, with its rounding points."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .plan import steps_view as _steps


def update_torch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx, out_states, y):
    """The CPU path: the kernel's math in PyTorch, vectorized over rows (float32, or float64
    when the state or x is float64), state kept unrounded across the k steps."""
    x4, dt4, z4, y4, B4, C4 = (_steps(t, 3) for t in (x, dt, z, y, B, C))
    out5 = None if out_states is None else _steps(out_states, 4)
    b, k, h, p = x4.shape
    g = B4.shape[2]
    f64 = torch.float64
    cd = f64 if f64 in (state.dtype, x.dtype) else torch.float32
    slots = torch.arange(b) if idx is None else idx.to(torch.int64)
    padding = slots < 0
    y4[padding] = 0
    rows = torch.nonzero(~padding).flatten()
    slots = slots[rows]
    if rows.numel() == 0 or k == 0:
        return
    cast = lambda t: None if t is None else t.to(cd)  # noqa: E731
    A, D, dt_bias = cast(A), cast(D), cast(dt_bias)
    if D is not None and D.dim() == 1:
        D = D[:, None]
    if dt_bias is not None and dt_bias.dim() == 1:
        dt_bias = dt_bias[:, None]
    s = state[slots].to(cd)                                                    # (r, h, p, n)
    for t in range(k):
        d = dt4[rows, t].to(cd)                                                # (r, h, p)
        if dt_bias is not None:
            d = d + dt_bias
        if dt_softplus:
            d = F.softplus(d)
        xt = x4[rows, t].to(cd)
        Bt = B4[rows, t].to(cd).repeat_interleave(h // g, dim=1)               # (r, h, n)
        Ct = C4[rows, t].to(cd).repeat_interleave(h // g, dim=1)
        s = s * torch.exp(A * d[..., None]) + (d * xt)[..., None] * Bt[:, :, None, :]
        if out5 is not None:
            out5[rows, t] = s.to(out5.dtype)
        yt = (s * Ct[:, :, None, :]).sum(-1)
        if D is not None:
            yt = yt + D * xt
        if z4 is not None:
            zt = z4[rows, t].to(cd)
            yt = yt * (zt * torch.sigmoid(zt))
        y4[rows, t] = yt.to(y4.dtype)
    state[slots] = s.to(state.dtype)
