"""Decode benchmark: `selective_state_update` (one token per row, or k) against mamba_ssm's.

The decode step is memory-bound: it reads and writes the whole state of every row. The
achieved HBM bandwidth counts the state read + write and x, dt (compact, per head), B, C, z, y
(A, D and dt_bias are a few KB and ignored); the L2 is flushed between graph replays.

    from mamba2_cutile.bench.decode import bench_decode, format_rows
    print(format_rows(bench_decode()))
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .timing import time_eager, time_eager_stream, time_graph


def _mamba_ssm():
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as f
        return f
    except Exception:  # noqa: BLE001 - a missing or broken baseline is just left out
        return None


def make_decode_inputs(batch, h, p, n, g, k=None, dtype=torch.bfloat16,
                       state_dtype=torch.bfloat16, device="cuda", seed=0):
    """A Mamba-2 decode step: per-head dt, A, D, dt_bias as stride-0 expansions, z, softplus."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    lead = (batch,) if k is None else (batch, k)
    A = (-torch.exp(torch.rand(h, generator=gen, device=device) * math.log(16.0)))
    return dict(
        state=r(batch, h, p, n).to(state_dtype),
        x=r(*lead, h, p).to(dtype),
        dt=(r(*lead, h) - 4.0)[..., None].expand(*lead, h, p),
        A=A[:, None, None].expand(h, p, n),
        B=r(*lead, g, n).to(dtype),
        C=r(*lead, g, n).to(dtype),
        D=r(h)[:, None].expand(h, p),
        z=r(*lead, h, p).to(dtype),
        dt_bias=(0.5 * r(h))[:, None].expand(h, p),
        dt_softplus=True,
    )


def decode_bytes(inp) -> int:
    """HBM bytes one call must move (see the module docstring)."""
    s, x, B = inp["state"], inp["x"], inp["B"]
    tokens = x.numel() // (x.shape[-1] * x.shape[-2])        # batch * k
    h = x.shape[-2]
    total = 2 * s.numel() * s.element_size()                  # state read + write
    total += 3 * x.numel() * x.element_size()                 # x, z, y
    total += tokens * h * inp["dt"].element_size()            # dt, one per head
    total += 2 * B.numel() * B.element_size()                 # B, C
    return total


def _ours(inp, cfg=None):
    from ..decode import api

    if cfg is None:
        return lambda: api.selective_state_update(**inp)
    args = {k: v for k, v in inp.items()}

    def fwd():
        y = torch.empty(args["x"].shape, dtype=args["x"].dtype, device=args["x"].device)
        api.update_cuda(args["state"], args["x"], args["dt"], args["A"], args["B"],
                            args["C"], args["D"], args["z"], args["dt_bias"],
                            args["dt_softplus"], None, None, y, cfg)
        return y
    return fwd


def _theirs(inp):
    f = _mamba_ssm()
    if f is None or inp["x"].dim() != 3:
        return None
    return lambda: f(inp["state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                     D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True)


def bench_decode(batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), h=128, p=64, n=128, g=8,
                 reps=100, k=None, dtype=torch.bfloat16, state_dtype=torch.bfloat16,
                 block_ps=(), eager=True):
    """One row per (batch, implementation): graph-replay and eager times, achieved GB/s.

    block_ps: extra runs of ours with these BLOCK_P overrides (for tuning the dispatcher).
    k: tokens per call (None: the 3-D one-token form; mamba_ssm is timed only then).
    """
    from ..decode import decode_config
    from ..runtime import num_sms

    rows = []
    for b in batches:
        inp = make_decode_inputs(b, h, p, n, g, k=k, dtype=dtype, state_dtype=state_dtype)
        nbytes = decode_bytes(inp)
        default = decode_config(b, h, p, n, num_sms(inp["x"]))
        impls = [("ours", _ours(inp), default.block_p)]
        for bp in block_ps:
            impls.append((f"ours-bp{bp}", _ours(inp, replace(default, block_p=bp)), bp))
        impls.append(("mamba_ssm", _theirs(inp), None))
        for name, fn, bp in impls:
            if fn is None:
                continue
            t = time_graph(fn, reps=reps)
            row = dict(impl=name, batch=b, k=k or 1, h=h, p=p, n=n, g=g, block_p=bp,
                       state_dtype=str(state_dtype).replace("torch.", ""),
                       graph_ms=t["median_ms"], graph_min_ms=t["min_ms"], bytes=nbytes,
                       gbps=nbytes / (t["median_ms"] * 1e-3) / 1e9)
            if eager:
                row["eager_ms"] = time_eager(fn, reps=max(10, reps // 3))["median_ms"]
                row["eager_loop_ms"] = time_eager_stream(fn)["median_ms"]
            rows.append(row)
    return rows


def format_rows(rows) -> str:
    head = f"{'impl':<12} {'batch':>5} {'k':>2} {'bp':>3} {'graph us':>9} {'eager us':>9} " \
           f"{'loop us':>8} {'GB/s':>7}"
    lines = [head]
    for r in rows:
        eager = f"{r['eager_ms'] * 1e3:9.1f}" if "eager_ms" in r else f"{'-':>9}"
        eager += f" {r['eager_loop_ms'] * 1e3:8.1f}" if "eager_loop_ms" in r else f" {'-':>8}"
        lines.append(f"{r['impl']:<12} {r['batch']:>5} {r['k']:>2} {str(r['block_p']):>3} "
                     f"{r['graph_ms'] * 1e3:9.1f} {eager} {r['gbps']:7.0f}")
    return "\n".join(lines)
