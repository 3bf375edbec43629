"""One forward under each `scan_causal` mode in its own process, with a time limit, timing the
first call (compiles included) and then the kernels, to tell a slow compile from a launch that
does not return.

    python3 scripts/causal_probe.py [--modes 0,1,2,3,4] [--limit 90] [--shape 1,1024,8]
    python3 scripts/causal_probe.py --per-kernel --configs "scan_causal=3;scan_causal=3,scan_occupancy=0"

Mode 0 (the plain forward, not causal under bad input) is the control of the NaN check; 4 is
the shape rule's default.
--configs: forward configs (MAMBA2_CUTILE_CONFIG values, `;` between them) in place of
--modes. --per-kernel: the forward's planned launches one at a time, each followed by a
synchronize, printing which launch is running (and, after a flagging chunk_scan, how many of
its flags are not finite; before the flagged-head pass of mode 4, how many of the state
pass's flags are set), so a launch that does not return is named.
"""
import argparse
import json
import os
import subprocess
import sys
import time

#: the child processes' problem (SHAPE = batch, seqlen, heads; headdim 64, dstate 128, bf16)
INPUTS = r"""
b, l, h = SHAPE
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(b, l, h, 64, device="cuda", generator=g).to(torch.bfloat16)
dt = torch.rand(b, l, h, device="cuda", generator=g) * 0.1
A = -torch.rand(h, device="cuda", generator=g)
B = torch.randn(b, l, 1, 128, device="cuda", generator=g).to(torch.bfloat16)
C = torch.randn(b, l, 1, 128, device="cuda", generator=g).to(torch.bfloat16)
D = torch.randn(h, device="cuda", generator=g)
"""

CHILD = r"""
import faulthandler, json, sys, time, torch
# a stuck child prints where it is (compile, launch or synchronize) before the time limit
faulthandler.dump_traceback_later(DUMP_AFTER, exit=False)
from mamba2_cutile import mamba_chunk_scan_combined
INPUTS
t0 = time.time()
y = mamba_chunk_scan_combined(x, dt, A, B, C, 128, D=D)
torch.cuda.synchronize()
first = time.time() - t0
print(f"first call {first:.1f} s", file=sys.stderr, flush=True)
# mid-block (not a chunk's or a 64-token query block's first token), so that a non-causal
# form would reach earlier outputs of the same block
tok = l // 2 + 37
bad = x.clone(); bad[0, tok, 0, 0] = float("nan")
yb = mamba_chunk_scan_combined(bad, dt, A, B, C, 128, D=D)
torch.cuda.synchronize()
same = bool(torch.equal(yb[0, :tok], y[0, :tok]))
print("nan call done", file=sys.stderr, flush=True)
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for _ in range(3):
    mamba_chunk_scan_combined(x, dt, A, B, C, 128, D=D)
e0.record()
for _ in range(20):
    mamba_chunk_scan_combined(x, dt, A, B, C, 128, D=D)
e1.record(); torch.cuda.synchronize()
print(json.dumps({"first_s": round(first, 2), "ms": e0.elapsed_time(e1) / 20,
                  "earlier_outputs_unchanged_by_nan": same}))
"""


PER_KERNEL = r"""
import faulthandler, json, sys, time, torch
import cuda.tile as ct
faulthandler.dump_traceback_later(DUMP_AFTER, exit=False)
from mamba2_cutile.ssd.forward import forward_launches
INPUTS
stream = torch.cuda.current_stream()
res = []
for rnd in range(2):
    calls = forward_launches(x, dt, A, B, C, 128, D=D)[0]
    for i, call in enumerate(calls):
        name = call.kernel._annotated_function.pyfunc.__name__
        check = call.args[-1] if name.startswith("chunk_scan") else None
        print(f"round {rnd} launch {i} {name} grid {call.grid} CHECK {check}", file=sys.stderr,
              flush=True)
        t0 = time.time()
        ct.launch(stream, call.grid, call.kernel, call.args)
        torch.cuda.synchronize()
        row = dict(round=rnd, launch=i, kernel=name, grid=list(call.grid), check=check,
                   s=round(time.time() - t0, 4))
        if check in (1, 3, 5):
            flags = call.args[-2]
            row["flags_not_finite"] = int((~torch.isfinite(flags)).sum())
            row["flags"] = list(flags.shape)
        elif check == 8:          # mode 4: the state pass's flags, 1.0 where a run went bad
            flags = call.args[-2]
            row["flags_set"] = int((flags != 0).sum())
            row["flags"] = list(flags.shape)
        res.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
print(json.dumps(res))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="0,1,2,3,4")
    ap.add_argument("--limit", type=int, default=90)
    ap.add_argument("--shape", default="1,1024,8", help="batch,seqlen,heads")
    ap.add_argument("--configs", default=None)
    ap.add_argument("--per-kernel", action="store_true")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    specs = (args.configs.split(";") if args.configs else
             [f"scan_causal={mode}" for mode in args.modes.split(",")])
    for spec in specs:
        env = dict(os.environ, MAMBA2_CUTILE_CONFIG=spec)
        t0 = time.time()
        try:
            child = (PER_KERNEL if args.per_kernel else CHILD).replace(
                "INPUTS", INPUTS).replace("SHAPE", repr(shape)).replace(
                "DUMP_AFTER", str(max(1, args.limit - 10)))
            res = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                                 text=True, timeout=args.limit)
            line = (res.stdout.strip().splitlines() or [""])[-1]
            out = {"rc": res.returncode, "result": line, "stderr": res.stderr[-600:]}
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            out = {"rc": "timeout", "limit_s": args.limit, "stderr": err[-1500:]}
        print(json.dumps({"config": spec, "shape": shape,
                          "wall_s": round(time.time() - t0, 1), **out}), flush=True)


if __name__ == "__main__":
    main()
