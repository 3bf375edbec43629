"""The Mamba-2 decode step, row by row and step by step in float64: the definition the decode
kernel and its CPU path are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                               dt_softplus=False, state_batch_indices=None, out_states=None):
    """The definition, in float64, row by row and step by step; `state` is not modified
    (nor `out_states`, accepted only so it takes the same arguments as the real function).

    Returns (y shaped like x, the whole new state (nslots, h, p, n), the state after each
    step (batch, k, h, p, n), zero for padding rows), all float64.
    """
    f = lambda t: None if t is None else t.detach().to(torch.float64)  # noqa: E731
    steps = x.dim() == 4
    x, dt, z, B, C = (None if t is None else (t if steps else t.unsqueeze(1))
                      for t in (x, dt, z, B, C))
    x, dt, z, B, C, A, D, dt_bias = map(f, (x, dt, z, B, C, A, D, dt_bias))
    new = f(state).clone()
    b, k, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if D is not None and D.dim() == 1:
        D = D[:, None].expand(h, p)
    if dt_bias is not None and dt_bias.dim() == 1:
        dt_bias = dt_bias[:, None].expand(h, p)
    dev = x.device
    group = torch.arange(h, device=dev) // (h // g)
    y = torch.zeros(b, k, h, p, dtype=torch.float64, device=dev)
    per_step = torch.zeros(b, k, h, p, n, dtype=torch.float64, device=dev)
    for r in range(b):
        slot = r if state_batch_indices is None else int(state_batch_indices[r])
        if slot < 0:
            continue
        st = new[slot]                                                         # (h, p, n)
        for t in range(k):
            d = dt[r, t]
            if dt_bias is not None:
                d = d + dt_bias
            if dt_softplus:
                d = F.softplus(d)
            dA = torch.exp(A * d[:, :, None])
            st = st * dA + (d * x[r, t])[:, :, None] * B[r, t, group][:, None, :]
            out = (st * C[r, t, group][:, None, :]).sum(-1)
            if D is not None:
                out = out + D * x[r, t]
            if z is not None:
                out = out * z[r, t] * torch.sigmoid(z[r, t])
            y[r, t] = out
            per_step[r, t] = st
        new[slot] = st
    return (y if steps else y[:, 0]), new, per_step
