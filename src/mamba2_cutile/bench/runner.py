"""Runs benchmark cases and returns rows (plain dicts); `report` turns rows into tables/files.

For each shape, every implementation gets the same inputs (and, for backward modes, the same
dout/dfinal_states). Each one is called once (first-call time: compile and any autotuning),
its outputs are cross-checked by name against those of the first implementation that ran
(status MISMATCH when the relative error exceeds `CHECK_TOL`; the row is still timed and the
table flags it), its peak memory is measured over one call, then it is timed as a CUDA graph
(kernel time, L2 flushed) and eagerly (wall time with launch overhead).

A row (JSON-ready; nested dicts are flattened by report.flatten for CSV):

    shape, dims [b, l, h, g, p, n, chunk], dtype, options, mode, impl, status,
    first_call_s, checked_against, max_diff_vs_first, diff_detail {name: rel err},
    peak_mem_mib, graph {median_ms, min_ms, max_ms, n}, eager {...}, graph_error,
    floor_ms, floor_bytes, floor_flops, floor_bound, pct_of_floor,
    speedup_vs {impl: t_impl / t_ours} (our rows), ours_speedup (t_row / t_ours, others)

status: "ok", "MISMATCH (<name> <err>)", "missing", "n/a (...)", "skipped (...)",
"error: <Exception>: <message>".
"""

from __future__ import annotations

import gc
import os
import time

import torch

from . import impls, problems, roofline
from .accuracy import rel_err

#: cross-check tolerance on max|a - b| / max|b|, by (mode kind, input dtype)
CHECK_TOL = {("fwd", torch.bfloat16): 2e-2, ("fwd", torch.float16): 2e-2,
             ("fwd", torch.float32): 5e-3,
             ("bwd", torch.bfloat16): 5e-2, ("bwd", torch.float16): 5e-2,
             ("bwd", torch.float32): 1e-2}
FORWARD_OUTPUTS = ("out", "final")
MODES = ("fwd", "bwd", "fwdbwd")


def compare(outs: dict, ref: dict, dtype, mode):
    """(worst relative error, {name: err}, status) of outputs against reference outputs,
    over the names both have (shapes must agree)."""
    detail = {}
    for name, t in outs.items():
        r = ref.get(name)
        if r is None or t is None:
            continue
        if tuple(t.shape) != tuple(r.shape):
            detail[name] = float("inf")
            continue
        detail[name] = rel_err(t, r)
    if not detail:
        return None, detail, "ok"
    worst = max(detail.values(), key=lambda e: float("inf") if e != e else e)
    bad = []
    for name, e in detail.items():
        kind = "fwd" if name in FORWARD_OUTPUTS else "bwd"
        tol = CHECK_TOL.get((kind, dtype), 2e-2 if kind == "fwd" else 5e-2)
        if not e <= tol:                         # NaN counts as a mismatch
            bad.append((float("inf") if e != e else e / tol, name, e))
    if not bad:
        return worst, detail, "ok"
    _, name, e = max(bad)
    return worst, detail, f"MISMATCH ({name} {e:.1e})"


