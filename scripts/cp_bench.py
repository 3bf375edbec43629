"""Context-parallel scan benchmark: forward + backward of one long sequence split across GPUs.

Under torchrun, each rank holds T / W tokens of one sequence (batch 1) and runs
`mamba2_cutile.distributed.chunk_scan_cp` forward + backward; CUDA events after warm-up time
every repetition on every rank, the slowest rank's time per repetition is the step's time, and
tokens/s = T / (median of those). `--baseline` then times the whole sequence on rank 0's GPU
alone (`mamba_chunk_scan_combined`, the one-GPU run) and prints the speedup. The bytes each
rank sends come from `distributed.bytes_sent_per_rank` (ring collectives, fp32 states).

    # 2 GPUs (sets NCCL_NVLS_ENABLE=0 itself: NVLink multicast can put the host's GPUs out
    # of service); 1M and 256K tokens, 80 heads, headdim 64, dstate 128, chunk 256, bf16
    torchrun --standalone --nproc_per_node 2 scripts/cp_bench.py --tokens 1M,256K --baseline \
        --json cp-bench-w2.json
    torchrun --standalone --nproc_per_node 1 scripts/cp_bench.py --tokens 1M,256K   # W = 1

    # one GPU, ranks simulated in one process: each slice's forward + backward timed alone
    # (the per-rank work without the exchange), checked against the whole-sequence run
    python scripts/cp_bench.py --simulate 2 --tokens 1M,256K --json cp-sim.json

Options of the problem: D per head, dt_bias with softplus (a Mamba-2 layer's), no z,
realistic A and dt (bench.problems.random_problem).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"      # before NCCL initializes, in every rank

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mamba2_cutile import mamba_chunk_scan_combined  # noqa: E402
from mamba2_cutile.bench.problems import parse_dtype, random_problem  # noqa: E402
from mamba2_cutile.distributed import bytes_sent_per_rank, chunk_scan_cp  # noqa: E402
from mamba2_cutile.distributed import context_parallel as cp  # noqa: E402

GRAD_KEYS = ("x", "dt", "A", "B", "C", "D", "dt_bias")


def parse_tokens(spec):
    out = []
    for v in spec.split(","):
        v = v.strip().upper()
        mult = 1
        if v.endswith("K"):
            mult, v = 1024, v[:-1]
        elif v.endswith("M"):
            mult, v = 1024 * 1024, v[:-1]
        out.append(int(float(v) * mult))
    return out


def problem(tokens, args, device, seed):
    inp, kw = random_problem(1, tokens, args.heads, args.groups, args.headdim, args.dstate,
                             parse_dtype(args.dtype), D="h", dt_bias=True, device=device,
                             seed=seed)
    return {**inp, **kw}


def leaves(prob):
    return {k: (v.detach().requires_grad_(True) if k in GRAD_KEYS else v)
            for k, v in prob.items()}


def time_fwd_bwd(step, warmup, reps):
    """Milliseconds of each of `reps` calls of step() after `warmup` calls (CUDA events)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _fwd_bwd(fn, lv, dout, dfinal):
    out, fin = fn(lv)
    names = [k for k in GRAD_KEYS if k in lv]
    torch.autograd.grad([out, fin], [lv[k] for k in names], [dout, dfinal])


def whole_sequence(tokens, args, device):
    """One GPU, the whole sequence: per-repetition milliseconds of forward + backward."""
    prob = problem(tokens, args, device, seed=0)
    lv = leaves(prob)
    dout = torch.randn_like(prob["x"])
    dfinal = torch.randn(1, args.heads, args.headdim, args.dstate, device=device)

    def run(lv):
        return mamba_chunk_scan_combined(**lv, chunk_size=args.chunk, return_final_states=True)
    return time_fwd_bwd(lambda: _fwd_bwd(run, lv, dout, dfinal), args.warmup, args.reps)


def _distributed_one(tokens, args, rank, world, device):
    """This rank's share of `tokens` through chunk_scan_cp: the result row (every rank)."""
    base, extra = divmod(tokens, world)
    mine = base + (1 if rank < extra else 0)
    prob = problem(mine, args, device, seed=1000 + rank)
    for k in ("A", "D", "dt_bias"):           # replicated: the same on every rank
        dist.broadcast(prob[k], src=0)
    lv = leaves(prob)
    dout = torch.randn_like(prob["x"])
    dfinal = torch.randn(1, args.heads, args.headdim, args.dstate, device=device)

    def run(lv):
        return chunk_scan_cp(**lv, chunk_size=args.chunk, return_final_states=True)
    mine_ms = torch.tensor(time_fwd_bwd(lambda: _fwd_bwd(run, lv, dout, dfinal),
                                        args.warmup, args.reps), device=device)
    every = [torch.empty_like(mine_ms) for _ in range(world)]
    dist.all_gather(every, mine_ms)
    slowest = torch.stack(every).max(dim=0).values.tolist()
    row = dict(mode="torchrun", world=world, tokens=tokens, tokens_per_rank=mine,
               slowest_rank_ms=statistics.median(slowest),
               per_rank_median_ms=[statistics.median(t.tolist()) for t in every],
               bytes_sent_per_rank=bytes_sent_per_rank(1, args.heads, args.headdim,
                                                       args.dstate, world),
               peak_gib_rank=torch.cuda.max_memory_allocated() / 2**30)
    row["tokens_per_s"] = tokens / (row["slowest_rank_ms"] / 1e3)
    return row


