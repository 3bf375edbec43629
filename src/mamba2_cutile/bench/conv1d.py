"""GPU micro-benchmark of the causal conv1d: forward and forward+backward of
`causal_conv1d_fn` (bias, SiLU) beside F.conv1d + SiLU and, when importable, causal-conv1d.

Kernel time: the call captured in a CUDA graph, replayed after warm-up with L2 flushed before
each replay, median of `reps` (`timing.time_graph`). Bandwidth counts the bytes that must move:
forward x read + out written; forward+backward adds x and dout read and dx written (5 passes
over a (batch, dim, seqlen) tensor; weights, bias and the dweight partials are under 1%).
Reported against the H200's 4.3 TB/s.

    python -m mamba2_cutile.bench.conv1d [--dtype bf16] [--width 4] [--layout channel_last]
        [--modes fwd,fwdbwd] [--reps 50] [--json FILE]

`--sweep` times candidate `Conv1dConfig`s in one process instead (`sweep_conv1d`): the
forward and the backward separately, each as the kernel launch alone (the planned
`KernelCall`s replayed in a CUDA graph; heads and partial buffers built once outside) and as
the whole launcher call (with its small head copies, the weight transpose and the partials'
sum). Bytes: forward x read + out written, backward x and dout read + dx written. Each
candidate's results are checked against the dispatcher's default config (max relative
difference printed); the fastest per shape and direction is listed at the end.

    python -m mamba2_cutile.bench.conv1d --sweep [--only fwd|bwd] [--shapes 1x16384x1792,...]
        [--candidates all|rows|waves]
        [--configs "fwd:form=1,block_l=16;bwd:form=1,bwd_tiles=4"] [--reps 30] [--json FILE]

`--candidates rows` is form 3 (the row-streaming kernels) at its tiles, spans and step sizes
beside the dispatcher's default; `--candidates waves` is form 3's automatic span at the CTA
slots it fills (`Conv1dConfig.ctas_per_sm` 6/7/8, with and without the occupancy hint that
matches it; `bwd_ctas_per_sm` 5/6/7/12) beside explicit spans (power-of-two 512 / 256, the
old rule's, and 384 / 376 / 448) and the default. Each row also prints the launch's grid
size (programs) and, for form 3, its span.

    python -m mamba2_cutile.bench.conv1d --sweep --candidates waves --reps 10 \
        --shapes 1x16384x5376,1x65536x1792,2x32768x8448,4x8192x10240
"""

from __future__ import annotations

import argparse
import json
import time

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


# ------------------------------------------------------------------------------- the sweep

#: (batch, seqlen, dim) of the sweep: Mamba-2 780M / 2.7B widths at 16K tokens, and a larger
#: batch of the widest
SWEEP_SHAPES = [(1, 16384, 1792), (1, 16384, 5376), (2, 32768, 8448)]
#: forward candidates: fields over the dispatcher's config ("" = the dispatcher's own)
FWD_CANDIDATES = [
    "", "form=0", "form=0,block_d=128", "block_d=128", "shift_tma=1", "shift_tma=1,tiles=4",
    "form=1,block_d=128", "form=1,block_l=16", "form=1,block_l=16,block_d=256",
    "form=1,block_l=64,block_d=64", "form=1,block_d=64,tiles=4", "form=1,block_d=64,tiles=8",
    "form=1,block_d=64,occupancy=4", "form=1,block_l=16,occupancy=4",
    "form=1,block_d=64,shift_tma=1", "form=1,shift_tma=1,tiles=4",
    "form=1,block_d=64,store_tma=1", "form=1,block_d=64,unchecked=0",
    "form=1,block_l=8,block_d=256", "form=1,block_d=64,warps=8",
    "form=1,block_l=16,block_d=64", "form=1,block_l=64,block_d=32",
    "form=2", "form=2,block_d=64", "form=2,block_l=16", "form=2,block_l=16,block_d=64",
    "form=2,block_d=64,tiles=4", "form=2,block_d=64,occupancy=4", "form=2,block_l=64,block_d=64",
]
#: backward candidates
BWD_CANDIDATES = [
    "", "form=0", "bwd_block_d=32", "bwd_tiles=4",
    "form=1", "form=1,bwd_tiles=1", "form=1,bwd_tiles=4", "form=1,bwd_block_d=32",
    "form=1,bwd_block_d=128", "form=1,bwd_block_l=8,bwd_block_d=128",
    "form=1,bwd_block_l=32,bwd_block_d=32", "form=1,bwd_block_d=32,bwd_occupancy=4",
    "form=1,bwd_occupancy=2", "form=1,bwd_occupancy=4", "form=1,shift_tma=1",
    "form=1,store_tma=1", "form=1,unchecked=0", "form=1,bwd_warps=8",
    "form=1,bwd_tiles=1,bwd_block_d=32", "form=1,bwd_tiles=1,bwd_block_l=8,bwd_block_d=64",
    "form=1,bwd_tiles=1,bwd_block_l=32,bwd_block_d=32", "form=1,bwd_tiles=2,bwd_block_d=32",
    "form=1,bwd_tiles=1,bwd_block_d=32,bwd_occupancy=4",
    "form=1,shift_tma=1,bwd_block_d=32",
]


