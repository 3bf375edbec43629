"""What the multi-process CPU tests run in each process (spawned, gloo): the problems, each
rank's slice through `chunk_scan_cp` and its gradients, saved for the parent to compare with
the single-process run; and the argument errors that need a process group.

A problem is built from one seed in every process (so every rank holds the same whole
sequence and takes its slice). The loss of rank r is sum(y_r * dout_r) + sum(h_r * dfin_r),
with h_r the true state at the end of its slice: the single-process equivalent is
sum(y * dout) + sum_r sum(h(prefix up to the end of slice r) * dfin_r).
"""

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from support.emulator import OPTIONS, make_problem  # noqa: E402

from mamba2_cutile import mamba_chunk_scan_combined  # noqa: E402
from mamba2_cutile.distributed import chunk_scan_cp  # noqa: E402

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
PER_TOKEN = ("x", "dt", "B", "C", "z")
REPLICATED = ("A", "D", "dt_bias")
Q = 64

#: (option set of support.emulator.OPTIONS, slice lengths); l = 150, make_seq_idx puts
#: boundaries at tokens 64 and 128 of row 0 and 64 of row 1, so a slice starting there has a
#: boundary exactly at its edge. A "_slow" suffix: dt' around 0.01 instead of 0.3, so that the
#: carried state survives whole slices (decay over 40 tokens about 0.6 instead of 1e-5).
#: "_yonly": the loss is sum(y * dout) alone (the first rank's outputs then do not depend on the
#: exchange: its backward must still join the collective), and each rank scales y in place
CASES = {
    2: [("all", (70, 80)),            # every option, a slice edge inside a chunk
        ("seq_idx", (64, 86)),        # a boundary exactly at the second slice's first token
        ("D_chan_z", (1, 149)),       # a one-token slice
        ("init_no_dfinal", (100, 50)),
        ("bias_softplus_limit", (128, 22)),
        ("init_no_dfinal_slow", (75, 75)),
        ("D_head_slow_yonly", (60, 90))],       # a loss of y alone, y modified in place     # the state crosses whole slices
    3: [("all", (64, 0, 86)),         # an empty middle slice; edge boundary after it
        ("none", (50, 50, 50)),
        ("D_head_z_seq", (1, 63, 86)),
        ("init_no_dfinal", (0, 75, 75)),   # initial_states on an empty first slice
        ("limit_nosoftplus", (40, 90, 20)),
        ("D_chan_z_slow", (30, 40, 80))],       # ... through a whole middle slice
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def problem(name, b=2, l=150, h=4, g=2, p=5, n=6, seed=0):
    name = name.removesuffix("_yonly")
    slow = name.endswith("_slow")
    args, kw, dout, _ = make_problem(OPTIONS[name.removesuffix("_slow")], b=b, l=l, h=h, g=g,
                                     p=p, n=n, Q=Q, seed=seed)
    if slow:
        args["dt"] = args["dt"].abs() * 0.03
    return {**args, **kw}, dout


def cotangents(world, shape, seed=1, zero=False):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=torch.float64) * (0.0 if zero else 1.0)
            for _ in range(world)]


