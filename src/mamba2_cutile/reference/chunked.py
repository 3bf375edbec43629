"""The Mamba-2 SSD computed chunk by chunk with matrix products, in PyTorch: the same values as
the recurrence (`recurrence.ssd_recurrence`), and what CPU tensors passed to
`mamba_chunk_scan_combined` run (correct but slow).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import d_term, expand_groups, process_dt
from .recurrence import varlen_from_per_token


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
            varlen = varlen_from_per_token([], cu_seqlens, h0, (nh, p, n), dtype, x.device)
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
    Bc = expand_groups(padt(B), nh).reshape(b, nc, Q, nh, n)
    Cc = expand_groups(padt(C), nh).reshape(b, nc, Q, nh, n)
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
    y = y + d_term(D, x)
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
