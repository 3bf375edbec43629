"""Where the eager time of one decode call goes, on the GPU machine: host microseconds per call
of each layer of `selective_state_update` at batch 1 (H=128 P=64 N=128 G=8, bf16 state, z,
softplus), and of mamba_ssm's, each called CALLS times back to back then synchronized; the
pieces are interleaved round by round so that machine drift hits all of them alike.

    python3 scripts/decode_latency.py [batch] [calls] [rounds]

Prints one JSON line per piece: median / min over rounds, microseconds per call.
"""
import json
import statistics
import sys
import time

import cuda.tile as ct
import torch

from mamba2_cutile import decode
from mamba2_cutile.bench import decode as bd

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
calls = int(sys.argv[2]) if len(sys.argv) > 2 else 200
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 11
h, p, n, g = 128, 64, 128, 8
inp = bd.make_decode_inputs(batch, h, p, n, g)
args = (inp["state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"],
        inp["dt_bias"], True, None, None)
y = torch.empty_like(inp["x"])
plan = decode.decode_plan(*args, y)
stream = torch.cuda.current_stream()
key = decode._layout_key(args[:9] + (None, None), True)
tiny = torch.zeros(16, device="cuda")

pieces = {
    "ours (selective_state_update)": lambda: decode.selective_state_update(**inp),
    "ours: ct.launch of a prebuilt plan": lambda: [ct.launch(stream, c.grid, c.kernel, c.args)
                                                   for c in plan],
    "ours: decode_plan (cached, no launch)": lambda: decode.decode_plan(*args, y,
                                                                         layout_key=key),
    "ours: layout key": lambda: decode._layout_key(args[:9] + (None, None), True),
    "torch.empty (y)": lambda: torch.empty(inp["x"].shape, dtype=inp["x"].dtype,
                                           device=inp["x"].device),
    "torch.cuda.current_stream": lambda: torch.cuda.current_stream(inp["x"].device),
    "torch tiny add_ (one torch launch)": lambda: tiny.add_(1.0),
}
theirs = bd._theirs(dict(inp, state=inp["state"].clone()))
if theirs is not None:
    pieces["mamba_ssm (selective_state_update)"] = theirs

for fn in pieces.values():          # compile, warm caches
    for _ in range(5):
        fn()
torch.cuda.synchronize()
samples = {name: [] for name in pieces}
for _ in range(rounds):
    for name, fn in pieces.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples[name].append((time.perf_counter() - t0) * 1e6 / calls)
for name, s in samples.items():
    print(json.dumps({"batch": batch, "piece": name, "median_us": round(statistics.median(s), 2),
                      "min_us": round(min(s), 2), "calls": calls, "rounds": rounds}), flush=True)
