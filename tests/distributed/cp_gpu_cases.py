"""The GPU checks of context parallelism, shared by the one-GPU simulation tests and the NCCL
test (spawned processes, one GPU each): problems, the float64 references, the comparison.

References, from the same (rounded) inputs: `reference.ssd_chunked` in float64 for the outputs
and the state at every slice end (the scan of the prefix up to it), and
`reference.ssd_chunked_backward` in float64 for the gradients of
sum(out * dout) + sum(state at the last slice end * dfinal).
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from support.gpu import log_result, rel_err  # noqa: E402
from support.tolerances import forward_tol, grad_tol  # noqa: E402

from mamba2_cutile import reference  # noqa: E402
from mamba2_cutile.bench.problems import random_problem  # noqa: E402

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
PER_TOKEN = ("x", "dt", "B", "C", "z", "seq_idx")
F64 = torch.float64


def make_problem(b, l, h, g, p, n, dtype, opts, cuts=(), device="cuda", seed=0):
    """random_problem's realistic inputs (A in [-16, -1], dt' in [1e-3, 1e-1]) with every
    option key present; "slow": dt' 20x smaller (1e-3 on average), so that the carried state
    survives whole slices; `cuts`: seq_idx boundaries (every row but the last; put one at a
    slice edge to test the edge case). Also the cotangents dout, dfinal."""
    gen = torch.Generator(device=device).manual_seed(seed)
    inp, kw = random_problem(b, l, h, g, p, n, dtype, D=opts.get("D"), z=bool(opts.get("z")),
                             dt_bias=bool(opts.get("dt_bias")), dt_limit=opts.get("dt_limit"),
                             init=bool(opts.get("init")),
                             seq_cuts=cuts if opts.get("seq_idx") else None, device=device,
                             gen=gen)
    if opts.get("slow"):
        if kw.get("dt_softplus"):
            raise ValueError("slow is for problems without dt_bias")
        inp["dt"] = inp["dt"] / 20
    kw = {**dict(D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                 dt_softplus=False, dt_limit=(0.0, math.inf)), **kw}
    dout = torch.randn(b, l, h, p, generator=gen, device=device).to(dtype)
    dfinal = torch.randn(b, h, p, n, generator=gen, device=device)
    return {**inp, **kw}, dout, dfinal


def slice_of(args, lo, hi, first):
    """The arguments one rank passes: its slice of the per-token tensors, initial_states on
    the first rank only."""
    out = {k: (v[:, lo:hi] if k in PER_TOKEN and v is not None else v) for k, v in args.items()}
    if not first:
        out["initial_states"] = None
    return out


def _f64(args):
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in args.items()}


def reference_forward(args, lengths, Q):
    """float64: out of the whole sequence and the state at every slice end."""
    a = _f64(args)
    out, _, _ = reference.ssd_chunked(**a, chunk_size=Q, dtype=F64)
    finals, end = [], 0
    for k in lengths:
        end += k
        pre = slice_of(a, 0, end, True)
        _, fin, _ = reference.ssd_chunked(**pre, chunk_size=Q, dtype=F64)
        finals.append(fin)
    return out, finals


def reference_grads(args, Q, dout, dfinal):
    a = _f64(args)
    return reference.ssd_chunked_backward(**a, chunk_size=Q, dout=dout.double(),
                                          dfinal_states=dfinal.double(), dtype=F64)


def check_forward(out, finals, ref_out, ref_finals, dtype, label=""):
    """Failures (list of str) of out and the slice-end states against float64, logged."""
    tol = forward_tol(dtype)
    msgs, failures = [], []
    e = rel_err(out, ref_out)
    msgs.append(f"out {e:.2e}")
    if not e <= tol:
        failures.append(f"out {e:.2e} > {tol:.0e}")
    for r, (f, fr) in enumerate(zip(finals, ref_finals)):
        if f is None:
            continue
        assert f.dtype == torch.float32, f"state of slice {r}: dtype {f.dtype}"
        e = rel_err(f, fr)
        msgs.append(f"state{r} {e:.2e}")
        if not e <= tol:
            failures.append(f"state of slice {r} {e:.2e} > {tol:.0e}")
    line = f"{label} forward vs float64: " + ", ".join(msgs)
    print(line)
    log_result(line)
    return failures


def check_grads(got, ref, args, dtype, label=""):
    msgs, failures = [], []
    for k in NAMES:
        src = args.get(k)
        if ref[k] is None:
            assert got.get(k) is None, f"d{k} should be None"
            continue
        g = got[k]
        assert g is not None, f"d{k} missing"
        assert g.shape == src.shape and g.dtype == src.dtype, \
            f"d{k}: {g.shape} {g.dtype} vs input {src.shape} {src.dtype}"
        assert torch.isfinite(g).all(), f"d{k} has non-finite entries"
        tol = grad_tol(k, dtype, src.dtype)
        e = rel_err(g, ref[k])
        msgs.append(f"d{k} {e:.2e}")
        if not e <= tol:
            failures.append(f"d{k} {e:.2e} > {tol:.0e}")
    line = f"{label} grads vs float64: " + ", ".join(msgs)
    print(line)
    log_result(line)
    return failures


def leaves(args):
    return {k: (v.detach().clone().requires_grad_(True)
                if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in args.items()}