class CudaTimer:
    """Timing on the GPU (bench.timing): CUDA-graph kernel time, eager wall time, first call,
    peak memory."""

    def __init__(self, reps=50, eager_reps=None, budget_ms=1000.0):
        from . import timing
        self.t = timing
        self.reps = reps
        self.eager_reps = eager_reps or max(5, reps // 2)
        # slow calls (untuned TileGym at model shapes: 10-60 ms each) get fewer replays, at
        # least 10: their medians are stable, and the default set stays under two minutes
        self.budget_ms = budget_ms

    def new_stream(self):
        return torch.cuda.Stream()

    def first_call(self, fn, stream):
        with torch.cuda.stream(stream):
            return self.t.time_first_call(fn)

    def call(self, fn, stream):
        with torch.cuda.stream(stream):
            out = fn()
        torch.cuda.synchronize()
        return out

    def peak_mem(self, fn, stream):
        with torch.cuda.stream(stream):
            return self.t.peak_memory_mib(fn)

    def graph(self, fn, stream):
        return self.t.time_graph(fn, reps=self.reps, stream=stream, budget_ms=self.budget_ms)

    def eager(self, fn, stream):
        with torch.cuda.stream(stream):
            return self.t.time_eager(fn, reps=self.eager_reps, budget_ms=self.budget_ms)

    def cleanup(self):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class WallTimer:
    """CPU stand-in for CudaTimer (tests, dry runs): wall-clock time, no graphs, no memory."""

    def __init__(self, reps=3):
        self.reps = reps

    def new_stream(self):
        return None

    def first_call(self, fn, stream):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def call(self, fn, stream):
        return fn()

    def peak_mem(self, fn, stream):
        return None

    def _stats(self, fn):
        from .timing import _stats
        samples = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return _stats(samples)

    graph = eager = lambda self, fn, stream: self._stats(fn)

    def cleanup(self):
        pass


def case_floor(shape, mode):
    b, l, h, g, p, n = shape.dims()
    elem = torch.empty((), dtype=shape.dtype).element_size()
    return roofline.problem_floor(b, l, h, g, p, n, shape.chunk, mode, elem=elem,
                                  has_z="z" in shape.options, states=True,
                                  seq_idx="seq_idx" in shape.options)


def base_row(shape, impl, mode):
    floor, by, fl, bound = case_floor(shape, mode)
    return {"shape": shape.name, "dims": [*shape.dims(), shape.chunk],
            "dtype": problems.dtype_name(shape.dtype), "options": list(shape.options),
            "series": shape.series, "mode": mode, "impl": impl, "status": "pending",
            "floor_ms": floor, "floor_bytes": by, "floor_flops": fl, "floor_bound": bound}


def _error_status(e: BaseException) -> str:
    msg = " ".join(str(e).split())[:200]
    return f"error: {type(e).__name__}: {msg}"


def run_case(shape, names, mode="fwd", timer=None, device="cuda", on_impl=None):
    """Rows of one shape, one per implementation in `names` (in that order)."""
    timer = timer or CudaTimer()
    inp = problems.make_inputs(shape, device=device)
    grads = problems.make_grad_outputs(shape, device=device) if mode != "fwd" else None
    rows, ref_outs, ref_name = [], None, None
    for name in names:
        if on_impl:
            on_impl(shape, name)
        row = base_row(shape, name, mode)
        rows.append(row)
        fn = outs = None
        try:
            stream = timer.new_stream()
            try:
                fn = impls.build(name, inp, shape, mode, grads, stream)
            except impls.Skip as e:
                row["status"] = str(e)
                continue
            except NotImplementedError:
                row["status"] = impls.NO_BACKWARD if name == impls.OURS else "n/a"
                continue
            try:
                row["first_call_s"] = timer.first_call(fn, stream)
            except NotImplementedError as e:
                row["status"] = (impls.NO_BACKWARD if name == impls.OURS
                                 else f"n/a ({' '.join(str(e).split())[:80]})")
                continue
            outs = timer.call(fn, stream)
            if ref_outs is None:
                ref_outs, ref_name = outs, name
                row["status"] = "ok"
            else:
                worst, detail, status = compare(outs, ref_outs, shape.dtype, mode)
                row.update(checked_against=ref_name, max_diff_vs_first=worst,
                           diff_detail=detail, status=status)
                outs = None
            row["peak_mem_mib"] = timer.peak_mem(fn, stream)
            try:
                row["graph"] = timer.graph(fn, stream)
            except Exception as e:  # noqa: BLE001 - e.g. not capturable: eager time still counts
                row["graph_error"] = _error_status(e)
            row["eager"] = timer.eager(fn, stream)
            if "graph" in row:
                row["pct_of_floor"] = 100.0 * row["floor_ms"] / row["graph"]["median_ms"]
        except Exception as e:  # noqa: BLE001 - a failing implementation is reported, not fatal
            row["status"] = _error_status(e)
        finally:
            del fn, outs
            gc.collect()
            timer.cleanup()
    del ref_outs, inp, grads
    add_speedups(rows)
    return rows


def _compile_case(shape, name, modes, device, part=None):
    """One (shape, implementation) in a worker process: each mode's closure called once.
    part=(index, count): TileGym searches only that slice of its candidates
    (`impls.tilegym_search_slice`)."""
    if part is not None:
        try:
            with impls.tilegym_search_slice(*part):
                shape_name, name, status = _compile_case(shape, name, modes, device)
        except impls.Skip as e:
            return shape.name, name, str(e)
        return shape_name, f"{name} {part[0] + 1}/{part[1]}", status
    try:
        inp = problems.make_inputs(shape, device=device)
        grads = (problems.make_grad_outputs(shape, device=device)
                 if any(m != "fwd" for m in modes) else None)
        t0, ran, skipped = time.perf_counter(), 0, "n/a"
        for mode in modes:
            try:
                fn = impls.build(name, inp, shape, mode, grads)
            except (impls.Skip, NotImplementedError) as e:
                skipped = str(e) or skipped
                continue
            fn()
            ran += 1
            if device != "cpu":
                torch.cuda.synchronize()
        if not ran:
            return shape.name, name, skipped
        return shape.name, name, f"ok {time.perf_counter() - t0:.1f} s"
    except Exception as e:  # noqa: BLE001 - the timing process reports failures itself
        return shape.name, name, _error_status(e)


def compile_cases(shapes, names, jobs):
    """(shape, implementation, part) for each worker of `compile_in_processes`: the reference
    compiles nothing; a tuning TileGym is split into `jobs` slices of its search spaces
    (part=(index, jobs)), since it compiles over a hundred candidates one after another."""
    cases = []
    for s in shapes:
        for n in names:
            if (n == "tilegym" and jobs > 1 and impls.available(n)
                    and impls.tilegym_tuning().startswith("tuned")):
                cases += [(s, n, (k, jobs)) for k in range(jobs)]
            elif n != "reference":
                cases.append((s, n, None))
    return cases


def compile_in_processes(shapes, names, modes, jobs, device="cuda"):
    """Call every (shape, implementation) once in `jobs` fresh processes, so that the kernels
    land in the disk caches (Triton's, cuTile's CUDA_TILE_CACHE_DIR) in parallel; the timing
    process then compiles nothing. Autotuners still run again in the timing process, alone on
    the GPU (their benchmarks of already-compiled candidates take seconds): the workers run
    with TRITON_CACHE_AUTOTUNING=0, so no choice they made under contention is kept. Returns
    (shape, implementation, status) triples."""
    import concurrent.futures
    import multiprocessing

    cases = compile_cases(shapes, names, jobs)
    if not cases or jobs < 1:
        return []
    saved = os.environ.get("TRITON_CACHE_AUTOTUNING")
    os.environ["TRITON_CACHE_AUTOTUNING"] = "0"       # inherited by the spawned workers
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(cases)), mp_context=ctx) as pool:
            futures = [pool.submit(_compile_case, s, n, tuple(modes), device, part)
                       for s, n, part in cases]
            out = []
            for f in futures:
                try:
                    out.append(f.result())
                except Exception as e:  # noqa: BLE001 - a worker that died (e.g. out of memory)
                    out.append(("?", "?", _error_status(e)))
            return out
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_AUTOTUNING", None)
        else:
            os.environ["TRITON_CACHE_AUTOTUNING"] = saved