def run_distributed(args):
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cpu":        # a smoke test of the script itself (gloo)
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for tokens in parse_tokens(args.tokens):
        row = _distributed_one(tokens, args, rank, world, device)
        torch.cuda.empty_cache()
        if args.baseline:
            dist.barrier()
            if rank == 0:
                one = statistics.median(whole_sequence(tokens, args, device))
                torch.cuda.empty_cache()
                row.update(one_gpu_ms=one, one_gpu_tokens_per_s=tokens / (one / 1e3),
                           speedup=one / row["slowest_rank_ms"])
            dist.barrier()
        results.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
    dist.destroy_process_group()


def _simulated_rank(sl, pieces, rank, world, args, device):
    """Median ms of one simulated rank's forward + backward: its local scan, the fold of the
    (hand-made) gathered states and its correction, back to its inputs and the states."""
    lv = leaves(sl)
    gathered = pieces.clone().requires_grad_(True)
    dout = torch.randn_like(lv["x"])
    dfinal = torch.randn(1, args.heads, args.headdim, args.dstate, device=device)
    names = [k for k in GRAD_KEYS if k in lv]

    def step():
        loc = cp.local_scan(**lv, chunk_size=args.chunk)
        out, fin = cp.finish(loc, gathered, None, rank, world, lv["C"])
        torch.autograd.grad([out, fin], [lv[k] for k in names] + [gathered], [dout, dfinal],
                            allow_unused=True)
    return statistics.median(time_fwd_bwd(step, args.warmup, args.reps))


def run_simulated(args):
    """One GPU: the whole-sequence time, then each simulated rank's forward + backward alone
    (its local scan, the fold of the gathered states and its correction, with the gathered
    states made by hand), and the simulation's output against the whole-sequence run."""
    device = torch.device(args.device)
    world = args.simulate
    results = []
    for tokens in parse_tokens(args.tokens):
        one = statistics.median(whole_sequence(tokens, args, device))
        prob = problem(tokens, args, device, seed=0)
        base, extra = divmod(tokens, world)
        lengths = [base + (1 if r < extra else 0) for r in range(world)]
        cuts = [0]
        for k in lengths:
            cuts.append(cuts[-1] + k)
        part = lambda t, r: t[:, cuts[r]:cuts[r + 1]]  # noqa: E731
        per_tok = ("x", "dt", "B", "C")
        slices = [{k: (part(v, r) if k in per_tok else v) for k, v in prob.items()}
                  for r in range(world)]
        with torch.no_grad():      # the pieces every rank would receive
            pieces = torch.stack([cp.local_scan(**s, chunk_size=args.chunk).piece()
                                  for s in slices])
        per_rank = [_simulated_rank(slices[r], pieces, r, world, args, device)
                    for r in range(world)]
        with torch.no_grad():
            sim_out, _ = cp.simulate_ranks(lengths, **prob, chunk_size=args.chunk)
            whole, _ = mamba_chunk_scan_combined(**prob, chunk_size=args.chunk,
                                                 return_final_states=True)
            err = ((sim_out.float() - whole.float()).abs().max()
                   / whole.float().abs().max()).item()
        del prob, slices, sim_out, whole
        torch.cuda.empty_cache()
        slowest = max(per_rank)
        row = dict(mode="simulated", world=world, tokens=tokens, one_gpu_ms=one,
                   per_rank_ms=per_rank, slowest_rank_ms=slowest,
                   projected_speedup_without_exchange=one / slowest,
                   out_rel_err_vs_whole=err,
                   bytes_sent_per_rank=bytes_sent_per_rank(1, args.heads, args.headdim,
                                                           args.dstate, world))
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)


def _time_on_cpu():
    """Stand-ins for the CUDA timing calls, so that the script's logic runs on a CPU."""
    import time

    class Event:
        def __init__(self, **kw):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    torch.cuda.Event = Event
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.max_memory_allocated = lambda *a: 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1M,256K", help="sequence lengths (K, M suffixes)")
    ap.add_argument("--heads", type=int, default=80)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--dstate", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--baseline", action="store_true",
                    help="torchrun: also time the whole sequence on rank 0's GPU alone")
    ap.add_argument("--simulate", type=int, default=0, metavar="W",
                    help="one GPU, W ranks simulated in one process")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)   # cpu: smoke test
    args = ap.parse_args(argv)
    if args.device == "cpu":
        _time_on_cpu()
    elif not torch.cuda.is_available():
        sys.exit("cp_bench needs a CUDA GPU")
    if args.simulate:
        run_simulated(args)
    else:
        run_distributed(args)


if __name__ == "__main__":
    main()
