"""Where a decode call's measured time goes: the same calls timed several ways, one JSON line
per (batch, implementation, method).

Implementations: ours (the default config), mamba_ssm's Triton kernel, and torch's in-place
`state.mul_()` (the same state bytes read and written by a plain elementwise kernel: what this
GPU gives a streaming read-modify-write).

Methods:
- write_flush: the bench's method (one call per CUDA graph replay, L2 flushed by writing 256 MB
  before each replay, CUDA events);
- read_flush: the same, L2 flushed by reading 256 MB (no dirty lines left behind);
- no_flush: replays back to back;
- layers8: eight calls on eight distinct states in one graph (a model's decode step over 8
  layers), time / 8, L2 flushed by writing before each replay;
- cupti_write / cupti_read: the kernel's own duration from the profiler (CUPTI), median over
  replays with each flush;
- empty: an empty-kernel graph replay (the floor of the event method).

    python3 scripts/decode_timing.py [batches]
"""
import json
import statistics
import sys

import torch

from mamba2_cutile.bench import decode as bd

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "64,128,256").split(",")]
h, p, n, g = 128, 64, 128, 8
REPS = 60
flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")


def write_flush():
    flush.zero_()


def read_flush():
    flush.max()


def graph_of(fns):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for f in fns:
            f()
    return gr


def events(gr, pre, reps=REPS):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(reps + 3):
        if pre is not None:
            pre()
        a.record()
        gr.replay()
        b.record()
        b.synchronize()
        if i >= 3:
            out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out), min(out)


def cupti(gr, pre, reps=30):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            pre()
            gr.replay()
        torch.cuda.synchronize()
    durs = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            durs.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
    # the timed kernel: the one launched `reps` times that is not the flush
    flush_names = [k for k in durs if "fill" in k.lower() or "reduce" in k.lower()]
    rest = {k: v for k, v in durs.items() if k not in flush_names}
    if not rest:
        return None, sorted(durs)
    name, vals = max(rest.items(), key=lambda kv: len(kv[1]))
    return statistics.median(vals), name[:80]


def emit(**kw):
    print(json.dumps(kw), flush=True)


empty = torch.empty(1, device="cuda")
gr = graph_of([lambda: empty.add_(0)])
emit(batch=0, impl="tiny add_", method="write_flush", us=events(gr, write_flush)[0])
emit(batch=0, impl="tiny add_", method="read_flush", us=events(gr, read_flush)[0])
emit(batch=0, impl="tiny add_", method="no_flush", us=events(gr, None)[0])

for b in batches:
    layers = [bd.make_decode_inputs(b, h, p, n, g, seed=i) for i in range(8)]
    inp = layers[0]
    nbytes = bd.decode_bytes(inp)
    state_bytes = 2 * inp["state"].numel() * inp["state"].element_size()
    impls = {"ours": lambda d: bd._ours(d), "mamba_ssm": lambda d: bd._theirs(d),
             "torch mul_": lambda d: (lambda: d["state"].mul_(0.999))}
    for name, make in impls.items():
        fn = make(inp)
        if fn is None:
            continue
        nb = state_bytes if name == "torch mul_" else nbytes
        try:
            gr = graph_of([fn])
            for method, pre in (("write_flush", write_flush), ("read_flush", read_flush),
                                ("no_flush", None)):
                med, mn = events(gr, pre)
                emit(batch=b, impl=name, method=method, us=med, min_us=mn,
                     tbps=nb / (med * 1e-6) / 1e12)
            for method, pre in (("cupti_write", write_flush), ("cupti_read", read_flush)):
                med, kname = cupti(gr, pre)
                emit(batch=b, impl=name, method=method, us=med, kernel=kname,
                     tbps=None if med is None else nb / (med * 1e-6) / 1e12)
            del gr
            gr8 = graph_of([make(d) for d in layers])
            med, mn = events(gr8, write_flush, reps=30)
            emit(batch=b, impl=name, method="layers8", us=med / 8, min_us=mn / 8,
                 tbps=nb * 8 / (med * 1e-6) / 1e12)
            del gr8
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            emit(batch=b, impl=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    del layers, inp
    torch.cuda.empty_cache()
