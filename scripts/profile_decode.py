"""Where a transformers model's generation step spends its time: torch.profiler over greedy
decode steps, with mamba2_cutile's bindings and with what transformers resolved itself.

    python3 scripts/profile_decode.py [--model bamba-hybrid] [--batch 64] [--steps 8]

Prints, per implementation, the wall time per generated token and the operators ranked by
host (self CPU) time and by device time.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mamba2_cutile.bench import model as bm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bamba-hybrid")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--impls", default="mamba2_cutile,transformers")
    ap.add_argument("--rows", type=int, default=22)
    a = ap.parse_args()
    model = bm.build_model(bm.MODELS[a.model](), dtype=torch.bfloat16, device="cuda")
    ids = bm._ids(model, a.batch, a.prompt)
    for impl in a.impls.split(","):
        with bm.implementation(impl), torch.no_grad():
            print(f"== {a.model} batch {a.batch}: {impl}: {bm.bindings(model, impl)}")
            bm._greedy(model, ids, a.steps + 1)          # compiles, autotuning
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            bm._greedy(model, ids, 1)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            bm._greedy(model, ids, a.steps + 1)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            per = ((t2 - t1) - (t1 - t0)) / a.steps * 1e3
            print(f"decode {per:.2f} ms per token (prefill {1e3 * (t1 - t0):.1f} ms)")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                bm._greedy(model, ids, a.steps + 1)
                torch.cuda.synchronize()
            ka = prof.key_averages()
            print(ka.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=60))
            print(ka.table(sort_by="self_device_time_total", row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
