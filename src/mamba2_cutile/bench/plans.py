"""Plans of whole problems on `meta` tensors (by default), for compiling on a CPU: the CPU compile
tests, `mamba2-cutile resources` and the demo build the same launches the GPU path makes, from
a problem's sizes and options instead of real tensors."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..ssd.backward import allocate_buffers, backward_config, backward_plan, check_config
from ..ssd.forward import forward_config, forward_plan
from ..decode.plan import decode_plan


FORWARD_OPTIONS = ("D_chan", "z", "dt_bias", "softplus", "init", "seq_idx")


def forward_problem_plan(dtype=torch.bfloat16, chunk_size=128, batch=4, seqlen=16384, nheads=8,
                     ngroups=1, headdim=64, dstate=128, options=FORWARD_OPTIONS, int64=False,
                     state_dtype=None, dt_dtype=torch.float32, device="meta", overrides=None):
    """The forward plan for a problem, on `meta` tensors by default (for compiling). The
    `overrides` apply to the three-kernel rule's config: the walk rule
    (`forward.walk_form`) only runs without them (set `scan_walk=1` to compile a walk)."""
    b, l, h, g, p, n, Q = batch, seqlen, nheads, ngroups, headdim, dstate, chunk_size
    if int64:
        l = max(l, -(-(2**31) // (b * h * p)) + 1)
    e = lambda *s, dt=dtype: torch.empty(s, dtype=dt, device=device)  # noqa: E731
    x = e(b, l, h, p)
    f32 = torch.float32
    D = e(h, p, dt=f32) if "D_chan" in options else e(h, dt=f32) if "D_head" in options else None
    cfg = replace(forward_config(b, h, p, n, Q, dtype, seqlen=l, has_seq="seq_idx" in options,
                                 ngroups=g, walk_ok=not overrides), **(overrides or {}))
    Q = cfg.chunk_size          # the chunk the forward computes with
    nc = -(-l // Q)
    return forward_plan(
        x, e(b, l, h, dt=dt_dtype), e(h, dt=f32), e(b, l, g, n), e(b, l, g, n),
        e(b, l, h, p) if "z" in options else None, D,
        e(h, dt=f32) if "dt_bias" in options else None, 0.0, float("inf"), "softplus" in options,
        e(b, h, p, n, dt=f32) if "init" in options else None,
        e(b, l, dt=torch.int32) if "seq_idx" in options else None,
        e(b, h, nc * Q, dt=f32), e(b, h, nc * Q, dt=f32),
        e(b, h, nc, p, n, dt=state_dtype or dtype), e(b, h, p, n, dt=f32), x, cfg)


BACKWARD_OPTIONS = ("D_chan", "z", "dt_bias", "softplus", "init", "seq_idx", "dfinal")


def backward_problem_plan(dtype=torch.bfloat16, chunk_size=128, batch=4, seqlen=16384,
                              nheads=8, ngroups=1, headdim=64, dstate=128, options=BACKWARD_OPTIONS,
                              int64=False, state_dtype=None, dt_dtype=torch.float32,
                              device="meta", overrides=None):
    """The backward plan for a problem, on `meta` tensors by default (for compiling)."""
    b, l, h, g, p, n, Q = batch, seqlen, nheads, ngroups, headdim, dstate, chunk_size
    if int64:
        l = max(l, -(-(2**31) // (b * h * p)) + 1)
    e = lambda *s, dt=dtype: torch.empty(s, dtype=dt, device=device)  # noqa: E731
    f32 = torch.float32
    x = e(b, l, h, p)
    dt = e(b, l, h, dt=dt_dtype)
    A = e(h, dt=f32)
    Bm, Cm = e(b, l, g, n), e(b, l, g, n)
    z = e(b, l, h, p) if "z" in options else None
    D = e(h, p, dt=f32) if "D_chan" in options else e(h, dt=f32) if "D_head" in options else None
    bias = e(h, dt=f32) if "dt_bias" in options else None
    init = e(b, h, p, n, dt=f32) if "init" in options else None
    seq = e(b, l, dt=torch.int32) if "seq_idx" in options else None
    dfin = e(b, h, p, n, dt=f32) if "dfinal" in options else None
    dout = e(b, l, h, p)
    cfg = backward_config(b, h, g, p, n, Q, dtype, seqlen=l, has_z=z is not None)
    cfg = replace(cfg, **cfg.paired_overrides(overrides or {}))
    check_config(cfg, p, n)
    bufs = allocate_buffers(x, dt, Bm, Cm, z, D, bias, cfg, state_dtype)
    return backward_plan(x, dt, A, Bm, Cm, z, D, bias, 0.0, float("inf"), "softplus" in options, init,
                         seq, dout, dfin, bufs, cfg)


DECODE_OPTIONS = ("D", "z", "bias", "softplus", "idx", "out")


def decode_problem_plan(dtype=torch.bfloat16, state_dtype=None, batch=4, k=None, nheads=128,
                     ngroups=8, headdim=64, dstate=128, layout="head", options=DECODE_OPTIONS,
                     int64=False, device="meta", config=None):
    """The decode plan for a problem, on `meta` tensors by default (for compiling).

    layout "head": dt, A, D, dt_bias are per-head expansions (Mamba-2); "general": full
    tensors; "mixed": dt per head with a per-channel dt_bias, general A, D given as (h,).
    k None: the 3-D (one token) form.
    """
    b, h, g, p, n = batch, nheads, ngroups, headdim, dstate
    kk = 1 if k is None else k
    e = lambda *s, dt=dtype: torch.empty(s, dtype=dt, device=device)  # noqa: E731
    lead = (b,) if k is None else (b, kk)
    f32 = torch.float32
    nslots = b + 3
    if int64:
        nslots = max(nslots, -(-(2**31) // (h * p * n)) + 1)
    state = e(nslots, h, p, n, dt=state_dtype or dtype)
    x = e(*lead, h, p)
    if layout == "head":
        dt = e(*lead, h, dt=f32)[..., None].expand(*lead, h, p)
        A = e(h, dt=f32)[:, None, None].expand(h, p, n)
        D = e(h, dt=f32)[:, None].expand(h, p)
        bias = e(h, dt=f32)[:, None].expand(h, p)
    elif layout == "general":
        dt, A, D, bias = e(*lead, h, p, dt=f32), e(h, p, n, dt=f32), e(h, p), e(h, p, dt=f32)
    else:  # mixed
        dt = e(*lead, h, dt=dtype)[..., None].expand(*lead, h, p)
        A, D, bias = e(h, p, n, dt=f32), e(h, dt=f32), e(h, p, dt=f32)
    opt = lambda name, t: t if name in options else None  # noqa: E731
    out = e(b, kk, h, p, n, dt=state_dtype or dtype) if "out" in options else None
    if out is not None and k is None:
        out = out[:, 0]
    return decode_plan(state, x, dt, A, e(*lead, g, n), e(*lead, g, n), opt("D", D),
                       opt("z", e(*lead, h, p)), opt("bias", bias), "softplus" in options,
                       opt("idx", e(b, dt=torch.int32)), out, torch.empty_like(x), config)
