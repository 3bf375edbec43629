"""Decode config sweep in one process: BLOCK_P x occupancy x how the state moves (TMA or not,
bounds checks or not) at a 7B-class shape (H=128, P=64, N=128, G=8, bf16 state), each checked
against mamba_ssm's y and state, then timed (CUDA graph). One JSON line per (batch, config).

    python3 scripts/sweep_decode.py [batches]
"""
import json
import sys
from dataclasses import replace

import torch

from mamba2_cutile.decode import decode_config
from mamba2_cutile.bench import decode as bd
from mamba2_cutile.bench.timing import time_graph

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,8,64,256").split(",")]
h, p, n, g = 128, 64, 128, 8
theirs_fn = bd._mamba_ssm()
for b in batches:
    inp = bd.make_decode_inputs(b, h, p, n, g)
    nbytes = bd.decode_bytes(inp)
    default = decode_config(b, h, p, n, 132)
    ref_state = inp["state"].clone()
    ref_y = theirs_fn(ref_state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"],
                      z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True)
    t = time_graph(bd._theirs(dict(inp, state=inp["state"].clone())), reps=100)["median_ms"]
    print(json.dumps({"batch": b, "config": "mamba_ssm", "us": t * 1e3,
                      "gbps": nbytes / (t * 1e-3) / 1e9}), flush=True)
    specs = [dict(), dict(unchecked=0), dict(occupancy=3), dict(occupancy=2),
             dict(occupancy=5), dict(block_p=32, occupancy=8), dict(block_p=128, occupancy=2),
             dict(latency=4), dict(latency=8), dict(tma=2), dict(tma=1), dict(block_n=64),
             dict(flat=1), dict(persistent=4), dict(occupancy=3, warps=8)]
    for spec in specs:
        name = ",".join(f"{k}={v}" for k, v in spec.items()) or "default"
        try:
            run = dict(inp, state=inp["state"].clone())
            y = bd._ours(run, replace(default, **spec))()
            dy = (y.float() - ref_y.float()).abs().max().item()
            ds = (run["state"].float() - ref_state.float()).abs().max().item()
            t = time_graph(bd._ours(run, replace(default, **spec)), reps=100)["median_ms"]
            print(json.dumps({"batch": b, "config": name, "us": t * 1e3,
                              "gbps": nbytes / (t * 1e-3) / 1e9, "dy": dy, "ds": ds}),
                  flush=True)
        except Exception as e:  # noqa: BLE001 - one bad config must not end the sweep
            print(json.dumps({"batch": b, "config": name,
                              "error": f"{type(e).__name__}: {str(e)[:200]}"}), flush=True)
    del inp
    torch.cuda.empty_cache()