def _leaves(inp):
    return {k: (v.detach().clone().requires_grad_(True)
                if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in inp.items()}


def single_process(name, lengths):
    """The reference: the whole sequence in one process, finals at each slice end, grads."""
    inp, dout = problem(name)
    b, _, h, p = inp["x"].shape
    n = inp["B"].shape[3]
    dfins = cotangents(len(lengths), (b, h, p, n), zero=name.endswith("_yonly"))
    leaves = _leaves(inp)
    y = mamba_chunk_scan_combined(**leaves, chunk_size=Q)
    if name.endswith("_yonly"):
        y = y * 0.5
    loss = (y * dout).sum()
    finals, end = [], 0
    for k, dfin in zip(lengths, dfins):
        end += k
        pre = {key: (v[:, :end] if key in PER_TOKEN + ("seq_idx",) and v is not None else v)
               for key, v in leaves.items()}
        _, fin = mamba_chunk_scan_combined(**pre, chunk_size=Q, return_final_states=True)
        finals.append(fin.detach())
        loss = loss + (fin.double() * dfin).sum()
    loss.backward()
    grads = {k: None if not isinstance(leaves.get(k), torch.Tensor) else leaves[k].grad
             for k in NAMES}
    return {"y": y.detach(), "finals": finals, "grads": grads}


def run_rank(name, lengths, rank):
    """This rank's slice through chunk_scan_cp, its outputs and gradients."""
    inp, dout = problem(name)
    b, _, h, p = inp["x"].shape
    n = inp["B"].shape[3]
    dfin = cotangents(len(lengths), (b, h, p, n))[rank]
    lo = sum(lengths[:rank])
    hi = lo + lengths[rank]
    leaves = _leaves(inp)
    mine = {k: (v[:, lo:hi] if k in PER_TOKEN + ("seq_idx",) and v is not None else v)
            for k, v in leaves.items()}
    if rank != 0:
        mine["initial_states"] = None
    y, fin = chunk_scan_cp(**mine, chunk_size=Q, return_final_states=True)
    if name.endswith("_yonly"):
        y.mul_(0.5)
        loss = (y * dout[:, lo:hi]).sum()
    else:
        loss = (y * dout[:, lo:hi]).sum() + (fin.double() * dfin).sum()
    loss.backward()
    grads = {k: None if not isinstance(leaves.get(k), torch.Tensor) or leaves[k].grad is None
             else leaves[k].grad for k in NAMES}
    return {"y": y.detach(), "final": fin.detach(), "grads": grads, "dtype": y.dtype}


def _expect_value_error(fn, words):
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        assert all(w in msg for w in words), msg
        return msg
    raise AssertionError(f"no ValueError (expected one mentioning {words})")


def errors_on_rank(rank, world):
    """Argument errors that need a process group; every one raises before (or, for the
    cross-rank ones, in the same way on every rank after) a collective, so none hangs."""
    inp, _ = problem("all")
    lo, hi = rank * 10, rank * 10 + 10
    mine = {k: (v[:, lo:hi] if k in PER_TOKEN + ("seq_idx",) and v is not None else v)
            for k, v in inp.items()}
    out = []
    # initial_states on a later rank, rank 0's arguments valid: the later ranks raise their
    # own error, rank 0 one naming them (nobody waits in a collective)
    bad = dict(mine)
    if rank == 0:
        out.append(_expect_value_error(lambda: chunk_scan_cp(**bad, chunk_size=Q),
                                       ["rank(s)", "refused"]))
    else:
        out.append(_expect_value_error(lambda: chunk_scan_cp(**bad, chunk_size=Q),
                                       ["initial_states", "first rank"]))
    mine["initial_states"] = mine["initial_states"] if rank == 0 else None
    # ranks disagreeing on the problem: the same error on every rank
    dis = dict(mine)
    if rank == world - 1:
        dis["chunk_size"] = 128
    else:
        dis["chunk_size"] = Q
    out.append(_expect_value_error(lambda: chunk_scan_cp(**dis), ["disagree"]))
    dis = dict(mine, chunk_size=Q)
    if rank == 1:
        dis["z"] = None
    out.append(_expect_value_error(lambda: chunk_scan_cp(**dis), ["disagree"]))
    # global seq_idx going down across a slice edge
    dec = dict(mine, chunk_size=Q)
    dec["seq_idx"] = torch.full_like(mine["seq_idx"], 100 - rank)
    out.append(_expect_value_error(lambda: chunk_scan_cp(**dec), ["non-decreasing"]))
    out.append(_expect_value_error(
        lambda: chunk_scan_cp(**dict(mine, chunk_size=Q), group=dist.group.WORLD,
                              cu_seqlens=torch.tensor([0, 10])), ["cu_seqlens"]))
    return out


def worker(rank, world, port, outdir):
    # a timeout turns a rank left waiting in a collective (a backward some rank skipped)
    # into an error instead of a hang
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.set_num_threads(1)
        results = {}
        for name, lengths in CASES[world]:
            results[(name, lengths)] = run_rank(name, lengths, rank)
        results["errors"] = errors_on_rank(rank, world)
        dist.barrier()
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
