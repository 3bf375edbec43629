"""GPU: context parallelism through the cuTile kernels.

- One GPU: ranks simulated in one process (`distributed.simulate_ranks`: each slice through
  our scan, the all-gather done by hand), against the float64 chunked reference (outputs, the
  state at every slice end, every gradient) and against our own whole-sequence run.
- Two or more GPUs: `chunk_scan_cp` in 2 spawned processes over NCCL (NCCL_NVLS_ENABLE=0),
  each rank's slice against the float64 reference and against the one-GPU run; skipped with
  fewer than 2 GPUs.

    python -m pytest -m gpu tests/distributed          (MAMBA2_TEST_LOG=path logs the errors)

Tolerances: the forward's and backward's (support.tolerances forward_tol, grad_tol: bf16 2e-2,
fp32 2e-3, per-gradient exceptions). Expected errors: those of the whole-sequence run plus one
more rounding of the output to x's dtype (the carried-state term is added to the rounded
zero-start output: at most 2^-9 = 2e-3 relative in bf16, 6e-8 in fp32) and float32 rounding of
the exchanged states (about 1e-7); the term itself is a float32 product. So the bounds are the
same as the single-GPU tests', which sit 3-5x above the whole-sequence errors measured.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from mamba2_cutile import mamba_chunk_scan_combined
from mamba2_cutile.distributed import simulate_ranks

import cp_gpu_cases as cases
from support.gpu import log_result, rel_err
from support.tolerances import forward_tol, grad_tol

pytestmark = pytest.mark.gpu

BF16, FP32 = torch.bfloat16, torch.float32
ALL = dict(D="hp", z=True, dt_bias=True, init=True, seq_idx=True)

#: id -> ((b, l, h, g, p, n), chunk, dtype, options, seq_idx cuts, slice lengths)
CASES = {
    "all-bf16-Q128": ((2, 1000, 8, 2, 64, 128), 128, BF16, ALL, (1, 300, 301, 700),
                      (333, 667)),
    "all-edge-cut": ((2, 1000, 8, 2, 64, 128), 128, BF16, ALL, (400, 750), (400, 350, 250)),
    "plain-Q256-odd-dims": ((1, 1500, 8, 1, 80, 96), 256, BF16, {}, (), (256, 0, 700, 544)),
    "slow-decay-bf16": ((1, 1200, 8, 1, 64, 128), 128, BF16, dict(slow=True, D="h"), (),
                        (300, 300, 300, 300)),
    "slow-decay-z-fp32": ((2, 700, 4, 4, 32, 64), 64, FP32, dict(slow=True, z=True, D="h"),
                          (), (1, 127, 572)),
    "seq-fp32": ((2, 900, 6, 3, 40, 24), 64, FP32, dict(seq_idx=True, init=True),
                 (64, 65, 500), (64, 436, 400)),
}


def _whole_run(args, Q, dout, dfinal):
    """Our single-GPU scan of the whole sequence: out, final state and gradients."""
    lv = cases.leaves(args)
    out, fin = mamba_chunk_scan_combined(**lv, chunk_size=Q, return_final_states=True)
    names = [k for k in cases.NAMES if isinstance(lv.get(k), torch.Tensor)]
    grads = torch.autograd.grad([out, fin], [lv[k] for k in names], [dout, dfinal])
    return out.detach(), fin.detach(), dict(zip(names, grads))


@pytest.mark.parametrize("case,full_prefix", [(c, False) for c in CASES] +
                         [("all-bf16-Q128", True), ("slow-decay-z-fp32", True)])
def test_simulated_ranks(case, full_prefix):
    """full_prefix: the correction over whole slices (the CUDA-graph-capture path)."""
    dims, Q, dtype, opts, cuts, lengths = CASES[case]
    args, dout, dfinal = cases.make_problem(*dims, dtype, opts, cuts)
    lv = cases.leaves(args)
    out, finals = simulate_ranks(lengths, **lv, chunk_size=Q, full_prefix=full_prefix)
    assert out.dtype == dtype and out.shape == args["x"].shape
    names = [k for k in cases.NAMES if isinstance(lv.get(k), torch.Tensor)]
    got = torch.autograd.grad([out, finals[-1]], [lv[k] for k in names], [dout, dfinal])
    got = dict(zip(names, got))

    ref_out, ref_finals = cases.reference_forward(args, lengths, Q)
    failures = cases.check_forward(out, finals, ref_out, ref_finals, dtype, case)
    ref_grads = cases.reference_grads(args, Q, dout, dfinal)
    failures += cases.check_grads(got, ref_grads, args, dtype, case)

    # against our whole-sequence run, the same tolerances
    w_out, w_fin, w_grads = _whole_run(args, Q, dout, dfinal)
    diffs = [f"out {rel_err(out, w_out):.2e}", f"final {rel_err(finals[-1], w_fin):.2e}"]
    if not rel_err(out, w_out) <= forward_tol(dtype):
        failures.append(f"out vs whole-sequence run {rel_err(out, w_out):.2e}")
    if not rel_err(finals[-1], w_fin) <= forward_tol(dtype):
        failures.append(f"final vs whole-sequence run {rel_err(finals[-1], w_fin):.2e}")
    for k in names:
        e = rel_err(got[k], w_grads[k])
        diffs.append(f"d{k} {e:.2e}")
        if not e <= grad_tol(k, dtype, args[k].dtype):
            failures.append(f"d{k} vs whole-sequence run {e:.2e}")
    line = f"{case} vs our whole-sequence run: " + ", ".join(diffs)
    print(line)
    log_result(line)
    assert not failures, "; ".join(failures)


def test_correction_matters():
    """The carried-state term is what makes the slices agree: without it (each rank from a zero
    state) the outputs of the slow-decay problem are far off the tolerance, so the test above
    can fail."""
    from mamba2_cutile.distributed import context_parallel as cp
    dims, Q, dtype, opts, cuts, lengths = CASES["slow-decay-bf16"]
    args, _, _ = cases.make_problem(*dims, dtype, opts, cuts)
    ref_out, _ = cases.reference_forward(args, lengths, Q)
    orig = cp.carried_term
    try:
        cp.carried_term = lambda *a, **k: None      # finish() then returns the local output
        out, _ = simulate_ranks(lengths, **args, chunk_size=Q)
    finally:
        cp.carried_term = orig
    e = rel_err(out, ref_out)
    log_result(f"without the carried-state term: out {e:.2e}")
    assert e > 10 * forward_tol(dtype)


# ----------------------------------------------------------------------------------------------
# NCCL, one process per GPU
# ----------------------------------------------------------------------------------------------

#: (case of CASES, the two slices' lengths): an edge inside a chunk, the state crossing a whole
#: slice, a seq_idx boundary exactly at rank 1's first token
NCCL_CASES = [("all-bf16-Q128", (333, 667)), ("slow-decay-bf16", (600, 600)),
              ("all-edge-cut", (400, 600))]


def _nccl_worker(rank, world, port, outdir):
    import torch.distributed as dist
    from mamba2_cutile.distributed import chunk_scan_cp
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    report = []
    try:
        for case, lengths in NCCL_CASES:
            dims, Q, dtype, opts, cuts, _ = CASES[case]
            lo = sum(lengths[:rank])
            hi = lo + lengths[rank]
            # drawn on the CPU: the same inputs in every process, whatever the GPU
            args, dout, dfinal = cases.make_problem(*dims, dtype, opts, cuts, device="cpu")
            dev = torch.device("cuda", rank)
            args = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
            dout, dfinal = dout.to(dev), dfinal.to(dev)
            lv = cases.leaves(cases.slice_of(args, lo, hi, rank == 0))
            out, fin = chunk_scan_cp(**lv, chunk_size=Q, return_final_states=True)
            names = [k for k in cases.NAMES if isinstance(lv.get(k), torch.Tensor)]
            last = rank == world - 1
            outs, cots = [out], [dout[:, lo:hi]]
            outs.append(fin)
            cots.append(dfinal if last else torch.zeros_like(dfinal))
            got = dict(zip(names, torch.autograd.grad(outs, [lv[k] for k in names], cots)))
            for k in ("A", "D", "dt_bias"):       # the partial sums add up to the gradient
                if k in got:
                    dist.all_reduce(got[k])
            ref_out, ref_finals = cases.reference_forward(args, lengths, Q)
            ref_grads = cases.reference_grads(args, Q, dout, dfinal)
            sl = lambda t, k: t[:, lo:hi] if k in cases.PER_TOKEN else t  # noqa: E731
            label = f"nccl {case} rank {rank}"
            fails = cases.check_forward(out, [fin], ref_out[:, lo:hi], [ref_finals[rank]],
                                        dtype, label)
            mine_args = {k: (sl(v, k) if isinstance(v, torch.Tensor) else v)
                         for k, v in args.items()}
            if rank != 0:
                mine_args["initial_states"] = None
            ref_mine = {k: (None if ref_grads[k] is None or mine_args.get(k) is None
                            else sl(ref_grads[k], k)) for k in cases.NAMES}
            fails += cases.check_grads(got, ref_mine, mine_args, dtype, label)
            w_out, _, _ = _whole_run(args, Q, dout, dfinal)
            e = rel_err(out, w_out[:, lo:hi])
            log_result(f"{label}: out vs the one-GPU run {e:.2e}")
            if not e <= forward_tol(dtype):
                fails.append(f"out vs the one-GPU run {e:.2e}")
            report.append((case, fails))
        torch.save(report, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus(tmp_path):
    import cp_cases
    os.environ["NCCL_NVLS_ENABLE"] = "0"     # NVLink multicast off (it can take GPUs down)
    world = 2
    mp.start_processes(_nccl_worker, args=(world, cp_cases.free_port(), str(tmp_path)),
                       nprocs=world, join=True, start_method="spawn")
    failures = []
    for r in range(world):
        for case, fails in torch.load(tmp_path / f"rank{r}.pt", weights_only=False):
            failures += [f"rank {r} {case}: {f}" for f in fails]
    assert not failures, "; ".join(failures)
