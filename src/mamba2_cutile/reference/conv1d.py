"""Float64 definitions of the depthwise causal conv1d and its decode update (the ground truth of
the conv1d tests; slow, written for clarity).

Forward, for batch row b, channel c, token t (width W, weight w of shape (dim, W)):

    e(u)      = x[b, c, u]                     for 0 <= u < seqlen
              = initial_states[b, c, W-1+u]    for -(W-1) <= u < 0 (zero without initial_states)
    id(u)     = seq_idx[b, u]; id(u < 0) = seq_idx[b, 0] with initial_states (the row's first
                sequence owns them), and matches nothing without
    pre[t]    = bias[c] + sum_{k<W} w[c, k] * e(t - (W-1) + k) * [id(t - (W-1) + k) == id(t)]
    out[t]    = act(pre[t]), act = identity or SiLU; 0 where id(t) < 0 (a padding token)
    final[j]  = e(seqlen - (W-1) + j) * [id(seqlen - (W-1) + j) == id(seqlen - 1)],  j < W-1

so without seq_idx the final state is the last W-1 inputs of the row (the initial states
shifted in when seqlen < W-1), and with seq_idx the last W-1 inputs of the row's last sequence,
zero where that sequence is shorter.

Update (decode), for k new tokens x[b, c, 0:k] and the state s = conv_state[slot] of length S:

    plain:    window = cat(s, x)[S-(W-1):]; new state = cat(s, x)[-S:]
    circular: with p = cache_seqlens[b] mod S, window = s[(p-(W-1)+i) mod S for i < W-1] ++ x,
              and x[t] is written at (p + t) mod S, in order (a later token wins)
    out[t]    = act(bias + sum_i w[c, i] * window[t + i])

A negative conv_state_indices entry marks a padding row: out 0, no state changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

F64 = torch.float64


def _window_mask(seq_idx, seqlen, width, has_init, batch, device):
    """(batch, seqlen, width) bool: tap k of token t reads a token of t's sequence; and
    (batch, seqlen) bool: token t is not padding. Without seq_idx everything counts."""
    if seq_idx is None:
        return (torch.ones(batch, seqlen, width, dtype=torch.bool, device=device),
                torch.ones(batch, seqlen, dtype=torch.bool, device=device))
    sid = seq_idx.to(torch.int64)
    first = sid[:, :1].expand(-1, width - 1)
    # a sentinel below every id: without initial_states nothing before token 0 matches
    none = torch.full_like(first, torch.iinfo(torch.int64).min)
    ids = torch.cat([first if has_init else none, sid], dim=1)        # id(u) for u >= -(W-1)
    windows = ids.unfold(1, width, 1)                                 # (b, l, W): id(t-(W-1)+k)
    return windows == sid.unsqueeze(-1), sid >= 0


def causal_conv1d_ref(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None):
    """(out, final_states) in float64: out (batch, dim, seqlen), final (batch, dim, width-1)."""
    b, d, l = x.shape
    w = weight.shape[1]
    x64, w64 = x.to(F64), weight.to(F64)
    init = (torch.zeros(b, d, w - 1, dtype=F64, device=x.device) if initial_states is None
            else initial_states.to(F64))
    ext = torch.cat([init, x64], dim=-1)                               # e(u), u = -(W-1)..l-1
    same, keep = _window_mask(seq_idx, l, w, initial_states is not None, b, x.device)
    windows = ext.unfold(-1, w, 1)                                     # (b, d, l, W)
    pre = (windows * same.unsqueeze(1) * w64.view(1, d, 1, w)).sum(-1)
    if bias is not None:
        pre = pre + bias.to(F64).view(1, d, 1)
    pre = pre * keep.unsqueeze(1)
    out = F.silu(pre) if activation in ("silu", "swish") else pre
    final = ext[..., l:]                                               # e(l-(W-1) .. l-1)
    if seq_idx is not None and l > 0:
        sid = seq_idx.to(torch.int64)
        first = sid[:, :1].expand(-1, w - 1)
        ids = torch.cat([first, sid], dim=1)[:, l:]
        final = final * (ids == sid[:, -1:]).unsqueeze(1)
    return out, final


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None,
                             cache_seqlens=None, conv_state_indices=None):
    """(out in float64 shaped like x, the updated conv_state as a new float64 tensor)."""
    squeeze = x.dim() == 2
    x3 = (x.unsqueeze(-1) if squeeze else x).to(F64)
    b, d, k = x3.shape
    w = weight.shape[1]
    S = conv_state.shape[-1]
    state = conv_state.to(F64).clone()
    out = torch.zeros(b, d, k, dtype=F64, device=x.device)
    for r in range(b):
        slot = r if conv_state_indices is None else int(conv_state_indices[r])
        if slot < 0:
            continue
        s = state[slot]
        if cache_seqlens is None:
            full = torch.cat([s, x3[r]], dim=-1)
            window = full[:, S - (w - 1):]
            state[slot] = full[:, -S:]
        else:
            p = int(cache_seqlens[r]) % S
            prev = s[:, [(p - (w - 1) + i) % S for i in range(w - 1)]]
            window = torch.cat([prev, x3[r]], dim=-1)
            for t in range(k):
                state[slot, :, (p + t) % S] = x3[r, :, t]
        o = F.conv1d(window.unsqueeze(0), weight.to(F64).unsqueeze(1),
                     None if bias is None else bias.to(F64), groups=d)[0]
        out[r] = F.silu(o) if activation in ("silu", "swish") else o
    return (out.squeeze(-1) if squeeze else out), state
