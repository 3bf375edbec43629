"""`mamba2-cutile tune`: search each forward kernel's ForwardConfig fields with
`cuda.tile.tune.exhaustive_search`, check and time the winner, and store it in the tuning cache
(`mamba2_cutile.tuning`) for the shape's bucket."""

from __future__ import annotations

import itertools
from dataclasses import fields, replace

from ..tuning import FORWARD, make_key, store, valid_overrides

#: the default search space of `tune` (small: every config compiles new kernel variants):
#: the knobs that moved the H200 sweeps of 2026-11-30 or, by the CPU compile's resource counts,
#: should: the state pass's n tile; chunk_scan's query block and occupancy 2, which compiles to
#: two CTAs per SM without spills at block_q 64 (a persistent scan never helped)
DEFAULT_SPACE = {"state_block_n": (16, 32, 64), "scan_block_q": (64, 128),
                 "scan_occupancy": (0, 2)}


def parse_space(spec: str | None) -> dict:
    """'state_block_n=16,32,64;scan_persistent=0,2' -> {field: (values...)}; '' -> default."""
    if not spec:
        return dict(DEFAULT_SPACE)
    space = {}
    for part in spec.split(";"):
        if not part.strip():
            continue
        name, _, values = part.partition("=")
        name = name.strip()
        if not values.strip():
            raise ValueError(f"--space: no values for {name!r} (want name=v1,v2;...)")
        space[name] = tuple(int(v) for v in values.split(","))
    return space


def candidates(base_cfg, space: dict) -> list:
    """Every combination of `space` as override dicts valid for `base_cfg`, without
    duplicates (combinations equal to the default collapse to {}), default first."""
    names = list(space)
    bad = [n for n in names if n not in {f.name for f in fields(base_cfg)}
           or n in type(base_cfg).FIXED or n == "chunk_size"]
    if bad:
        raise ValueError(f"cannot tune {bad}: not ForwardConfig fields, or fixed (the chunk "
                         "is the table's key)")
    out, seen = [{}], {base_cfg}
    for combo in itertools.product(*(space[n] for n in names)):
        over = dict(zip(names, combo))
        clean = valid_overrides(base_cfg, over)
        if clean is None:
            continue
        cfg = replace(base_cfg, **clean)
        if cfg in seen:
            continue
        seen.add(cfg)
        out.append({k: v for k, v in clean.items() if getattr(base_cfg, k) != v})
    return out


#: the forward launch each ForwardConfig field belongs to, by prefix (index into forward_plan)
KERNELS = (("cumsum_", 0, "decay_cumsum"), ("state_", 1, "chunk_state_pass"),
           ("scan_", 2, "chunk_scan"))


def split_space(space: dict) -> dict:
    """{launch index: sub-space} of a search space: each kernel is searched on its own fields
    (their effects are independent), so the cost is the sum of the sub-spaces, not their
    product."""
    parts = {}
    for name, values in space.items():
        if name in ("state_segments", "segment_fold", "scan_cb", "scan_causal"):
            # each adds a launch (chunk_state_carry, chunk_cb, the flagged-tile pass) or
            # changes two (scan_causal 4: the state pass's flags) that a search of one kernel
            # alone would not time
            raise ValueError(f"cannot tune {name!r}: it changes two launches; time it "
                             "with scripts/sweep.py")
        if name in ("scan_heads", "scan_walk", "walk_occupancy", "walk_warps", "walk_carry"):
            # another kernel (chunk_scan_group) in chunk_scan's place: the search looks the
            # output launch up by chunk_scan's name, and would find the fix-up launch
            # (scan_walk: chunk_scan_walk in place of the state pass and chunk_scan)
            raise ValueError(f"cannot tune {name!r}: it replaces chunk_scan by another "
                             "kernel; time it with scripts/sweep.py")
        k = next((k for prefix, k, _ in KERNELS if name.startswith(prefix)), None)
        if k is None:
            raise ValueError(f"cannot tune {name!r}: not a field of one forward kernel")
        parts.setdefault(k, {})[name] = tuple(values)
    return dict(sorted(parts.items()))


def kernel_name(k: int) -> str:
    return next(name for _, i, name in KERNELS if i == k)


def launch_of(calls, name: str):
    """The first launch of kernel `name` in a forward plan (its position moves with the
    config: `state_segments` puts chunk_state_carry before chunk_scan). "chunk_scan" is the
    output launch: chunk_scan, or chunk_scan_group where `scan_heads` puts it there (the
    flagged-tile pass after it is chunk_scan too)."""
    names = (name, "chunk_scan_group") if name == "chunk_scan" else (name,)
    return next(c for c in calls
                if c.kernel._annotated_function.pyfunc.__name__.removesuffix("_fn") in names)