#: form 3 (row streaming) beside the current default (listed first by the sweep). Registers
#: per thread and CTAs per SM from the sm_90 CPU compile (bf16, bias + SiLU, dim 5376; with
#: the compile-time span of then, no hint) in brackets; programs at (1, 16384, 5376) = 21
#: channel blocks x 16384 / span at block_d 256 (x 2 at 128). Spans of 256-512 tokens (halo
#: re-read (W-1)/span: 0.6-1.2%), 4-16 rows per unrolled step, prefetch on/off, 8 warps (1
#: channel a thread), the row-tile load (the backward's row-tile variant, 142 registers and
#: 29 KB of shared memory, is left out).
ROWS_FWD_CANDIDATES = [
    "form=3,block_d=256,span=512,rows=8,prefetch=1",            # [80, 6/SM] 672 programs
    "form=3,block_d=256,span=256,rows=8,prefetch=1",            # [80, 6/SM] 1344
    "form=3,block_d=256,span=512,rows=4,prefetch=1",            # [59, 8/SM] 672
    "form=3,block_d=256,span=512,rows=8",                       # [72, 7/SM] no prefetch
    "form=3,block_d=256,span=512,rows=16",                      # [112, 4/SM]
    "form=3,block_d=128,span=256,rows=8,prefetch=1",            # [62, 8/SM] 2688
    "form=3,block_d=256,span=512,rows=8,prefetch=1,warps=8",    # [61 x 256 threads, 4/SM]
    "form=3,block_d=256,span=512,rows=8,row_tile=1,prefetch=1",  # [95, 5/SM, 17 KB smem]
]
ROWS_BWD_CANDIDATES = [
    # (programs at (1, 16384, 5376) / CTA slots of 132 SMs: waves)
    "form=3,bwd_block_d=256,bwd_span=256,bwd_rows=8",                   # [125, 4/SM] 1344: 2.5
    "form=3,bwd_block_d=256,bwd_span=256,bwd_rows=4,bwd_prefetch=1",    # [109, 4/SM] 1344: 2.5
    "form=3,bwd_block_d=128,bwd_span=512,bwd_rows=8",                   # [78, 6/SM] 1344: 1.7
    "form=3,bwd_block_d=128,bwd_span=1024,bwd_rows=8",                  # [78, 6/SM] 672: 0.85
    "form=3,bwd_block_d=128,bwd_span=512,bwd_rows=8,bwd_prefetch=1",    # [96, 5/SM] 1344: 2.0
    "form=3,bwd_block_d=256,bwd_span=256,bwd_rows=4,bwd_prefetch=1,bwd_warps=8",  # [72 x 256]
]
#: form 3's automatic span (`conv1d.plan.rows_span`: whole waves of ctas_per_sm x SMs CTA
#: slots) at the dispatcher's tiles (forward block_d 256, backward 128, 8 rows, no prefetch).
#: Registers per thread and CTAs per SM from the sm_90 CPU compile (bf16, bias + SiLU, width 4,
#: run-time span) in brackets; programs / slots at 132 SMs for (1, 16384, 5376) and
#: (1, 65536, 1792). The default ("") is ctas_per_sm 8 under the occupancy-8 hint.
WAVES_FWD_CANDIDATES = [
    "form=3,ctas_per_sm=8,ctas_hint=0",     # [80, 6/SM] span 328: 1050, 440: 1043 of 1056
    "form=3,ctas_per_sm=7",                 # [72, 7/SM] 376: 924 of 924, 504: 917 of 924
    "form=3,ctas_per_sm=7,ctas_hint=0",     # [80, 6/SM] the same spans
    "form=3,ctas_per_sm=6",                 # [75, 6/SM] 448: 777 of 792, 296: 1554 of 1584
    "form=3,ctas_per_sm=6,ctas_hint=0",     # [80, 6/SM]
    "form=3,span=512",                      # [64, 8/SM] the old rule's: 672, 896 programs
    "form=3,span=512,ctas_hint=0",          # [80, 6/SM] (a compile-time 512 had 72, 7/SM)
    "form=3,span=384",                      # [64, 8/SM] 903 programs, 1197
    "form=3,span=376,occupancy=7",          # [72, 7/SM] 924, 1225
]
WAVES_BWD_CANDIDATES = [
    # (the default "" is bwd_ctas_per_sm 8 under the occupancy-8 hint: [64, 8/SM] span 328 at
    # (1, 16384, 5376); 7 under the occupancy-7 hint, [72, 7/SM] span 376: 1848 of 1848 slots,
    # was the default until the 2026-12-02 backward sweep timed 8 faster at all three shapes)
    "form=3,bwd_ctas_per_sm=6,ctas_hint=0",         # [82, 6/SM] the earlier default: 448, 392
    "form=3,bwd_ctas_per_sm=5",                     # [72, 5 of 7/SM] 352: 1974 of 1980
    "form=3,bwd_ctas_per_sm=7,ctas_hint=0",         # [82, 6/SM] 376: 1848 of 1848
    "form=3,bwd_ctas_per_sm=8",                     # [64, 8/SM] hint 8, no stack (bias + SiLU)
    "form=3,bwd_ctas_per_sm=12,ctas_hint=0",        # [82, 6/SM] 448 (one wave of 12), 296
    "form=3,bwd_span=512",                          # the old rule's: 1344, 1792
    "form=3,bwd_span=256",                          # 2688, 3584
    "form=3,bwd_span=384",                          # 1806, 2394
]
#: named candidate sets for --candidates
CANDIDATE_SETS = {"all": (FWD_CANDIDATES, BWD_CANDIDATES),
                  "rows": ([""] + ROWS_FWD_CANDIDATES, [""] + ROWS_BWD_CANDIDATES),
                  "waves": ([""] + WAVES_FWD_CANDIDATES, [""] + WAVES_BWD_CANDIDATES)}


