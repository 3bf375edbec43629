"""Public API: `mamba_chunk_scan_combined`, a drop-in for mamba_ssm's function of that name.

Arguments are validated once here (shapes, dtypes, devices; values only on CPU or with
MAMBA2_CUTILE_CHECK=1, so the GPU path never synchronizes), then the custom op
`torch.ops.mamba2_cutile.ssd_forward` (`ops.py`) runs: the cuTile kernels for CUDA tensors, the
chunked PyTorch version in `reference` for CPU tensors (correct, slow).
"""

from __future__ import annotations

import math
import os

import torch

from . import launch, ops  # noqa: F401 - ops registers torch.ops.mamba2_cutile
from .checks import (FLOATS, GPU_FLOATS, INTS, as_kernel_input, check_tensor, expect_shape,
                     shape_of)



def _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
              dt_limit, return_varlen_states, state_dtype):
    check_tensor("x", x, 4, FLOATS)
    b, l, h, p = x.shape
    check_tensor("dt", dt, 3, FLOATS)
    expect_shape("dt", dt, (b, l, h), "(batch, seqlen, nheads)")
    check_tensor("A", A, 1, FLOATS)
    expect_shape("A", A, (h,), "(nheads,)")
    check_tensor("B", B, 4, FLOATS)
    if B.shape[:2] != (b, l):
        raise ValueError(f"B must have shape (batch, seqlen, ngroups, dstate) with batch={b}, "
                         f"seqlen={l}, got {shape_of(B)}")
    g, n = B.shape[2], B.shape[3]
    check_tensor("C", C, 4, FLOATS)
    expect_shape("C", C, (b, l, g, n), "B's shape (batch, seqlen, ngroups, dstate)")
    if g == 0 or h % g != 0:
        raise ValueError(f"nheads ({h}, from x) must be a multiple of ngroups ({g}, from B)")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or \
            chunk_size not in launch.SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {launch.SUPPORTED_CHUNK_SIZES}, "
                         f"got {chunk_size!r}")
    if not 1 <= p <= launch.MAX_HEADDIM:
        raise ValueError(f"headdim (x.shape[3]) must be in 1..{launch.MAX_HEADDIM}, got {p}")
    if not 1 <= n <= launch.MAX_DSTATE:
        raise ValueError(f"dstate (B.shape[3]) must be in 1..{launch.MAX_DSTATE}, got {n}")
    check_tensor("D", D, (1, 2), FLOATS, optional=True)
    if D is not None and shape_of(D) not in ((h,), (h, p)):
        raise ValueError(f"D must have shape (nheads,) = ({h},) or (nheads, headdim) = "
                         f"({h}, {p}), got {shape_of(D)}")
    check_tensor("z", z, 4, FLOATS, optional=True)
    if z is not None:
        expect_shape("z", z, (b, l, h, p), "x's shape (batch, seqlen, nheads, headdim)")
    check_tensor("dt_bias", dt_bias, 1, FLOATS, optional=True)
    if dt_bias is not None:
        expect_shape("dt_bias", dt_bias, (h,), "(nheads,)")
    check_tensor("initial_states", initial_states, 4, FLOATS, optional=True)
    if initial_states is not None:
        expect_shape("initial_states", initial_states, (b, h, p, n),
                "(batch, nheads, headdim, dstate)")
    check_tensor("seq_idx", seq_idx, 2, INTS, optional=True)
    if seq_idx is not None:
        expect_shape("seq_idx", seq_idx, (b, l), "(batch, seqlen)")
    check_tensor("cu_seqlens", cu_seqlens, 1, INTS, optional=True)
    if cu_seqlens is not None and cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have num_seqs + 1 >= 2 entries, got {shape_of(cu_seqlens)}")
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("return_varlen_states=True requires cu_seqlens")
        if b != 1:
            raise ValueError(f"return_varlen_states=True requires batch 1 (x.shape[0]), got {b}")
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"dt_limit must be a pair of numbers (min, max), got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit must satisfy min <= max, got {dt_limit!r}")
    if state_dtype is not None and state_dtype not in (GPU_FLOATS if x.is_cuda else FLOATS):
        raise TypeError(f"state_dtype must be torch.float16, bfloat16 or float32, got {state_dtype}")

    tensors = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
               "initial_states": initial_states, "seq_idx": seq_idx}
    if return_varlen_states:
        tensors["cu_seqlens"] = cu_seqlens
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}: "
                             "all tensors must be on one device")
    if x.is_cuda:
        for name in ("x", "dt", "B", "C", "z"):
            t = tensors[name]
            if t is not None and t.dtype not in GPU_FLOATS:
                raise TypeError(f"{name} must be float16, bfloat16 or float32 on the GPU, "
                                f"got {t.dtype}")
    wants_check = not x.is_cuda or os.environ.get("MAMBA2_CUTILE_CHECK", "") not in ("", "0")
    if wants_check and not torch.compiler.is_compiling():   # value reads would break a graph
        _check_values(seq_idx, cu_seqlens if return_varlen_states else None, l)


