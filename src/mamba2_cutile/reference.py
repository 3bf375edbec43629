"""Plain PyTorch Mamba-2 SSD: the sequential recurrence (the definition) and a chunked version.

`ssd_recurrence` is the obviously-correct loop over tokens, used as the ground truth in tests
(run it in float64). `ssd_chunked` computes the same thing chunk by chunk with matrix products;
it is what CPU tensors passed to `mamba_chunk_scan_combined` run (correct but slow).

Both take mamba_ssm's arguments and return (out, final_states, varlen_states) in float32 or
the requested compute dtype; the public function handles dtypes and return conventions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """dt <- clamp(softplus?(dt + dt_bias), dt_limit), as mamba_ssm."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _expand_groups(t, nheads):
    """(b, l, g, n) -> (b, l, h, n): head i uses group i // (h // g)."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def _D_term(D, x):
    if D is None:
        return 0.0
    return (D[:, None] if D.dim() == 1 else D) * x


def ssd_recurrence(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                   seq_idx=None, cu_seqlens=None, dt_softplus=False,
                   dt_limit=(0.0, float("inf")), dtype=torch.float64):
    """The recurrence, token by token:

        h_t = exp(A * dt_t) * h_{t-1} + dt_t * x_t (outer) B_t        (h_{-1} = initial_states)
        y_t = C_t . h_t + D * x_t ;  y_t *= silu(z_t)

    The state restarts from zero where seq_idx changes. Returns (out, final_states,
    varlen_states or None), all in `dtype`.
    """
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    x, dt, A, B, C, D, z, dt_bias, h0 = map(cast, (x, dt, A, B, C, D, z, dt_bias, initial_states))
    b, l, nh, p = x.shape
    n = B.shape[-1]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch = _expand_groups(B, nh), _expand_groups(C, nh)
    h = torch.zeros(b, nh, p, n, dtype=dtype, device=x.device) if h0 is None else h0.clone()
    ys = []
    states_after = []
    for t in range(l):
        decay = torch.exp(A[None, :] * dt[:, t])                                   # (b, h)
        if seq_idx is not None and t > 0:
            decay = decay * (seq_idx[:, t] == seq_idx[:, t - 1]).to(dtype)[:, None]
        h = decay[:, :, None, None] * h + (dt[:, t, :, None, None] * x[:, t, :, :, None]
                                           * Bh[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
        if cu_seqlens is not None:
            states_after.append(h)
    y = torch.stack(ys, dim=1) if l else x.new_zeros(x.shape)
    y = y + _D_term(D, x)
    if z is not None:
        y = y * F.silu(z)
    varlen = None
    if cu_seqlens is not None:
        varlen = _varlen_from_per_token(states_after, cu_seqlens, h0, (nh, p, n), dtype, x.device)
    return y, h, varlen


def _varlen_from_per_token(states_after, cu_seqlens, h0, shape, dtype, device):
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


def ssd_chunked(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                dtype=torch.float32):
    """The same result as `ssd_recurrence`, chunk by chunk (the SSD algorithm in PyTorch).

    Within a chunk, with G the cumulative sum of A*dt:
        y_i   = exp(G_i) C_i . h_c  +  sum_{j<=i} exp(G_i - G_j) (C_i . B_j) dt_j x_j
        h_c+1 = exp(G_last) h_c     +  sum_j exp(G_last - G_j) dt_j x_j (outer) B_j
    with the same-sequence masks of seq_idx.
    """
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    x, dt, A, B, C, D, z, dt_bias, h0 = map(cast, (x, dt, A, B, C, D, z, dt_bias, initial_states))
    b, l, nh, p = x.shape
    n = B.shape[-1]
    Q = chunk_size
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    if l == 0:
        h = torch.zeros(b, nh, p, n, dtype=dtype, device=x.device) if h0 is None else h0.clone()
        varlen = None
        if cu_seqlens is not None:
            varlen = _varlen_from_per_token([], cu_seqlens, h0, (nh, p, n), dtype, x.device)
        return x.new_zeros(x.shape), h, varlen
    nc = math.ceil(l / Q)
    pad = nc * Q - l
    if seq_idx is None:
        seq = torch.zeros(b, l, dtype=torch.int64, device=x.device)
    else:
        seq = seq_idx.to(torch.int64)
    # pad: zero inputs and dt (so decays and contributions stop), repeat the last seq id
    padt = lambda t: F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))  # noqa: E731
    xc = padt(x).reshape(b, nc, Q, nh, p)
    dtc = padt(dt).reshape(b, nc, Q, nh)
    Bc = _expand_groups(padt(B), nh).reshape(b, nc, Q, nh, n)
    Cc = _expand_groups(padt(C), nh).reshape(b, nc, Q, nh, n)
    seqc = torch.cat([seq, seq[:, -1:].expand(b, pad)], dim=1).reshape(b, nc, Q)

    G = torch.cumsum(A[None, None, None, :] * dtc, dim=2)                     # (b, c, Q, h)
    G_last = G[:, :, -1]                                                       # (b, c, h)
    same = seqc[:, :, :, None] == seqc[:, :, None, :]                          # (b, c, i, j)
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    keep = (same & causal)[..., None]                                          # (b, c, i, j, 1)
    diff = G[:, :, :, None, :] - G[:, :, None, :, :]                          # (b, c, i, j, h)
    L = torch.exp(torch.where(keep, diff, torch.full_like(diff, -math.inf)))
    CB = torch.einsum("bcihn,bcjhn->bcijh", Cc, Bc)
    y = torch.einsum("bcijh,bcjh,bcjhp->bcihp", L * CB, dtc, xc)

    seq_last = seqc[:, :, -1]                                                  # (b, c)
    in_last = (seqc == seq_last[:, :, None])[..., None]                        # (b, c, Q, 1)
    w = torch.exp(G_last[:, :, None, :] - G) * dtc * in_last                   # (b, c, Q, h)
    local = torch.einsum("bcjh,bcjhp,bcjhn->bchpn", w, xc, Bc)
    h = torch.zeros(b, nh, p, n, dtype=dtype, device=x.device) if h0 is None else h0.clone()
    seq_prev = seqc[:, 0, 0]
    entry = []
    for c in range(nc):
        entry.append(h)
        carry = torch.exp(G_last[:, c]) * (seq_last[:, c] == seq_prev).to(dtype)[:, None]
        h = carry[:, :, None, None] * h + local[:, c]
        seq_prev = seq_last[:, c]
    entry = torch.stack(entry, dim=1)                                          # (b, c, h, p, n)
    seq_before = torch.cat([seqc[:, :1, 0], seq_last[:, :-1]], dim=1)           # (b, c)
    state_w = torch.exp(G) * (seqc == seq_before[:, :, None])[..., None]       # (b, c, Q, h)
    y = y + torch.einsum("bcih,bcihn,bchpn->bcihp", state_w, Cc, entry)
    y = y.reshape(b, nc * Q, nh, p)[:, :l]
    y = y + _D_term(D, x)
    if z is not None:
        y = y * F.silu(z)

    varlen = None
    if cu_seqlens is not None:
        varlen = _varlen_from_chunks(cu_seqlens, Q, G, dtc, xc, Bc, entry, h0, dtype)
    return y, h, varlen


def _varlen_from_chunks(cu_seqlens, Q, G, dtc, xc, Bc, entry, h0, dtype):
    """State after each sequence's last token (batch 1): the entry state of the chunk holding
    that token, decayed to it, plus the sequence's tokens inside that chunk."""
    bounds = [int(v) for v in cu_seqlens.tolist()]
    nh, p, n = entry.shape[2:]
    out = []
    for s in range(len(bounds) - 1):
        start, end = bounds[s], bounds[s + 1]
        if end <= start:
            keep_h0 = start == 0 and h0 is not None
            out.append(h0[0] if keep_h0 else entry.new_zeros(nh, p, n))
            continue
        c, last = (end - 1) // Q, (end - 1) % Q
        lo = max(start - c * Q, 0)
        g = G[0, c]                                                            # (Q, h)
        w = torch.exp(g[last] - g[lo:last + 1]) * dtc[0, c, lo:last + 1]      # (t, h)
        st = torch.einsum("th,thp,thn->hpn", w, xc[0, c, lo:last + 1], Bc[0, c, lo:last + 1])
        if start < c * Q or start == 0:    # running when the chunk began, or owns h0
            st = st + torch.exp(g[last])[:, None, None] * entry[0, c]
        out.append(st)
    if not out:
        return entry.new_zeros(0, nh, p, n)
    return torch.stack(out)