def tune(shapes, space=None, reps=30, min_gain=0.01, store_results=True, progress=None,
         check_tol=2e-2):
    """For each shape: search each forward kernel's fields of `space` (default DEFAULT_SPACE)
    with `cuda.tile.tune.exhaustive_search` (the kernel alone, L2 flushed, timed until its
    confidence interval converges), keep a kernel's winner when it beats that kernel's default
    by more than `min_gain`, then check the combination against the default config's output
    (relative difference <= `check_tol`) and time the whole forward both ways (CUDA graph).
    The combination is stored for the shape's bucket only if the whole forward gains too.
    Needs a CUDA GPU.

    `progress(shape, text)` is called before each kernel's search. Returns one dict per shape:
    shape, key, default_ms, best_ms, best, overrides (stored), results, stored."""
    import math

    import torch
    from cuda.tile.tune import exhaustive_search

    from ..runtime import launch_calls, num_sms
    from ..ssd.forward import forward_plan, forward_shape_config
    from . import problems, timing
    from .accuracy import rel_err

    if not torch.cuda.is_available():
        raise RuntimeError("tuning needs a CUDA GPU")
    space = dict(DEFAULT_SPACE if space is None else space)
    parts = split_space(space)
    dev = torch.cuda.current_device()
    report = []
    for shape in shapes:
        b, l, h, g, p, n = shape.dims()
        inp = problems.make_inputs(shape)
        base = forward_shape_config(b, h, p, n, shape.chunk, shape.dtype, num_sms(dev), l, g)
        Q = base.chunk_size         # the chunk the forward computes with (the tuning key's)
        nc = -(-l // Q)
        f32 = torch.float32
        x, C = inp["x"], inp["C"]
        dt_buf = torch.empty((b, h, nc * Q), dtype=f32, device=x.device)
        cum_buf = torch.empty_like(dt_buf)
        states = torch.empty((b, h, nc, p, n), dtype=C.dtype, device=x.device)
        final = torch.empty((b, h, p, n), dtype=f32, device=x.device)
        out = torch.empty_like(x)
        plans = {}

        def plan_of(over, inp=inp, base=base, bufs=(dt_buf, cum_buf, states, final, out),
                    plans=plans):
            key = tuple(sorted(over.items()))
            if key not in plans:
                plans[key] = forward_plan(
                    inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], None, inp["D"], None,
                    -math.inf, math.inf, False, inp["initial_states"], None, *bufs,
                    replace(base, **over))
            return plans[key]

        stream = torch.cuda.current_stream()

        def run(over, plan_of=plan_of):
            # launch_calls takes the stream current at call time: a CUDA-graph capture runs
            # on its own stream, and launches on any other one are not captured (an empty
            # graph times as ~1 us)
            launch_calls(plan_of(over), torch.device("cuda", dev))

        run({})                      # the later kernels' inputs, and the reference output
        ref = out.double()
        chosen, results = {}, []
        for k, sub in parts.items():
            name = kernel_name(k)
            cands = candidates(base, sub)
            if progress:
                progress(shape, f"{name} ({len(cands)} configs)")
            try:
                res = exhaustive_search(
                    cands, stream, lambda o, n=name: launch_of(plan_of(o), n).grid,
                    lambda o, n=name: launch_of(plan_of(o), n).kernel,
                    lambda o, n=name: launch_of(plan_of(o), n).args,
                    quiet=True)
            except ValueError as e:   # every config failed
                results.append((f"{name}: all", f"{' '.join(str(e).split())[:160]}"))
                continue
            timed = {tuple(sorted(m.config.items())): m.mean_us for m in res.successes}
            for m in sorted(res.successes, key=lambda m: m.mean_us):
                results.append((f"{name} {m.config or 'default'}", m.mean_us / 1e3))
            for cfg, exc, msg in res.failures:
                results.append((f"{name} {cfg}", f"{exc.__name__}: {' '.join(msg.split())[:160]}"))
            default_us = timed.get(())
            if (res.best.config and default_us is not None
                    and res.best.mean_us < default_us * (1 - min_gain)):
                chosen.update(res.best.config)
        run({})
        default_ms = timing.time_graph(lambda: run({}), reps=reps)["median_ms"]
        kernels_ms = sum(ms for label, ms in results
                         if label.endswith(" default") and isinstance(ms, float))
        if default_ms < 0.5 * kernels_ms:
            # an empty CUDA graph (launches on a stream the capture does not see) times ~1 us
            results.append(("forward default", f"timing broken: {default_ms:.4f} ms, under half "
                            f"its kernels' {kernels_ms:.4f} ms; nothing stored"))
            report.append({"shape": shape.name, "key": None, "default_ms": None,
                           "best_ms": None, "best": {}, "overrides": {}, "results": results,
                           "stored": False})
            continue
        best_ms = default_ms
        if chosen:
            run(chosen)
            err = rel_err(out, ref)
            if not err <= check_tol:
                results.append((f"combined {chosen}", f"rejected: output differs {err:.1e}"))
                chosen = {}
            else:
                ms = timing.time_graph(lambda: run(chosen), reps=reps)["median_ms"]
                results.append((f"forward {chosen}", ms))
                if ms < default_ms * (1 - min_gain):
                    best_ms = ms
                else:
                    chosen = {}
        results.append(("forward default", default_ms))
        key = make_key(FORWARD, batch=b, seqlen=l, nheads=h, headdim=p, dstate=n,
                       chunk_size=Q, dtype=shape.dtype, device_index=dev)
        stored = False
        if store_results:
            stored = store(key, chosen, {"shape": shape.describe(), "default_ms": default_ms,
                                         "best_ms": best_ms,
                                         "space": {k: list(v) for k, v in space.items()}})
        report.append({"shape": shape.name, "key": str(key), "default_ms": default_ms,
                       "best_ms": best_ms, "best": chosen, "overrides": chosen,
                       "results": results, "stored": stored})
        del inp, plans, ref, dt_buf, cum_buf, states, final, out
        torch.cuda.empty_cache()
    return report
