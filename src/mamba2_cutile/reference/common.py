"""What the PyTorch definitions share: dt's preprocessing, group expansion, the D term, and
running without autocast."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def autocast_off(fn):
    """`fn` with autocast off on the CPU and CUDA: the PyTorch paths compute in the dtype they
    are asked for (float32 for float32 or 16-bit inputs, as the kernels do), never in the bf16
    that an enclosing `torch.autocast` would give their matrix products."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)
    return run


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """dt <- clamp(softplus?(dt + dt_bias), dt_limit), as mamba_ssm's Triton scan: the
    default (0, inf) clamps too (a negative dt without softplus is 0). torch.clamp keeps NaN."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def expand_groups(t, nheads):
    """(b, l, g, n) -> (b, l, h, n): head i uses group i // (h // g). (A kernel just indexes
    group = head // HEADS_PER_GROUP instead of materializing this.)"""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def d_term(D, x):
    if D is None:
        return 0.0
    return (D[:, None] if D.dim() == 1 else D) * x
