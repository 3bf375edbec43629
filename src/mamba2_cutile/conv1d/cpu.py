"""The PyTorch path of the causal conv1d (CPU tensors, and the blueprint of the kernels): the
forward and its explicit backward, tap by tap, in float32 (float64 for float64 inputs).

With e(u) the input extended by the initial states, M[t, k] the same-sequence mask of tap k of
token t and keep[t] = [id(t) >= 0] (see `reference.conv1d`):

    pre[t]   = keep[t] * (bias + sum_k w[k] e(t-(W-1)+k) M[t, k])
    g[t]     = dout[t] * act'(pre[t]) * keep[t]
    dbias    = sum_t g[t]
    dw[k]    = sum_t g[t] e(t-(W-1)+k) M[t, k]
    de(u)    = sum_k w[k] g[u+(W-1)-k] M[u+(W-1)-k, k]  (+ dfinal[j] Mf[j] at u = l-(W-1)+j)
    dx = de(0..l-1), dinitial_states = de(-(W-1)..-1)
"""

from __future__ import annotations

import torch


def compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _masks(seq_idx, b, l, w, has_init, device):
    """M (b, l, W) float-able bool, keep (b, l) bool, Mf (b, W-1) bool (the final state's)."""
    if seq_idx is None:
        return None, None, None
    sid = seq_idx.to(torch.int64)
    first = sid[:, :1].expand(-1, w - 1)
    none = torch.full_like(first, torch.iinfo(torch.int64).min)
    ids = torch.cat([first if has_init else none, sid], dim=1)
    same = ids.unfold(1, w, 1) == sid.unsqueeze(-1)
    final_ids = torch.cat([first, sid], dim=1)[:, l:]
    return same, sid >= 0, final_ids == sid[:, -1:]


def _extended(x, initial_states, w, cd):
    """(x with the W-1 entry taps in front, (b, d, W-1+l) in the compute dtype)."""
    b, d, _ = x.shape
    init = (torch.zeros(b, d, w - 1, dtype=cd, device=x.device) if initial_states is None
            else initial_states.to(cd))
    return torch.cat([init, x.to(cd)], dim=-1)


def _pre_activation(ext, wt, bias, same, keep, l):
    """sum_k w_k * tap_k (+ bias) before the activation, (b, d, l). The masks select (never
    multiply), so a NaN or Inf in another sequence's tokens cannot reach this one."""
    b, d = ext.shape[:2]
    pre = torch.zeros(b, d, l, dtype=ext.dtype, device=ext.device)
    for k in range(wt.shape[1]):
        tap = ext[..., k:k + l]
        if same is not None:
            tap = torch.where(same[:, None, :, k], tap, 0.0)
        pre = pre + wt[:, k, None] * tap
    if bias is not None:
        pre = pre + bias.to(ext.dtype)[:, None]
    if keep is not None:
        pre = torch.where(keep[:, None, :], pre, 0.0)
    return pre


def conv1d_forward(x, weight, bias, seq_idx, initial_states, silu: bool, want_final: bool):
    """(out in x's dtype, final states (b, d, W-1) in x's dtype or None)."""
    cd = compute_dtype(x)
    b, d, l = x.shape
    w = weight.shape[1]
    ext = _extended(x, initial_states, w, cd)
    same, keep, same_final = _masks(seq_idx, b, l, w, initial_states is not None, x.device)
    pre = _pre_activation(ext, weight.to(cd), bias, same, keep, l)
    out = torch.nn.functional.silu(pre) if silu else pre
    final = None
    if want_final:
        final = ext[..., l:]
        if same_final is not None and l > 0:
            final = torch.where(same_final[:, None, :], final, 0.0)
        final = final.to(x.dtype)
    return out.to(x.dtype), final


