"""The Mamba-2 SSD computed chunk by chunk with matrix products, in PyTorch: the same values as
the recurrence (`recurrence.ssd_recurrence`), and what CPU tensors passed to
`mamba_chunk_scan_combined` run (correct but slow).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import autocast_off, d_term, expand_groups, process_dt
from .recurrence import varlen_from_per_token


@autocast_off
def ssd_chunked(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                dtype=torch.float32):
    """The same result as `ssd_recurrence`, chunk by chunk (the SSD algorithm in PyTorch).

    Within a chunk, with G the cumulative sum of A*dt:
        y_i   = exp(G_i) C_i . h_c  +  sum_{j<=i} exp(G_i - G_j) (C_i . B_j) dt_j x_j
        h_c+1 = exp(G_last) h_c     +  sum_j exp(G_last - G_j) dt_j x_j (outer) B_j
    with the same-sequence masks of seq_idx.

    Non-finite inputs give what the recurrence gives: every mask is a select (0 * NaN would
    carry a bad token into the outputs before it, or into the next sequence); a bad x_j
    enters the products as 0 and its NaN is put back on the outputs whose sums keep key j;
    decays exp(G_i - G_j) are taken as exp(finite part) times 0 for each A dt = -inf step in
    between (A = -inf, dt = inf) and NaN for a NaN or +inf step, so G never forms -inf - -inf.
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

    G = _log_decays(A[None, None, None, :] * dtc, dtc)                        # (b, c, Q, h) x3
    G_last = tuple(g[:, :, -1] for g in G)                                     # (b, c, h)
    G_zero = tuple(torch.zeros_like(g) for g in G_last)
    same = seqc[:, :, :, None] == seqc[:, :, None, :]                          # (b, c, i, j)
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    keep = (same & causal)[..., None]                                          # (b, c, i, j, 1)
    L = _decay(tuple(g[:, :, :, None, :] for g in G), tuple(g[:, :, None, :, :] for g in G))
    CB = torch.einsum("bcihn,bcjhn->bcijh", Cc, Bc)
    S = torch.where(keep, L * CB * dtc[:, :, None, :, :], torch.zeros_like(CB))
    x_bad = ~torch.isfinite(xc)
    x_ok = torch.where(x_bad, torch.zeros_like(xc), xc)
    y = torch.einsum("bcijh,bcjhp->bcihp", S, x_ok)
    reached = torch.einsum("bcij,bcjhp->bcihp", keep[..., 0].to(dtype), x_bad.to(dtype))
    y = torch.where(reached > 0, torch.full_like(y, math.nan), y)

    seq_last = seqc[:, :, -1]                                                  # (b, c)
    in_last = (seqc == seq_last[:, :, None])[..., None]                        # (b, c, Q, 1)
    w = _decay(tuple(g[:, :, None, :] for g in G_last), G) * dtc               # (b, c, Q, h)
    w = torch.where(in_last, w, torch.zeros_like(w))
    x_in = torch.where(in_last[..., None], xc, torch.zeros_like(xc))
    B_in = torch.where(in_last[..., None], Bc, torch.zeros_like(Bc))
    local = torch.einsum("bcjh,bcjhp,bcjhn->bchpn", w, x_in, B_in)
    chunk_decay = _decay(G_last, G_zero)                                       # (b, c, h)
    h = torch.zeros(b, nh, p, n, dtype=dtype, device=x.device) if h0 is None else h0.clone()
    seq_prev = seqc[:, 0, 0]
    entry = []
    for c in range(nc):
        entry.append(h)
        carried = chunk_decay[:, c, :, None, None] * h
        keep_h = (seq_last[:, c] == seq_prev)[:, None, None, None]
        h = torch.where(keep_h, carried, torch.zeros_like(carried)) + local[:, c]
        seq_prev = seq_last[:, c]
    entry = torch.stack(entry, dim=1)                                          # (b, c, h, p, n)
    seq_before = torch.cat([seqc[:, :1, 0], seq_last[:, :-1]], dim=1)           # (b, c)
    state_w = _decay(G, tuple(g[:, :, None, :] for g in G_zero))                # (b, c, Q, h)
    y_state = torch.einsum("bcih,bcihn,bchpn->bcihp", state_w, Cc, entry)
    takes_state = (seqc == seq_before[:, :, None])[..., None, None]             # (b, c, Q, 1, 1)
    y = y + torch.where(takes_state, y_state, torch.zeros_like(y_state))
    y = y.reshape(b, nc * Q, nh, p)[:, :l]
    y = y + d_term(D, x)
    if z is not None:
        y = y * F.silu(z)

    varlen = None
    if cu_seqlens is not None:
        varlen = _varlen_from_chunks(cu_seqlens, Q, G, dtc, xc, Bc, entry, h0, dtype)
    return y, h, varlen


def _log_decays(a_dt, dt):
    """A dt' as (finite part cumsum, count of -inf steps, count of NaN/+inf steps), each
    cumulated over the chunk axis (2); A dt' = 0 where dt' = 0 (also for A = -inf)."""
    a_dt = torch.where(dt == 0, torch.zeros_like(a_dt), a_dt)
    finite = torch.isfinite(a_dt)
    to_zero = a_dt == -math.inf
    return (torch.cumsum(torch.where(finite, a_dt, torch.zeros_like(a_dt)), dim=2),
            torch.cumsum(to_zero.to(a_dt.dtype), dim=2),
            torch.cumsum((~finite & ~to_zero).to(a_dt.dtype), dim=2))


def _decay(g_to, g_from):
    """exp(G_to - G_from) from `_log_decays` triples: 0 across a -inf step, NaN across a NaN
    or +inf one (where the recurrence's state turns non-finite)."""
    d = torch.exp(g_to[0] - g_from[0])
    d = torch.where(g_to[1] != g_from[1], torch.zeros_like(d), d)
    return torch.where(g_to[2] != g_from[2], torch.full_like(d, math.nan), d)


def _varlen_from_chunks(cu_seqlens, Q, G, dtc, xc, Bc, entry, h0, dtype):
    """State after each sequence's last token (batch 1): the entry state of the chunk holding
    that token, decayed to it, plus the sequence's tokens inside that chunk (G: the
    `_log_decays` triple)."""
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
        g = tuple(t[0, c] for t in G)                                          # (Q, h) x3
        g_end = tuple(t[last] for t in g)
        w = _decay(g_end, tuple(t[lo:last + 1] for t in g)) * dtc[0, c, lo:last + 1]  # (t, h)
        st = torch.einsum("th,thp,thn->hpn", w, xc[0, c, lo:last + 1], Bc[0, c, lo:last + 1])
        if start < c * Q or start == 0:    # running when the chunk began, or owns h0
            decay = _decay(g_end, tuple(torch.zeros_like(t) for t in g_end))
            st = st + decay[:, None, None] * entry[0, c]
        out.append(st)
    if not out:
        return entry.new_zeros(0, nh, p, n)
    return torch.stack(out)