def _parse_fields(spec):
    from .. import config as _config
    from ..conv1d.plan import Conv1dConfig
    return _config.parse_overrides(Conv1dConfig, spec, "--configs")


def _max_rel(a, ref):
    ref = ref.float()
    return ((a.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _programs(calls) -> int:
    """Programs (CTAs) of the launches' grids."""
    total = 0
    for c in calls:
        n = 1
        for g in c.grid:
            n *= g
        total += n
    return total


def _rows_span_of(calls, cfg, channel_last, direction):
    """Form 3's span (direction 0 forward, 1 backward) of the launch, else None: the
    kernels' `span` argument (after the 7 / 11 tensors and the width)."""
    if cfg.form != 3 or not channel_last:
        return None
    return calls[0].args[12 if direction else 8]


def _fwd_runner(x, w, b, cfg):
    """(kernel-only fn, whole-call fn, output) of the forward at cfg (bias, SiLU)."""
    from ..conv1d import plan
    from ..runtime import launch_calls
    xk, cl = plan.kernel_layout(x)
    out = plan.empty_like_layout(xk, cl)
    calls = plan.forward_plan(xk, w.t().contiguous(), b, None, None, out, None, True, cfg)

    def kernel():
        launch_calls(calls, x.device)

    def call():
        return plan.conv1d_forward_cuda(x, w, b, None, None, True, False, cfg)[0]

    kernel.programs = _programs(calls)
    kernel.span = _rows_span_of(calls, cfg, cl, 0)
    kernel()
    return kernel, call, out


def _bwd_runner(x, w, b, dout, cfg):
    """(kernel-only fn, whole-call fn, (dx, dweight, dbias) from the kernel path)."""
    from ..conv1d import plan
    from ..runtime import launch_calls
    xk, cl = plan.kernel_layout(x)
    d, wd = xk.shape[1], w.shape[1]
    dk = plan.in_layout(dout, cl)
    dx = plan.empty_like_layout(xk, cl)
    parts = xk.shape[0] * plan.backward_grid(xk, cfg)[1]
    dw_part = torch.empty(parts, wd, d, dtype=torch.float32, device=x.device)
    db_part = torch.empty(parts, d, dtype=torch.float32, device=x.device)
    calls = plan.backward_plan(xk, w.t().contiguous(), b, None, None, dk, None, dx, dw_part,
                               db_part, None, True, cfg)

    def kernel():
        launch_calls(calls, x.device)

    def call():
        return plan.conv1d_backward_cuda(x, w, b, None, None, dout, None, True, cfg)[:3]

    kernel.programs = _programs(calls)
    kernel.span = _rows_span_of(calls, cfg, cl, 1)
    kernel()
    return kernel, call, (dx, dw_part.sum(0).t(), db_part.sum(0))


def sweep_conv1d(shapes=SWEEP_SHAPES, fwd_candidates=FWD_CANDIDATES,
                 bwd_candidates=BWD_CANDIDATES, dtype=torch.bfloat16, width=4,
                 layout="channel_last", reps=30, only=None, log=print):
    """Rows of {shape, mode (fwd/bwd), config (the fields over the default), kernel_ms,
    call_ms, GB/s and % of 4.3 TB/s (kernel alone), max rel diff against the default config};
    a row with "error" where a candidate failed (compile error, bad field)."""
    from dataclasses import replace
    from ..conv1d import plan
    from .timing import time_graph
    rows = []
    for (batch, seqlen, dim) in shapes:
        x, w, b, dout = make_inputs(batch, seqlen, dim, width, dtype, layout)
        xk, cl = plan.kernel_layout(x)
        base = plan.conv1d_config(batch, dim, seqlen, cl, plan.num_sms(x), width)
        nbytes = x.numel() * x.element_size()
        for mode, cands in (("fwd", fwd_candidates), ("bwd", bwd_candidates)):
            if only and mode != only:
                continue
            ref = None
            for spec in cands:
                row = dict(batch=batch, seqlen=seqlen, dim=dim, width=width,
                           dtype=str(dtype)[6:], layout=layout, mode=mode,
                           config=spec or "default")
                try:
                    cfg = replace(base, **_parse_fields(spec))
                    started = time.perf_counter()
                    if mode == "fwd":
                        kernel, call, res = _fwd_runner(x, w, b, cfg)
                        res = (res,)
                    else:
                        kernel, call, res = _bwd_runner(x, w, b, dout, cfg)
                    torch.cuda.synchronize()
                    row["first_s"] = time.perf_counter() - started    # compile + first run
                    row["programs"] = kernel.programs
                    if kernel.span is not None:
                        row["span"] = kernel.span
                    if ref is None:     # the first candidate that ran (the default's, when
                        ref = tuple(t.clone() for t in res)    # it is listed first and runs)
                        row["reference"] = True
                    row["max_rel_diff"] = max(_max_rel(r, q) for r, q in zip(res, ref))
                    row["kernel_ms"] = time_graph(kernel, reps=reps)["median_ms"]
                    row["call_ms"] = time_graph(call, reps=reps)["median_ms"]
                except Exception as e:  # noqa: BLE001 - a failing candidate is a row, not the end
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    torch.cuda.synchronize()
                    rows.append(row)
                    log(_format_sweep_row(row))
                    continue
                passes = 2 if mode == "fwd" else 3
                row["gb_s"] = passes * nbytes / (row["kernel_ms"] * 1e-3) / 1e9
                row["peak_pct"] = 100 * row["gb_s"] * 1e9 / PEAK_BYTES_PER_S
                row["call_peak_pct"] = 100 * passes * nbytes / (row["call_ms"] * 1e-3) \
                    / PEAK_BYTES_PER_S
                rows.append(row)
                log(_format_sweep_row(row))
        del x, w, b, dout
        torch.cuda.empty_cache()
    return rows


SWEEP_HEADER = (f"{'batch':>5} {'seqlen':>6} {'dim':>5} {'mode':>4} {'kernel ms':>9} {'GB/s':>6} "
                f"{'%peak':>6} {'call ms':>8} {'call%':>6} {'rel diff':>8} {'progs':>6} "
                f"{'first s':>7}  config")


def _format_sweep_row(r) -> str:
    head = f"{r['batch']:>5} {r['seqlen']:>6} {r['dim']:>5} {r['mode']:>4}"
    if "error" in r:
        return f"{head} {'failed':>9} {r['error']}  [{r['config']}]"
    return (f"{head} {r['kernel_ms']:9.4f} {r['gb_s']:6.0f} {r['peak_pct']:5.1f}% "
            f"{r['call_ms']:8.4f} {r['call_peak_pct']:5.1f}% {r['max_rel_diff']:8.1e} "
            f"{r.get('programs', 0):6d} {r.get('first_s', 0.0):7.2f}  {r['config']}"
            + (f"  [span {r['span']}]" if "span" in r else ""))


def best_of_sweep(rows) -> list:
    """The fastest candidate (kernel time) per (shape, mode) among those that ran."""
    best = {}
    for r in rows:
        if "error" in r:
            continue
        key = (r["batch"], r["seqlen"], r["dim"], r["mode"])
        if key not in best or r["kernel_ms"] < best[key]["kernel_ms"]:
            best[key] = r
    return list(best.values())


def _parse_shapes(text):
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def _parse_configs(text):
    """"fwd:a=1,b=2;bwd:c=3;..." -> (forward specs, backward specs); "fwd:" is the default."""
    from .. import config as _config
    return _config.split_passes(text, "--configs")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mamba2_cutile.bench.conv1d",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--layout", default="channel_last", choices=["channel_last", "contiguous"])
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="time candidate Conv1dConfigs")
    ap.add_argument("--only", choices=["fwd", "bwd"], default=None, help="sweep one direction")
    ap.add_argument("--shapes", default=None, help="sweep shapes, e.g. 1x16384x1792,...")
    ap.add_argument("--candidates", default="all", choices=sorted(CANDIDATE_SETS),
                    help="named candidate set (rows: form 3 beside the default; waves: "
                         "form 3's automatic spans at 5-12 CTAs per SM, explicit spans)")
    ap.add_argument("--configs", default=None,
                    help='sweep candidates "fwd:form=1,block_l=16;bwd:form=1" (the default '
                         'config is always timed first)')
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the conv1d benchmark needs a CUDA GPU")
    if args.sweep:
        fwd, bwd = CANDIDATE_SETS[args.candidates]
        if args.configs:
            fwd, bwd = _parse_configs(args.configs)
            fwd, bwd = [""] + [c for c in fwd if c], [""] + [c for c in bwd if c]
        shapes = _parse_shapes(args.shapes) if args.shapes else SWEEP_SHAPES
        print(SWEEP_HEADER, flush=True)
        rows = sweep_conv1d(shapes, fwd, bwd, _DTYPES[args.dtype], args.width, args.layout,
                            args.reps, args.only, log=lambda line: print(line, flush=True))
        print("\nfastest per shape and direction (kernel time):")
        print(SWEEP_HEADER)
        for r in best_of_sweep(rows):
            print(_format_sweep_row(r))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    rows = bench_conv1d(dtype=_DTYPES[args.dtype], width=args.width, layout=args.layout,
                        modes=tuple(args.modes.split(",")), reps=args.reps)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
