"""`python -m mamba2_cutile` / `mamba2-cutile`: the demo (default), `bench`, `verify`, `tune`,
`resources`.

This module only parses arguments and dispatches: bench/runner.py runs the benchmark cases,
bench/report.py writes the table/JSON/CSV/PNG, bench/verify.py holds the correctness matrix,
bench/tune.py the tuning search and bench/resources.py the per-kernel resource counts."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch


def demo(args):
    from . import mamba_chunk_scan_combined, reference
    from .bench import problems
    from .bench.accuracy import rel_err as _rel_err

    if not torch.cuda.is_available():
        print("No CUDA GPU found: running a small problem on the PyTorch path and compiling the "
              "kernels for sm_90 on the CPU.")
        shape = problems.Shape("small", 2, 300, 4, 1, 32, 64, 128, torch.float32)
        inp = problems.make_inputs(shape, device="cpu")
        y, h = mamba_chunk_scan_combined(**inp, chunk_size=128, return_final_states=True)
        y_ref, h_ref, _ = reference.ssd_recurrence(**inp)
        print(f"  PyTorch path  B=2 T=300 H=4 P=32 N=64: out err {_rel_err(y, y_ref):.1e}, "
              f"final-state err {_rel_err(h, h_ref):.1e} (vs float64 recurrence)")
        try:
            from .bench import compile as cpu_compile, plans
        except ImportError as e:
            print(f"  cuda-tile is not installed ({e}); skipping the kernel compile")
            return 0
        import time
        for call in plans.forward_problem_plan():
            t0 = time.perf_counter()
            size = cpu_compile.compile_call(call, "sm_90")
            name = call.kernel._annotated_function.pyfunc.__name__.removesuffix("_fn")
            print(f"  compiled {name:<18} for sm_90: {size / 1024:7.0f} KiB cubin in "
                  f"{time.perf_counter() - t0:4.1f} s")
        return 0

    from .bench import impls, roofline, timing
    shape = problems.SEED
    b, l, h, g, p, n = shape.dims()
    print(f"{torch.cuda.get_device_name()} | seed problem B={b} T={l} H={h} P={p} N={n} G={g} "
          f"chunk={shape.chunk} bf16")
    inp = problems.make_inputs(shape)
    fwd = impls.ours(inp, shape.chunk)
    first = timing.time_first_call(fwd)
    y, hfin = fwd()
    # check batch 0 against the float64 chunked reference (itself tested against the recurrence)
    one = {k: (v[:1] if k not in ("A", "D") else v) for k, v in inp.items()}
    y_ref, h_ref, _ = reference.ssd_chunked(**one, chunk_size=shape.chunk, dtype=torch.float64)
    e_y, e_h = _rel_err(y[:1], y_ref), _rel_err(hfin[:1], h_ref)
    ok = e_y <= 2e-2 and e_h <= 2e-2
    print(f"  correctness (batch 0 vs float64 reference): out err {e_y:.1e}, final-state err "
          f"{e_h:.1e} -> {'OK' if ok else 'FAIL'}")
    print(f"  first call (compile included): {first:.1f} s")
    floor = roofline.floor_ms(roofline.forward_bytes(b, l, h, g, p, n),
                              roofline.forward_flops(b, l, h, g, p, n, shape.chunk))
    t = timing.time_graph(fwd)
    print(f"  mamba2-cutile forward: {t['median_ms']:.3f} ms (CUDA graph, median of {t['n']}); "
          f"roofline floor {floor:.3f} ms [{roofline.CONSTANTS}]")
    base = impls.mamba_ssm(inp, shape.chunk)
    if base is not None:
        tb = timing.time_graph(base)
        print(f"  mamba_ssm forward:     {tb['median_ms']:.3f} ms -> speedup "
              f"{tb['median_ms'] / t['median_ms']:.2f}x")
    else:
        print("  mamba_ssm is not importable: no baseline timing")
    return 0 if ok else 1


NO_GPU = "no CUDA GPU found (torch.cuda.is_available() is False); it needs an NVIDIA GPU{hint}"


def _no_gpu(cmd, hint=""):
    print(f"mamba2-cutile {cmd}: " + NO_GPU.format(hint=hint), file=sys.stderr)
    return 2


def _select_shapes(args):
    from .bench import problems

    dtype = problems.parse_dtype(args.dtype) if args.dtype else None
    return problems.select(args.shapes, custom=args.custom or (), seqlens=args.seqlen,
                           dstates=args.dstate, match=args.match, dtype=dtype,
                           chunk=args.chunk)


def _list_shapes(args):
    from .bench import impls, problems

    shapes = _select_shapes(args)
    for key, group in problems.REGISTRY.items():
        print(f"{key}: {', '.join(s.name for s in group)}")
    print(f"selected ({len(shapes)}):")
    for s in shapes:
        ref = ("" if s.token_heads <= impls.REFERENCE_MAX_TOKEN_HEADS
               else "  [reference skipped: > 2^20 token-heads]")
        print(f"  {s.name:<24} {s.describe()}{ref}")
    return 0


def bench_decode_cmd(args):
    """Decode mode: the state update at a 7B-class configuration, batch 1 to 256, beside
    mamba_ssm's Triton selective_state_update."""
    from .bench import decode as decode_bench

    if not torch.cuda.is_available():
        return _no_gpu("bench --mode decode")
    rows = decode_bench.bench_decode(reps=args.reps)
    print(decode_bench.format_rows(rows))
    for path in [args.json] + ([f"{args.out}/bench-decode.json"] if args.out else []):
        if path:
            import os
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
            print(f"wrote {path}")
    return 0


