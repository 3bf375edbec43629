"""Backward config sweep in one process: per-launch kernel time of the cuTile backward for
each config, gradients checked against the first config's (and mamba_ssm's with SWEEP_VS_MAMBA=1:
its first backward autotunes for about a minute).

    python3 scripts/sweep_backward.py SHAPES CONFIG [CONFIG ...]      (on a CUDA machine)

SHAPES: registry names or sets (`mamba2-cutile bench --list`), or "custom=B,T,H,G,P,N,Q;..."
CONFIG: a MAMBA2_CUTILE_BWD_CONFIG string ("default", "lowp=1,dx_block_q=128"), optionally
with "state_dtype=bf16" (the dtype of the recomputed entry states and exit gradients) and
"chunk=N": the backward's internal chunk length (the chunked algorithm is exact for any chunk,
so a chunk-256 call may run its backward at 128; gradients then differ only in rounding).
One JSON line per (shape, config): kernels (ms each, CUDA graph), total_ms, max rel. diffs.
SWEEP_COMPILE_ONLY=1: run each config's backward once and time nothing (fills the kernel cache,
so that several shapes can compile in parallel processes before one process times them).
"""
import json
import os
import sys

import torch

from mamba2_cutile.runtime import launch_calls, num_sms
from mamba2_cutile.ssd import backward
from mamba2_cutile.bench import problems, runner, timing


def grads(shape, inp, dout, dfinal, cfg, state_dtype):
    def launch_fn(calls):
        launch_calls(calls, inp["x"].device)
    return backward.run_backward(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                                 shape.chunk, dout, dfinal, D=inp["D"], z=inp.get("z"),
                                 initial_states=inp["initial_states"], state_dtype=state_dtype,
                                 config=cfg, launch_fn=launch_fn, sms=num_sms(0))


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def mamba_ssm_grads(shape, inp, dout, dfinal):
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as f
    leaves = {k: inp[k].detach().clone().requires_grad_(True)
              for k in ("x", "dt", "A", "B", "C", "D", "initial_states", "z") if k in inp}
    out, fin = f(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], shape.chunk,
                 D=leaves["D"], z=leaves.get("z"), initial_states=leaves["initial_states"],
                 return_final_states=True)
    torch.autograd.backward([out, fin], [dout, dfinal])
    return {k: v.grad for k, v in leaves.items()}


def sweep_shape(shape, specs):
    inp = problems.make_inputs(shape)
    dout, dfinal = problems.make_grad_outputs(shape)
    b, seqlen, h, g, p, n = shape.dims()
    first = None
    for spec in specs:
        parts = [s for s in spec.split(",") if s and s != "default"]
        sdt = None
        chunk = shape.chunk
        for s in list(parts):
            if s.startswith("state_dtype="):
                sdt = problems.parse_dtype(s.split("=")[1])
                parts.remove(s)
            elif s.startswith("chunk="):
                chunk = int(s.split("=")[1])
                parts.remove(s)
        os.environ["MAMBA2_CUTILE_BWD_CONFIG"] = ",".join(parts)
        try:
            cfg = backward.backward_config(b, h, g, p, n, chunk, shape.dtype, num_sms(0),
                                           seqlen=seqlen, has_z=inp.get("z") is not None)
            got = grads(shape, inp, dout, dfinal, cfg, sdt)
            row = {"shape": shape.name, "config": spec}
            if os.environ.get("SWEEP_COMPILE_ONLY"):
                torch.cuda.synchronize()
                print(json.dumps({**row, "compiled": True}), flush=True)
                continue
            if first is None:
                first = got
            if first is got and os.environ.get("SWEEP_VS_MAMBA"):
                try:
                    theirs = mamba_ssm_grads(shape, inp, dout, dfinal)
                    row["vs_mamba_ssm"] = {k: round(rel(got[k], theirs[k]), 6)
                                           for k in theirs}
                except Exception as e:  # noqa: BLE001
                    row["vs_mamba_ssm"] = f"{type(e).__name__}: {str(e)[:200]}"
            if first is not got:
                row["vs_first"] = {k: round(rel(v, first[k]), 6) for k, v in got.items()
                                   if v is not None}
            bd = runner.backward_breakdown(shape, reps=30, config=cfg, state_dtype=sdt,
                                           inputs=(inp, dout, dfinal))
            row["kernels"] = {k: round(v, 4) for k, v in bd["kernels"].items()}
            row["total_ms"] = round(bd["total_ms"], 4)

            def whole(shape=shape, inp=inp, dout=dout, dfinal=dfinal, cfg=cfg, sdt=sdt):
                grads(shape, inp, dout, dfinal, cfg, sdt)
            row["whole_ms"] = round(timing.time_graph(whole, reps=30)["median_ms"], 4)
            print(json.dumps(row), flush=True)
        except Exception as e:  # noqa: BLE001 - one bad config must not end the sweep
            print(json.dumps({"shape": shape.name, "config": spec,
                              "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)


if sys.argv[1].startswith("custom="):
    shapes = [problems.parse_custom(s) for s in sys.argv[1][len("custom="):].split(";")]
else:
    shapes = problems.select(sys.argv[1])
for shape in shapes:
    sweep_shape(shape, sys.argv[2:])
    torch.cuda.empty_cache()
