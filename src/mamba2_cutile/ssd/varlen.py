"""varlen_states: the state after each sequence's last token, for `cu_seqlens` at batch 1,
from the forward's chunk entry states and decay buffers (no host synchronization)."""

from __future__ import annotations

import torch


def empty_varlen_states(cu_seqlens, init, shape, dtype):
    """varlen_states when there are no tokens (l = 0): zeros, or the initial state."""
    nseq = cu_seqlens.shape[0] - 1
    res = torch.zeros((nseq,) + shape, dtype=torch.float32, device=cu_seqlens.device)
    if init is not None and nseq:
        res[:] = init[0]          # l = 0: every sequence is empty and starts at token 0
    return res.to(dtype)


def varlen_states_from_chunks(x, B, dt_buf, cum_buf, states, init, cu_seqlens, Q):
    """State after each sequence's last token (batch 1), without a host sync.

    The state entering the chunk c that holds the last token e-1, decayed to e-1 (only if the
    sequence was running when the chunk began), plus that sequence's tokens inside chunk c.
    """
    l, h = x.shape[1], x.shape[2]
    g = B.shape[2]
    dev = x.device
    cu = cu_seqlens.to(torch.int64)
    start, end = cu[:-1], cu[1:]
    nseq = start.shape[0]
    last = (end - 1).clamp(min=0, max=max(l - 1, 0))
    chunk = last // Q
    tok = chunk[:, None] * Q + torch.arange(Q, device=dev)                    # (s, Q)
    valid = (tok >= start[:, None]) & (tok <= (end - 1)[:, None])
    tokc = tok.clamp(max=l - 1)
    xs = x[0][tokc].float()                                                   # (s, Q, h, p)
    Bs = B[0][tokc].float().repeat_interleave(h // g, dim=2)                  # (s, Q, h, n)
    gq = cum_buf[0][:, tok].permute(1, 2, 0)                                  # (s, Q, h)
    dq = dt_buf[0][:, tok].permute(1, 2, 0)
    g_last = cum_buf[0][:, last].t()                                          # (s, h)
    # tokens of other sequences are selected away, never multiplied by a zero weight: their
    # x, B or dt may be NaN/Inf (0 * NaN), and must not reach this sequence's state
    vq = valid[..., None]
    w = torch.where(vq, torch.exp2(g_last[:, None, :] - gq) * dq, 0.0)
    xs = torch.where(vq[..., None], xs, 0.0)
    Bs = torch.where(vq[..., None], Bs, 0.0)
    st = torch.einsum("sqh,sqhp,sqhn->shpn", w, xs, Bs)
    # the carried state belongs to the sequence: it began before chunk c, or at token 0 (it
    # then owns the initial state, even after leading empty sequences)
    running = ((start < chunk * Q) | (start == 0)) & (end > start)
    entering = states[0][:, chunk].transpose(0, 1).float()                    # (s, h, p, n)
    carried = torch.exp2(g_last)[:, :, None, None] * entering
    st = st + torch.where(running[:, None, None, None], carried, 0.0)
    if init is not None and nseq:
        # an empty sequence at token 0 keeps the initial state
        keep = ((end <= start) & (start == 0))[:, None, None, None]
        st = torch.where(keep, init[0].float()[None], st)
    return st