#: the scan benchmark's options, with their defaults: the decode, layer and model modes have
#: their own problems and take none of them (decode takes --json)
_SCAN_BENCH_ONLY = dict(shapes="default", custom=None, seqlen=None, dstate=None, match=None,
                        dtype=None, chunk=None, impls="mamba2-cutile,mamba_ssm,tilegym,reference",
                        json=None, jsonl=False, breakdown=False, list=False, compile_jobs=0)


def _refuse_scan_flags(args, allowed=()):
    given = [k for k, v in _SCAN_BENCH_ONLY.items()
             if k not in allowed and getattr(args, k, v) != v]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        more = ("" if args.mode == "decode" else
                f"; its own options: python -m mamba2_cutile.bench.{args.mode} -h")
        raise ValueError(f"--mode {args.mode} runs its own problems and takes only --reps and "
                         f"--out{' and --json' if 'json' in allowed else ''}, not {flags}{more}")


def bench(args):
    from .bench import impls, report, runner

    if args.mode == "decode":
        _refuse_scan_flags(args, allowed=("json",))
        return bench_decode_cmd(args)
    if args.mode in ("layer", "model"):
        _refuse_scan_flags(args)
        import importlib
        sub = importlib.import_module(f".bench.{args.mode}", __package__)
        argv = ["--out", args.out or "bench-out"]
        if args.reps != 50:                 # 50: this parser's default, not the mode's
            argv += ["--reps", str(args.reps)]
        return sub.main(argv)
    if args.list:
        return _list_shapes(args)
    shapes = _select_shapes(args)
    if not shapes:
        print("mamba2-cutile bench: no shape selected (see --list)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        return _no_gpu("bench", " (`mamba2-cutile bench --list` shows the shapes)")
    names = [n.strip() for n in args.impls.split(",") if n.strip()]
    unknown = [n for n in names if n not in impls.known()]
    if unknown or not names:
        raise ValueError(f"unknown implementation(s) {unknown}; known: {', '.join(impls.known())}")
    console = report.make_console()
    # "train": backward alone and forward+backward in one process, so that the baselines'
    # first-call tuning (mamba_ssm's autotune) is paid once for both tables
    modes = ("bwd", "fwdbwd") if args.mode == "train" else (args.mode,)
    if args.compile_jobs:
        try:
            for shape_name, name, status in runner.compile_in_processes(
                    shapes, names, modes, args.compile_jobs):
                print(f"compiled {shape_name} {name}: {status}", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - the timing below compiles what is missing
            print(f"--compile-jobs failed ({runner._error_status(e)}); compiling while timing",
                  file=sys.stderr, flush=True)
    timer = runner.CudaTimer(reps=args.reps)
    rows = {m: [] for m in modes}
    with report.Progress(len(shapes) * len(names) * len(modes), f"bench {args.mode}", console,
                         enabled=not args.no_progress) as bar:
        for shape in shapes:
            for mode in modes:
                new = runner.run_case(shape, names, mode, timer,
                                      on_impl=lambda s, n: bar.step(f"{s.name} {n}"))
                rows[mode] += new
                if args.jsonl:
                    for r in new:
                        print(json.dumps(report._jsonable(r)), flush=True)
    breakdowns = {"fwd": [], "bwd": []}
    if args.breakdown:        # each of our kernels alone, at every selected shape
        for shape in shapes:
            breakdowns["fwd"].append(runner.breakdown(shape))
            if any(m in ("bwd", "fwdbwd") for m in modes):
                breakdowns["bwd"].append(runner.backward_breakdown(shape))
            if args.jsonl:
                for kind in breakdowns.values():
                    if kind:
                        print(json.dumps(kind[-1]), flush=True)
    bad = []
    for mode in modes:
        meta = runner.meta(mode, args.reps, names, sys.argv)
        breakdown = breakdowns["fwd"] + (breakdowns["bwd"] if mode != "fwd" else [])
        report.render_table(rows[mode], meta, console, title=f"mamba2-cutile benchmark ({mode})")
        report.render_breakdown(breakdown, console)
        if args.out:
            paths = report.write_all(args.out, rows[mode], meta, breakdown)
            print("wrote " + ", ".join(p for p in paths.values() if p)
                  + ("" if paths["png"] else " (no PNG: matplotlib missing or nothing timed)"))
        if args.json:
            path = args.json
            if len(modes) > 1:          # one file per mode: out.json -> out-bwd.json, ...
                j = pathlib.Path(args.json)
                path = str(j.with_name(f"{j.stem}-{mode}{j.suffix or '.json'}"))
            report.write_json(path, rows[mode], meta, breakdown)
            print(f"wrote {path}")
        bad += [r for r in rows[mode] if r["status"].startswith("MISMATCH")
                or (r["impl"] == impls.OURS and r["status"].startswith("error"))]
    return 1 if bad else 0


def verify_cmd(args):
    from .bench import verify

    cases = verify.select(args.match)
    if args.list:
        for c in cases:
            print(f"{c.name:<36} {c.describe()}")
        return 0
    if not cases:
        print("mamba2-cutile verify: no case selected (see --list)", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        return _no_gpu("verify", " (--cpu checks the PyTorch path instead)")
    from .bench import report
    console = report.make_console()
    with report.Progress(len(cases), f"verify ({device})", console) as bar:
        results = verify.run(cases, device, progress=lambda c: bar.step(c.name))
    verify.render(results, console)
    if args.json:
        report._ensure_dir(args.json)
        with open(args.json, "w") as f:
            json.dump(report._jsonable({"device": device, "results": results}), f, indent=1)
    return verify.exit_code(results)


def tune_cmd(args):
    from . import tuning
    from .bench import tune as search

    if args.list:
        return _list_shapes(args)
    if args.show:
        print(f"tuning cache: {tuning.cache_path()}")
        for k, v in sorted(tuning.entries().items()):
            print(f"  {k}: {v.get('overrides')}  (default {v.get('default_ms')} ms, "
                  f"best {v.get('best_ms')} ms)")
        print(f"shipped table: {tuning.SHIPPED} ({len(tuning.cache.shipped_entries())} entries)")
        return 0
    space = search.parse_space(args.space)
    search.split_space(space)            # an unknown field fails here, before any GPU work
    shapes = _select_shapes(args)
    if not shapes:
        print("mamba2-cutile tune: no shape selected", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        return _no_gpu("tune", " (--show prints the cache without one)")
    from .bench import report
    n_steps = len(shapes) * len(search.split_space(space))
    console = report.make_console()
    with report.Progress(n_steps, "tune", console) as bar:
        res = search.tune(shapes, space, reps=args.reps, min_gain=args.min_gain,
                          store_results=not args.dry_run,
                          progress=lambda s, what: bar.step(f"{s.name} {what}"))
    for r in res:
        d, b = r["default_ms"], r["best_ms"]
        gain = f"{d / b:.3f}x" if d and b else "?"
        print(f"{r['shape']}: default {d if d is None else round(d, 4)} ms, best "
              f"{b if b is None else round(b, 4)} ms ({gain}) {r['best']} -> stored "
              f"{r['overrides']}{'' if r['stored'] else ' (not on disk)'}")
        for label, ms in r["results"]:
            print(f"    {label:<60} {ms if isinstance(ms, str) else f'{ms:.4f} ms'}")
        print(f"    key {r['key']}")
    print(f"tuning cache: {tuning.cache_path()}")
    return 0


def _add_shape_args(p, default):
    p.add_argument("--shapes", default=default,
                   help="comma-separated registry sets (default, seed, sweep, models, options, "
                        "all) or shape names; see --list")
    p.add_argument("--custom", action="append", metavar="B,T,H,G,P,N,Q[,dtype]",
                   help="an extra shape (repeatable)")
    p.add_argument("--seqlen", help="keep only these sequence lengths, e.g. 4K,16K")
    p.add_argument("--dstate", help="keep only these dstates, e.g. 64,128")
    p.add_argument("--match", help="keep only shapes whose name matches this regex")
    p.add_argument("--dtype", help="run every shape in this dtype (bf16, fp16, fp32)")
    p.add_argument("--chunk", type=int, choices=(64, 128, 256),
                   help="run every shape at this chunk size")


def resources_cmd(args):
    import json as _json

    from .bench import resources
    from .config import parse_overrides
    from .decode import DecodeConfig
    from .ssd.backward import BackwardConfig
    from .ssd.forward import ForwardConfig

    cls = {"forward": ForwardConfig, "backward": BackwardConfig, "decode": DecodeConfig}[
        args.family]
    problem = _json.loads(args.problem) if args.problem else {}
    resources.check_problem(args.family, problem)
    for spec in args.overrides or ["default"]:
        over = {} if spec == "default" else parse_overrides(cls, spec, "resources")
        for call in resources.problem_calls(args.family, problem, over):
            r = resources.compile_resources(call)
            print(f"{spec:40s} {resources.kernel_name(call):18s} regs {r['regs']!s:>4} "
                  f"stack {r['stack']:>5} B smem {r['smem'] / 1024:6.1f} KB "
                  f"threads {r['threads']!s:>4} -> {r['ctas_per_sm']} CTA/SM", flush=True)
    return 0


def build_parser():
    from .bench import verify

    parser = argparse.ArgumentParser(prog="mamba2-cutile", description=__doc__)
    sub = parser.add_subparsers(dest="cmd")
    pb = sub.add_parser(
        "bench", help="time ours beside mamba_ssm, TileGym and the PyTorch reference",
        description="Time mamba2-cutile beside mamba_ssm, TileGym and the PyTorch reference "
                    "(same inputs, outputs cross-checked first). Kernel time: CUDA graph, L2 "
                    "flushed, median/min/max; eager wall time; first call; roofline floor; "
                    "peak memory. Missing implementations are reported, not fatal.")
    pb.add_argument("--mode", choices=("fwd", "bwd", "fwdbwd", "train", "decode", "layer",
                                       "model"),
                    default="fwd",
                    help="forward, backward alone (after one forward), both, train (bwd and "
                         "fwdbwd in one run), the decode step (batch 1..256 at H=128 P=64 "
                         "N=128 G=8), the Mamba2 layer (training and decode at d_model 768, "
                         "2560, 4096; more options: python -m mamba2_cutile.bench.layer -h) or "
                         "transformers models (training and generation; python -m "
                         "mamba2_cutile.bench.model -h)")
    _add_shape_args(pb, "default")
    pb.add_argument("--impls", default="mamba2-cutile,mamba_ssm,tilegym,reference",
                    help="comma-separated: mamba2-cutile, mamba_ssm, tilegym, reference")
    pb.add_argument("--reps", type=int, default=50, help="CUDA-graph replays per timing")
    pb.add_argument("--compile-jobs", type=int, default=0, metavar="N",
                    help="first call every shape and implementation once in N parallel "
                         "processes, filling Triton's and cuTile's disk caches (mamba_ssm "
                         "compiles its autotune candidates for about a minute a shape); the "
                         "timing process then only re-runs the autotuners' benchmarks")
    pb.add_argument("--out", metavar="DIR", help="write bench-<mode>.json/.csv/.png here")
    pb.add_argument("--json", metavar="FILE", help="also write the JSON to this file")
    pb.add_argument("--jsonl", action="store_true", help="print each row as a JSON line")
    pb.add_argument("--breakdown", action="store_true",
                    help="also time each of our kernels alone at every selected shape")
    pb.add_argument("--list", action="store_true", help="list the shapes and exit")
    pb.add_argument("--no-progress", action="store_true", help="no progress bar")

    pv = sub.add_parser("verify", help="correctness matrix against the float64 recurrence",
                        description=verify.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    pv.add_argument("--match", help="only cases whose name matches this regex")
    pv.add_argument("--list", action="store_true", help="list the cases and exit")
    pv.add_argument("--cpu", action="store_true",
                    help="run the CPU (PyTorch) path instead of the GPU kernels")
    pv.add_argument("--json", metavar="FILE", help="write the results as JSON")

    pt = sub.add_parser("tune", help="search ForwardConfig overrides, store the winners",
                        description="Time the full forward for a small space of ForwardConfig "
                                    "overrides at each shape and store each bucket's winner in "
                                    "the tuning cache (mamba2_cutile.tuning).")
    _add_shape_args(pt, "seed")
    pt.add_argument("--space", help="e.g. 'state_block_n=16,32,64;scan_block_q=64,128;"
                                    "scan_occupancy=0,2' (that is the default)")
    pt.add_argument("--reps", type=int, default=30)
    pt.add_argument("--min-gain", type=float, default=0.01,
                    help="store a non-default config only if it is this much faster")
    pt.add_argument("--dry-run", action="store_true", help="time, but store nothing")
    pt.add_argument("--show", action="store_true", help="print the cache and exit")
    pt.add_argument("--list", action="store_true", help="list the shapes and exit")

    pr = sub.add_parser(
        "resources", help="registers, spills and shared memory per kernel (CPU compile)",
        description="Compile a problem's launches for sm_90 on the CPU and print registers "
                    "and spill bytes per thread, shared memory per CTA and CTAs per SM. Needs "
                    "pyelftools (pip install mamba2-cutile[dev]).")
    pr.add_argument("family", choices=("forward", "backward", "decode"))
    pr.add_argument("problem", nargs="?", default="",
                    help='problem as JSON, e.g. \'{"chunk_size": 256, "nheads": 80}\'')
    pr.add_argument("overrides", nargs="*",
                    help='config overrides to compare, e.g. "scan_block_q=64,scan_occupancy=2" '
                         '(default: the dispatcher\'s config)')
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "bench":
            return bench(args)
        if args.cmd == "verify":
            return verify_cmd(args)
        if args.cmd == "tune":
            return tune_cmd(args)
        if args.cmd == "resources":
            return resources_cmd(args)
    except ValueError as e:           # bad shape/space specs: one line, not a traceback
        print(f"mamba2-cutile {args.cmd}: {e}", file=sys.stderr)
        return 2
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
