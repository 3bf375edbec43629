"""The Mamba-2 SSD recurrence, token by token: the definition every kernel is checked against
(run it in float64).

Takes mamba_ssm's arguments and returns (out, final_states, varlen_states) in the requested
compute dtype; the public function handles dtypes and return conventions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import d_term, expand_groups, process_dt


def ssd_recurrence(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                   seq_idx=None, cu_seqlens=None, dt_softplus=False,
                   dt_limit=(0.0, float("inf")), dtype=torch.float64):
    """The recurrence, token by token:

        h_t = exp(A * dt_t) * h_{t-1} + dt_t * x_t (outer) B_t        (h_{-1} = initial_states)
        y_t = C_t . h_t + D * x_t ;  y_t *= silu(z_t)

    The state restarts from zero where seq_idx changes (a select, so a NaN or Inf of an
    earlier sequence does not reach the next one), and A * dt_t is 0 where dt_t = 0 (a decay
    of 1, also for A = -inf, where IEEE gives NaN). Returns (out, final_states, varlen_states
    or None), all in `dtype`.
    """
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    x, dt, A, B, C, D, z, dt_bias, h0 = map(cast, (x, dt, A, B, C, D, z, dt_bias, initial_states))
    b, l, nh, p = x.shape
    n = B.shape[-1]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch = expand_groups(B, nh), expand_groups(C, nh)
    h = torch.zeros(b, nh, p, n, dtype=dtype, device=x.device) if h0 is None else h0.clone()
    ys = []
    states_after = []
    for t in range(l):
        a_dt = A[None, :] * dt[:, t]
        decay = torch.exp(torch.where(dt[:, t] == 0, torch.zeros_like(a_dt), a_dt))  # (b, h)
        h = decay[:, :, None, None] * h
        if seq_idx is not None and t > 0:
            same = (seq_idx[:, t] == seq_idx[:, t - 1])[:, None, None, None]
            h = torch.where(same, h, torch.zeros_like(h))
        h = h + dt[:, t, :, None, None] * x[:, t, :, :, None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
        if cu_seqlens is not None:
            states_after.append(h)
    y = torch.stack(ys, dim=1) if l else x.new_zeros(x.shape)
    y = y + d_term(D, x)
    if z is not None:
        y = y * F.silu(z)
    varlen = None
    if cu_seqlens is not None:
        varlen = varlen_from_per_token(states_after, cu_seqlens, h0, (nh, p, n), dtype, x.device)
    return y, h, varlen


def varlen_from_per_token(states_after, cu_seqlens, h0, shape, dtype, device):
    """varlen_states from the state after every token (an empty sequence at token 0 keeps h0)."""
    out = []
    bounds = [int(v) for v in cu_seqlens.tolist()]
    for s in range(len(bounds) - 1):
        start, end = bounds[s], bounds[s + 1]
        if end > start:
            out.append(states_after[end - 1][0])
        elif start == 0 and h0 is not None:  # an empty sequence at token 0 keeps h0
            out.append(h0[0])
        else:
            out.append(torch.zeros(shape, dtype=dtype, device=device))
    return torch.stack(out) if out else torch.zeros((0,) + shape, dtype=dtype, device=device)