def conv1d_backward(x, weight, bias, seq_idx, initial_states, dout, dfinal, silu: bool):
    """(dx, dweight, dbias or None, dinitial_states or None), each in its input's dtype."""
    cd = compute_dtype(x)
    b, d, l = x.shape
    w = weight.shape[1]
    ext = _extended(x, initial_states, w, cd)
    same, keep, same_final = _masks(seq_idx, b, l, w, initial_states is not None, x.device)
    wt = weight.to(cd)
    g = dout.to(cd) if dout is not None else torch.zeros(b, d, l, dtype=cd, device=x.device)
    if silu:
        pre = _pre_activation(ext, wt, bias, same, keep, l)
        sig = torch.sigmoid(pre)
        g = g * sig * (1 + pre * (1 - sig))
    if keep is not None:
        g = torch.where(keep[:, None, :], g, 0.0)
    dext = torch.zeros_like(ext)
    dw = torch.empty(d, w, dtype=cd, device=x.device)
    for k in range(w):
        gk = g if same is None else torch.where(same[:, None, :, k], g, 0.0)
        dw[:, k] = (gk * ext[..., k:k + l]).sum(dim=(0, 2))
        dext[..., k:k + l] += wt[:, k, None] * gk
    if dfinal is not None:
        df = dfinal.to(cd)
        if same_final is not None:
            df = torch.where(same_final[:, None, :], df, 0.0)
        dext[..., l:] += df
    dx = dext[..., w - 1:].to(x.dtype)
    dbias = None if bias is None else g.sum(dim=(0, 2)).to(bias.dtype)
    dinit = None if initial_states is None else dext[..., :w - 1].to(initial_states.dtype)
    return dx, dw.to(weight.dtype), dbias, dinit


def conv1d_update(x3, conv_state, weight, bias, silu: bool, cache_seqlens, conv_state_indices):
    """The decode update on any device in PyTorch ops: returns out (b, d, k) in x's dtype and
    updates conv_state in place. x3 is (b, d, k); indices are int64 tensors or None."""
    cd = compute_dtype(x3)
    b, d, k = x3.shape
    w = weight.shape[1]
    S = conv_state.shape[-1]
    dev = x3.device
    rows = torch.arange(b, device=dev)
    slots = rows if conv_state_indices is None else conv_state_indices.to(torch.int64)
    # unchecked (torch.compile) a slot past the cache is a padding row, as on the GPU
    live = (slots >= 0) & (slots < conv_state.shape[0])
    safe = torch.where(live, slots, torch.zeros_like(slots))
    if conv_state.shape[0]:
        raw = conv_state[safe]                                       # (b, d, S)
    else:                       # an empty cache: every row is padding (slots checked)
        raw = torch.zeros(b, d, S, dtype=conv_state.dtype, device=dev)
    old = raw.to(cd)
    xs = x3.to(cd)
    # the new state is built in the state's dtype: entries the update only moves or keeps
    # stay bit-identical (a float64 cache beside float32 x is not rounded through float32)
    xs_state = x3.to(conv_state.dtype)
    if cache_seqlens is None:
        window = torch.cat([old, xs], dim=-1)[..., S - (w - 1):]
        new = torch.cat([raw, xs_state], dim=-1)[..., -S:]
    else:
        p = cache_seqlens.to(torch.int64) % S                        # (b,)
        prev_idx = (p[:, None] + torch.arange(-(w - 1), 0, device=dev)[None]) % S
        window = torch.cat([old.gather(2, prev_idx[:, None, :].expand(b, d, w - 1)), xs], -1)
        # ring slot i takes the last token t with (p + t) mod S == i, if any
        i = torch.arange(S, device=dev)
        first = (i[None] - p[:, None]) % S                           # (b, S): first t landing
        last = first + S * torch.div(k - 1 - first, S, rounding_mode="floor").clamp(min=0)
        hit = first < k
        src = torch.where(hit, last, torch.zeros_like(last))
        written = xs_state.gather(2, src[:, None, :].expand(b, d, S))
        new = torch.where(hit[:, None, :], written, raw)
    wt = weight.to(cd)
    out = torch.zeros(b, d, k, dtype=cd, device=dev)
    for j in range(w):
        out = out + wt[:, j, None] * window[..., j:j + k]
    if bias is not None:
        out = out + bias.to(cd)[:, None]
    if silu:
        out = torch.nn.functional.silu(out)
    # selected, not multiplied: a padding row's x or its stand-in slot may hold NaN
    out = torch.where(live[:, None, None], out, torch.zeros_like(out))
    if live.any():
        conv_state[slots[live]] = new[live]
    return out.to(x3.dtype)
