"""GPU micro-benchmark of the causal conv1d: forward and forward+backward of
`causal_conv1d_fn` (bias, SiLU) beside F.conv1d + SiLU and, when importable, causal-conv1d.

Kernel time: the call captured in a CUDA graph, replayed after warm-up with L2 flushed before
each replay, median of `reps` (`timing.time_graph`). Bandwidth counts the bytes that must move:
forward x read + out written; forward+backward adds x and dout read and dx written (5 passes
over a (batch, dim, seqlen) tensor; weights, bias and the dweight partials are under 1%).
Reported against the H200's 4.3 TB/s.

    python -m mamba2_cutile.bench.conv1d [--dtype bf16] [--width 4] [--layout channel_last]
        [--modes fwd,fwdbwd] [--reps 50] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

PEAK_BYTES_PER_S = 4.3e12
#: (batch, seqlen, dim): Mamba-2 d_model 768 / 2560 / 4096 with expand 2, ngroups 1,
#: dstate 128 (dim = 2 * d_model + 2 * 128), at 16K-64K tokens per step
DEFAULT_SHAPES = [(1, 16384, 1792), (1, 16384, 5376), (1, 16384, 8448), (4, 16384, 5376),
                  (2, 32768, 8448), (1, 65536, 1792)]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_inputs(batch, seqlen, dim, width=4, dtype=torch.bfloat16, layout="channel_last",
                seed=0):
    """x (batch, dim, seqlen) (channel-last: a channel slice of a wider projection, as in the
    Mamba-2 layer), weight, bias, dout (in x's layout)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "channel_last":
        proj = torch.randn(batch, seqlen, dim + 128, device="cuda", generator=gen).to(dtype)
        x = proj[..., 64:64 + dim].transpose(1, 2)
    else:
        x = torch.randn(batch, dim, seqlen, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(dim, width, device="cuda", generator=gen) / width ** 0.5).to(dtype)
    bias = torch.randn(dim, device="cuda", generator=gen).to(dtype)
    # the output gradient in the output's layout (as the next op's backward would give it)
    if layout == "channel_last":
        dout = torch.randn(batch, seqlen, dim, device="cuda", generator=gen).to(dtype)
        dout = dout.transpose(1, 2)
    else:
        dout = torch.randn(batch, dim, seqlen, device="cuda", generator=gen).to(dtype)
    return x, weight, bias, dout


def conv1d_bytes(x, mode) -> int:
    passes = 2 if mode == "fwd" else 5
    return passes * x.numel() * x.element_size()


def _impls():
    from ..conv1d import causal_conv1d_fn

    def ours(x, w, b):
        return causal_conv1d_fn(x, w, b, activation="silu")

    def torch_conv(x, w, b):
        return F.silu(F.conv1d(x, w.unsqueeze(1), b, padding=w.shape[1] - 1,
                               groups=x.shape[1])[..., :x.shape[2]])

    impls = {"ours": ours, "torch": torch_conv}
    try:
        from causal_conv1d import causal_conv1d_fn as theirs
        impls["causal_conv1d"] = lambda x, w, b: theirs(x, w, b, activation="silu")
    except Exception:  # noqa: BLE001 - not installed: no baseline column
        pass
    return impls


def _time(fn, mode, x, w, b, dout, reps):
    from .timing import time_graph
    if mode == "fwd":
        return time_graph(lambda: fn(x, w, b), reps=reps)["median_ms"]
    xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
    stream = torch.cuda.Stream()

    def step():
        out = fn(xs, ws, bs)
        torch.autograd.grad(out, (xs, ws, bs), dout)

    return time_graph(step, reps=reps, stream=stream)["median_ms"]


def bench_conv1d(shapes=DEFAULT_SHAPES, dtype=torch.bfloat16, width=4, layout="channel_last",
                 modes=("fwd", "fwdbwd"), reps=50):
    """Rows of {shape, mode, impl, ms, GB/s, % of 4.3 TB/s, max rel err vs ours}."""
    rows = []
    impls = _impls()
    for (batch, seqlen, dim) in shapes:
        x, w, b, dout = make_inputs(batch, seqlen, dim, width, dtype, layout)
        ref = impls["torch"](x.float(), w.float(), b.float())
        for name, fn in impls.items():
            err = ((fn(x, w, b).float() - ref).abs().max() / ref.abs().max()).item()
            for mode in modes:
                try:
                    ms = _time(fn, mode, x, w, b, dout, reps)
                except Exception as e:  # noqa: BLE001 - e.g. a baseline refusing the layout
                    rows.append(dict(batch=batch, seqlen=seqlen, dim=dim, mode=mode,
                                     impl=name, error=f"{type(e).__name__}: {e}"))
                    continue
                gbs = conv1d_bytes(x, mode) / (ms * 1e-3) / 1e9
                rows.append(dict(batch=batch, seqlen=seqlen, dim=dim, width=width,
                                 dtype=str(dtype)[6:], layout=layout, mode=mode, impl=name,
                                 ms=ms, gb_s=gbs, peak_pct=100 * gbs * 1e9 / PEAK_BYTES_PER_S,
                                 rel_err=err))
        del x, w, b, dout, ref
        torch.cuda.empty_cache()
    return rows


def format_rows(rows) -> str:
    lines = [f"{'batch':>5} {'seqlen':>6} {'dim':>5} {'mode':>6} {'impl':>14} {'ms':>8} "
             f"{'GB/s':>7} {'%4.3TB/s':>8} {'rel err':>8}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['batch']:>5} {r['seqlen']:>6} {r['dim']:>5} {r['mode']:>6} "
                         f"{r['impl']:>14} {r['error']}")
            continue
        lines.append(f"{r['batch']:>5} {r['seqlen']:>6} {r['dim']:>5} {r['mode']:>6} "
                     f"{r['impl']:>14} {r['ms']:8.3f} {r['gb_s']:7.0f} {r['peak_pct']:7.1f}% "
                     f"{r['rel_err']:8.1e}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--layout", default="channel_last", choices=["channel_last", "contiguous"])
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = bench_conv1d(dtype=_DTYPES[args.dtype], width=args.width, layout=args.layout,
                        modes=tuple(args.modes.split(",")), reps=args.reps)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