def kernel_ms(row):
    g = row.get("graph")
    return g["median_ms"] if g else None


def add_speedups(rows):
    """Within one case: our row gets speedup_vs {impl: t_impl / t_ours}; every other timed row
    gets ours_speedup = t_row / t_ours (> 1: ours is faster)."""
    ours = next((r for r in rows if r["impl"] == impls.OURS and kernel_ms(r)), None)
    if ours is None:
        return rows
    t0 = kernel_ms(ours)
    ours["speedup_vs"] = {}
    for r in rows:
        if r is ours or not kernel_ms(r):
            continue
        r["ours_speedup"] = kernel_ms(r) / t0
        ours["speedup_vs"][r["impl"]] = kernel_ms(r) / t0
    return rows


def run(shapes, names=None, mode="fwd", timer=None, device="cuda", progress=None):
    """Rows of every shape x implementation. `progress(shape, impl)` is called before each."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    names = list(names or impls.ORDER)
    rows = []
    for shape in shapes:
        rows += run_case(shape, names, mode, timer, device, on_impl=progress)
    return rows


def breakdown(shape, reps=30):
    """Kernel time of each of our launches alone (CUDA graph), at one shape: the problem of
    `problems.make_inputs`, with the shape's options (z, dt_bias + softplus, seq_idx)."""
    from ..runtime import launch_calls, num_sms
    from ..ssd.forward import forward_config, forward_launches
    from . import timing

    inp = problems.make_inputs(shape)
    b, l, h, g, p, n = shape.dims()
    cfg = forward_config(b, h, p, n, shape.chunk, shape.dtype, num_sms(0),
                         seqlen=l, device_index=0,       # what a call would run
                         has_seq="seq_idx" in shape.options, ngroups=g)
    calls = forward_launches(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], shape.chunk,
                             D=inp["D"], z=inp.get("z"), dt_bias=inp.get("dt_bias"),
                             initial_states=inp["initial_states"], seq_idx=inp.get("seq_idx"),
                             dt_softplus=inp.get("dt_softplus", False), config=cfg)[0]
    row = {"shape": shape.name, "impl": "breakdown", "config": str(cfg), "kernels": {}}
    for call in calls:
        name = call.kernel._annotated_function.pyfunc.__name__

        def launch_one(call=call):
            launch_calls([call], inp["x"].device)
        launch_one()
        ms = timing.time_graph(launch_one, reps=reps)["median_ms"]
        key = name.removesuffix("_fn")
        if key in row["kernels"]:       # a kernel launched twice (chunk_scan's flagged-tile pass)
            key += "_2"
            name = key
        row[name] = ms
        row["kernels"][key] = ms
    row["total_ms"] = sum(row["kernels"].values())
    return row


