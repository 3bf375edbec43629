"""`python -m mamba2_cutile` / `mamba2-cutile`: the demo (default) and the benchmark."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _rel_err(a, ref):
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def demo(args):
    from . import mamba_chunk_scan_combined, reference
    from .bench import problems

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
            from . import compile_check, launch
        except ImportError as e:
            print(f"  cuda-tile is not installed ({e}); skipping the kernel compile")
            return 0
        import time
        for call in launch.plan_for_problem():
            t0 = time.perf_counter()
            size = compile_check.compile_call(call, "sm_90")
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


def bench(args):
    from .bench import impls, problems, roofline, timing

    shapes = []
    for key in args.shapes.split(","):
        shapes += problems.REGISTRY[key]
    names = args.impls.split(",")
    rows = []
    for shape in shapes:
        b, l, h, g, p, n = shape.dims()
        inp = problems.make_inputs(shape)
        floor = roofline.floor_ms(roofline.forward_bytes(b, l, h, g, p, n),
                                  roofline.forward_flops(b, l, h, g, p, n, shape.chunk))
        ref_out = None
        for name in names:
            fwd = impls.IMPLS[name](inp, shape.chunk)
            row = {"shape": shape.name, "dims": [b, l, h, g, p, n, shape.chunk], "impl": name,
                   "floor_ms": floor}
            if fwd is None:
                row["status"] = "n/a"
                rows.append(row)
                print(json.dumps(row))
                continue
            try:
                row["first_call_s"] = timing.time_first_call(fwd)
                out = fwd()[0]
                if ref_out is None:
                    ref_out = out
                row["max_diff_vs_first"] = _rel_err(out, ref_out)
                row["status"] = "ok" if row["max_diff_vs_first"] < 2e-2 else "MISMATCH"
                row["graph"] = timing.time_graph(fwd, reps=args.reps)
                row["eager"] = timing.time_eager(fwd, reps=max(5, args.reps // 2))
                row["pct_of_floor"] = 100 * floor / row["graph"]["median_ms"]
            except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
                row["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            del fwd
            torch.cuda.empty_cache()
    if args.breakdown:
        rows.append(breakdown(shapes[0]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": impls.versions(), "rows": rows}, f, indent=1)
    return 0


def breakdown(shape):
    """Kernel time of each of our launches alone (CUDA graph), at one shape."""
    import cuda.tile as ct

    from . import interface, launch
    from .bench import problems, timing

    inp = problems.make_inputs(shape)
    b, l, h, g, p, n = shape.dims()
    Q = shape.chunk
    nc = -(-l // Q)
    dev = inp["x"].device
    dt_buf = torch.empty((b, h, nc * Q), dtype=torch.float32, device=dev)
    cum = torch.empty_like(dt_buf)
    states = torch.empty((b, h, nc, p, n), dtype=inp["C"].dtype, device=dev)
    final = torch.empty((b, h, p, n), dtype=torch.float32, device=dev)
    out = torch.empty_like(inp["x"])
    cfg = launch.default_config(b, h, p, n, Q, inp["x"].dtype, launch.num_sms(0))
    calls = launch.forward_plan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], None,
                                inp["D"], None, -float("inf"), float("inf"), False,
                                inp["initial_states"], None, dt_buf, cum, states, final, out, cfg)
    row = {"shape": shape.name, "impl": "breakdown", "config": str(cfg)}
    for call in calls:
        name = call.kernel._annotated_function.pyfunc.__name__

        def run(call=call):
            ct.launch(torch.cuda.current_stream(), call.grid, call.kernel, call.args)
        run()
        row[name] = timing.time_graph(run, reps=30)["median_ms"]
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mamba2-cutile", description=__doc__)
    sub = parser.add_subparsers(dest="cmd")
    pb = sub.add_parser("bench", help="time the forward beside mamba_ssm and TileGym")
    pb.add_argument("--shapes", default="seed", help="registry keys: seed,sweep,models")
    pb.add_argument("--impls", default="mamba2-cutile,mamba_ssm,tilegym")
    pb.add_argument("--reps", type=int, default=50)
    pb.add_argument("--json", default=None)
    pb.add_argument("--breakdown", action="store_true", help="also time each of our kernels")
    args = parser.parse_args(argv)
    if args.cmd == "bench":
        return bench(args)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
