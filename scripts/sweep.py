"""Forward config sweep in one process (one compile cache, no per-config start-up).

    python3 scripts/sweep.py [--ours-only] SHAPES CONFIG [CONFIG ...]      (on a CUDA machine)

SHAPES: bench registry keys (comma list), or "custom=B,T,H,G,P,N,Q;..." (custom shapes).
CONFIG: MAMBA2_CUTILE_CONFIG strings ("default",
"scan_block_n=32,scan_lowp=1", ...). Each config is checked against mamba_ssm's output, then
timed (CUDA graph, L2 flushed), whole forward and per kernel. One JSON line per (shape, config).
--ours-only: no mamba_ssm (no baseline time and no output check: "diff" is null).
--check-each: mamba_ssm runs beside every config, not only the first, so that each config's
"diff" is its output against mamba_ssm's (its time is printed once).
SWEEP_COMPILE_ONLY=1: run each config's forward once and time nothing (fills the kernel cache,
so that several configs can compile in parallel processes before one process times them).
"""
import json
import os
import sys

import torch

from mamba2_cutile.bench import impls, problems, runner

argv = sys.argv[1:]
ours_only = "--ours-only" in argv
check_each = "--check-each" in argv
argv = [a for a in argv if a not in ("--ours-only", "--check-each")]
shapes = ([problems.parse_custom(s) for s in argv[0][len("custom="):].split(";") if s]
          if argv[0].startswith("custom=") else problems.select(argv[0]))
for shape in shapes:
    for i, cfg in enumerate(argv[1:]):
        os.environ["MAMBA2_CUTILE_CONFIG"] = cfg
        if os.environ.get("SWEEP_COMPILE_ONLY", "") not in ("", "0"):
            try:
                impls.ours(problems.make_inputs(shape), shape.chunk)()
                torch.cuda.synchronize()
                print(json.dumps({"shape": shape.name, "config": cfg, "compiled": True}),
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(json.dumps({"shape": shape.name, "config": cfg,
                                  "status": f"error: {type(e).__name__}: {str(e)[:300]}"}),
                      flush=True)
            continue
        names = (["mamba_ssm", "mamba2-cutile"] if (i == 0 or check_each) and not ours_only
                 else ["mamba2-cutile"])
        try:
            rows = runner.run_case(shape, names, mode="fwd")
            ours = rows[-1]
            if i == 0 and not ours_only:
                ref = rows[0]
                print(json.dumps({"shape": shape.name, "config": "mamba_ssm",
                                  "ms": runner.kernel_ms(ref)}), flush=True)
            bd = runner.breakdown(shape)
            print(json.dumps({"shape": shape.name, "config": cfg, "status": ours.get("status"),
                              "ms": runner.kernel_ms(ours),
                              "diff": ours.get("max_diff_vs_first"),
                              "first_s": ours.get("first_call_s"),
                              "kernels": {k: round(v, 4) for k, v in bd["kernels"].items()}}),
                  flush=True)
        except Exception as e:  # noqa: BLE001 - one bad config must not end the sweep
            print(json.dumps({"shape": shape.name, "config": cfg,
                              "status": f"error: {type(e).__name__}: {str(e)[:300]}"}), flush=True)