def backward_breakdown(shape, reps=30, config=None, state_dtype=None, inputs=None):
    """Kernel time of each launch of the cuTile backward alone (CUDA graph), at one shape (the
    problem of `breakdown`, options included, with dout and dfinal_states as cotangents). `config`: a
    BackwardConfig (default: the dispatcher's); `inputs`: (inputs, dout, dfinal) to reuse."""
    from ..runtime import launch_calls, num_sms
    from ..ssd.backward import run_backward
    from . import timing

    inp, dout, dfinal = inputs or (problems.make_inputs(shape),
                                   *problems.make_grad_outputs(shape))
    calls = []      # collected, not launched: each is launched (in plan order) below
    run_backward(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], shape.chunk,
                          dout, dfinal, D=inp["D"], z=inp.get("z"), dt_bias=inp.get("dt_bias"),
                          initial_states=inp["initial_states"], seq_idx=inp.get("seq_idx"),
                          dt_softplus=inp.get("dt_softplus", False), state_dtype=state_dtype,
                          config=config, launch_fn=calls.extend, sms=num_sms(0))
    row = {"shape": shape.name, "impl": "breakdown-bwd", "kernels": {}}
    for i, call in enumerate(calls):
        name = call.kernel._annotated_function.pyfunc.__name__.removesuffix("_fn")
        if name in row["kernels"]:
            name = f"{name}#{i}"

        def launch_one(call=call):
            launch_calls([call], inp["x"].device)
        launch_one()
        row["kernels"][name] = timing.time_graph(launch_one, reps=reps)["median_ms"]
    row["total_ms"] = sum(row["kernels"].values())
    return row


def meta(mode, reps, names, argv=None):
    """Run-level facts for the report: versions, roofline constants, TileGym tuning."""
    import datetime

    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "mode": mode,
            "reps": reps, "impls": list(names), "versions": impls.versions(),
            "roofline": roofline.CONSTANTS,
            "roofline_constants": {"hbm_bytes_per_s": roofline.HBM_BYTES_PER_S,
                                   "tc_flops_per_s": roofline.TC_FLOPS_PER_S},
            "tilegym": (impls.tilegym_tuning() if impls.available("tilegym") else "missing"),
            "timing": "kernel: CUDA graph replay, L2 flushed, median (min-max); eager: wall "
                      "time of a Python call incl. launch overhead; first: first call "
                      "(compile/autotune); peak: max_memory_allocated delta over one call",
            "argv": list(argv) if argv is not None else None,
            # config overrides in force (MAMBA2_CUTILE_BWD_CONFIG, ...): a table is only
            # comparable with another run of the same settings
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith("MAMBA2_CUTILE_") or k == "DISABLE_AUTOTUNE"}}