def _check_values(seq_idx, cu_seqlens, seqlen):
    """Checks that read tensor values (they synchronize on a GPU)."""
    if seq_idx is not None and seq_idx.shape[1] > 1:
        if bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
            raise ValueError("seq_idx must be non-decreasing along each row")
    if cu_seqlens is not None:
        cu = cu_seqlens.to("cpu", torch.int64)
        if int(cu[0]) != 0 or int(cu[-1]) != seqlen or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to seqlen ({seqlen}), "
                             f"got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False,
                              state_dtype=None):
    """Mamba-2 SSD chunked scan, with mamba_ssm's signature and return conventions.

    x (b, l, h, p); dt (b, l, h); A (h,); B, C (b, l, g, n); D (h,) or (h, p); z like x;
    dt_bias (h,); initial_states (b, h, p, n); seq_idx (b, l) int; cu_seqlens (s + 1,) int.
    Returns out (x's dtype), then final_states (float32) if return_final_states, then
    varlen_states (s, h, p, n) in state_dtype (default C's dtype) if return_varlen_states.
    """
    _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
              dt_limit, return_varlen_states, state_dtype)
    varlen_cu = cu_seqlens if return_varlen_states else None
    keep_dtype = state_dtype if state_dtype is not None else C.dtype
    lo, hi = (float(v) for v in dt_limit)
    out, final, varlen = torch.ops.mamba2_cutile.ssd_forward(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, varlen_cu,
        bool(dt_softplus), lo, hi, keep_dtype)
    result = (out,)
    if return_final_states:
        result += (final,)
    if return_varlen_states:
        result += (varlen,)
    return result[0] if len(result) == 1 else result


def ssd_forward_cuda(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                     initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                     dt_limit=(0.0, float("inf")), state_dtype=None, config=None):
    """Launch the forward kernels. Inputs must already be validated. No host synchronization."""
    import cuda.tile as ct

    calls, out, final, (dt_buf, cum_buf, states), (x, B, init) = forward_launches(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
        dt_limit, state_dtype, config)
    b, l, h, p = x.shape
    state_dtype = state_dtype if state_dtype is not None else C.dtype
    if not calls:                # l = 0 or no heads: nothing to launch
        final = init.clone() if init is not None else final.zero_()
        varlen = None
        if cu_seqlens is not None:
            varlen = _empty_varlen(cu_seqlens, init, (h, p, B.shape[3]), state_dtype)
        return out, final, varlen
    stream = torch.cuda.current_stream(x.device)
    for call in calls:
        ct.launch(stream, call.grid, call.kernel, call.args)
    varlen = None
    if cu_seqlens is not None:
        varlen = varlen_states_from_chunks(x, B, dt_buf, cum_buf, states, init, cu_seqlens,
                                           chunk_size).to(state_dtype)
    return out, final, varlen


def forward_launches(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                     initial_states=None, seq_idx=None, dt_softplus=False,
                     dt_limit=(0.0, float("inf")), state_dtype=None, config=None):
    """The forward's planned launches and the buffers they write, for CUDA inputs:
    (calls, out, final, (dt_buf, cum_buf, states), (x, B, init) as the kernels read them).
    `calls` is empty when there is nothing to launch (l = 0 or b * h = 0)."""
    b, l, h, p = x.shape
    n = B.shape[3]
    Q = chunk_size
    dev = x.device
    state_dtype = state_dtype if state_dtype is not None else C.dtype
    mm = x.dtype
    x = as_kernel_input(x)
    B, C, z = (as_kernel_input(t, mm) for t in (B, C, z))
    dt = as_kernel_input(dt)
    A = as_kernel_input(A, torch.float32)
    D = as_kernel_input(D, torch.float32)
    dt_bias = as_kernel_input(dt_bias, torch.float32)
    init = as_kernel_input(initial_states, torch.float32)
    if seq_idx is not None:
        seq_idx = as_kernel_input(seq_idx, torch.int32)

    nchunks = -(-l // Q)
    final = torch.empty((b, h, p, n), dtype=torch.float32, device=dev)
    out = torch.empty((b, l, h, p), dtype=x.dtype, device=dev)
    dt_buf = torch.empty((b, h, nchunks * Q), dtype=torch.float32, device=dev)
    cum_buf = torch.empty((b, h, nchunks * Q), dtype=torch.float32, device=dev)
    states = torch.empty((b, h, nchunks, p, n), dtype=state_dtype, device=dev)
    bufs = (dt_buf, cum_buf, states)
    if l == 0 or b * h == 0:     # a zero-sized grid is a launch error
        return [], out, final, bufs, (x, B, init)
    lo, hi = dt_limit
    if (lo, hi) == (0.0, float("inf")):      # mamba_ssm clamps only for a non-default limit
        lo, hi = -float("inf"), float("inf")
    cfg = config or launch.default_config(b, h, p, n, Q, x.dtype,
                                          launch.num_sms(dev.index or 0), seqlen=l,
                                          device_index=dev.index or 0,
                                          has_seq=seq_idx is not None)
    calls = launch.forward_plan(x, dt, A, B, C, z, D, dt_bias, lo, hi, dt_softplus, init,
                                seq_idx, dt_buf, cum_buf, states, final, out, cfg)
    return calls, out, final, bufs, (x, B, init)


def _empty_varlen(cu_seqlens, init, shape, dtype):
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
    expo = torch.where(valid[..., None], g_last[:, None, :] - gq, -math.inf)
    w = torch.exp2(expo) * dq
    st = torch.einsum("sqh,sqhp,sqhn->shpn", w, xs, Bs)
    # the carried state belongs to the sequence: it began before chunk c, or at token 0 (it
    # then owns the initial state, even after leading empty sequences)
    running = ((start < chunk * Q) | (start == 0)) & (end > start)
    carry = torch.where(running[:, None], torch.exp2(g_last), 0.0)            # (s, h)
    st = st + carry[:, :, None, None] * states[0][:, chunk].transpose(0, 1).float()
    if init is not None and nseq:
        # an empty sequence at token 0 keeps the initial state
        keep = ((end <= start) & (start == 0))[:, None, None, None]
        st = torch.where(keep, init[0].float()[None], st)
    return st
