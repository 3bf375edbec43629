"""GPU micro-benchmark of the gated RMSNorm: forward, backward alone and forward + backward,
each captured in a CUDA graph and replayed after warm-up with L2 flushed between replays
(`bench.timing.time_graph`), beside mamba_ssm's Triton `rmsnorm_fn` when it is importable.

Bandwidth counts the bytes any implementation must move: the forward reads x, z, weight (and
bias) and writes out and rstd (4 bytes per row and group); the backward reads x, z, dout, rstd
and weight and writes dx, dz, dweight (and dbias); forward + backward is the sum (the backward
must read x and z again). Fractions are of 4.3 TB/s (`bench.roofline.HBM_BYTES_PER_S`).

    python -m mamba2_cutile.bench.norm                      # the default shapes, bf16, z gate
    python -m mamba2_cutile.bench.norm --sweep              # a few configs at two shapes
    python -m mamba2_cutile.bench.norm --json out.json --gate-first --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from .roofline import HBM_BYTES_PER_S

#: (tokens, hidden, ngroups): the Mamba-2 layer sizes, 1 and 8 groups, 4K to 64K tokens
DEFAULT_SHAPES = [(t, h, g) for t in (16384, 65536) for h in (1536, 2560, 4096, 5120, 8192)
                  for g in (1, 8)] + [(4096, 4096, 1), (4096, 4096, 8)]
QUICK_SHAPES = [(16384, 1536, 1), (16384, 8192, 8), (65536, 4096, 1)]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _mamba_rmsnorm():
    try:
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
        return rmsnorm_fn
    except Exception:  # noqa: BLE001
        return None


def norm_bytes(tokens, hidden, ngroups, elem=2, has_z=True, param_elem=4, bias=False):
    """(forward, backward) bytes that must move, as in the module docstring."""
    rows = tokens * hidden * elem
    params = hidden * param_elem * (1 + bias)
    rstd = tokens * ngroups * 4
    fwd = rows * (2 + has_z) + params + rstd
    bwd = rows * (3 + 2 * has_z) + rstd + 2 * params
    return fwd, bwd


def make_inputs(tokens, hidden, dtype=torch.bfloat16, has_z=True, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    z = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype) if has_z else None
    w = 1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")
    dout = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    return x, z, w, dout


def _callables(fn, x, z, w, dout, gs, nbg):
    """(forward, forward + backward) of `fn` (rmsnorm_fn's signature) on these inputs."""
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    zs = None if z is None else z.detach().requires_grad_()
    leaves = tuple(t for t in (xs, ws, zs) if t is not None)

    def fwd():
        with torch.no_grad():
            return fn(x, w, None, z=z, eps=1e-5, group_size=gs, norm_before_gate=nbg)

    def fwdbwd():
        out = fn(xs, ws, None, z=zs, eps=1e-5, group_size=gs, norm_before_gate=nbg)
        return torch.autograd.grad(out, leaves, dout)
    return fwd, fwdbwd


def _ours_bwd(x, z, w, dout, gs, nbg):
    """The backward alone (the op the autograd calls), on a saved forward's rstd."""
    from ..norm import custom_ops  # noqa: F401 - registers the ops
    ops = torch.ops.mamba2_cutile
    _, rstd = ops.rmsnorm_gated_fwd(x, w, None, z, 1e-5, gs, nbg)
    return lambda: ops.rmsnorm_gated_bwd(dout, x, w, None, z, rstd, gs, nbg)


def bench_norm(shapes=None, dtype=torch.bfloat16, has_z=True, norm_before_gate=True, reps=50,
               baseline=True):
    """Rows of {shape, impl, mode, ms, GB/s, fraction of 4.3 TB/s} for ours (fwd, bwd, fwdbwd)
    and mamba_ssm's Triton rmsnorm_fn (fwd, fwdbwd) when importable; each result is checked
    against the other implementation before timing (max relative difference logged)."""
    from ..norm import rmsnorm_fn
    from .accuracy import rel_err
    from .timing import time_graph

    mamba = _mamba_rmsnorm() if baseline else None
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for tokens, hidden, ngroups in shapes or DEFAULT_SHAPES:
        gs = hidden // ngroups
        x, z, w, dout = make_inputs(tokens, hidden, dtype, has_z)
        fwd_b, bwd_b = norm_bytes(tokens, hidden, ngroups, elem, has_z)
        impls = [("mamba2-cutile", rmsnorm_fn)] + ([("mamba_ssm", mamba)] if mamba else [])
        outs = {}
        for name, fn in impls:
            fwd, fwdbwd = _callables(fn, x, z, w, dout, gs, norm_before_gate)
            outs[name] = fwd()
            timed = [("fwd", fwd, fwd_b), ("fwdbwd", fwdbwd, fwd_b + bwd_b)]
            if name == "mamba2-cutile":
                timed.insert(1, ("bwd", _ours_bwd(x, z, w, dout, gs, norm_before_gate), bwd_b))
            for mode, call, nbytes in timed:
                ms = time_graph(call, reps=reps)["median_ms"]
                gbs = nbytes / (ms * 1e-3) / 1e9
                rows.append(dict(tokens=tokens, hidden=hidden, ngroups=ngroups,
                                 dtype=str(dtype).removeprefix("torch."), has_z=has_z,
                                 norm_before_gate=norm_before_gate, impl=name, mode=mode,
                                 ms=ms, gb_s=gbs, frac_hbm=gbs * 1e9 / HBM_BYTES_PER_S))
        if len(outs) == 2:
            diff = rel_err(outs["mamba2-cutile"], outs["mamba_ssm"])
            for r in rows[-5:]:
                r["rel_diff_vs_mamba_ssm"] = diff
    return rows


def sweep_space(rule):
    """(forward, backward) config overrides the sweep times, relative to the shape rule
    `rule`: forward row blocks and occupancy; backward row blocks, programs per SM and
    occupancy; each pass's rule without TMA."""
    half = lambda v: max(1, v // 2)  # noqa: E731
    fwd = [dict(block_m=bm, occupancy=occ) for bm in sorted({half(rule.block_m), rule.block_m,
                                                             min(256, rule.block_m * 2)})
           for occ in (0, 2, 4)]
    bwd = [dict(bwd_block_m=bm, bwd_ctas_per_sm=c, bwd_occupancy=occ)
           for bm in sorted({half(rule.bwd_block_m), rule.bwd_block_m,
                             min(256, rule.bwd_block_m * 2)})
           for c in (2, 4, 8) for occ in (1, 2)]
    # the rule's tiles with plain loads and stores instead of TMA
    fwd.append(dict(block_m=rule.block_m, occupancy=rule.occupancy, tma=0))
    bwd.append(dict(bwd_block_m=rule.bwd_block_m, bwd_occupancy=rule.bwd_occupancy, bwd_tma=0))
    return fwd, bwd


def sweep_norm(shapes=((16384, 4096, 1), (16384, 4096, 8)), dtype=torch.bfloat16, reps=30):
    """Times the forward and the backward under each override of `sweep_space` (through
    MAMBA2_CUTILE_NORM_CONFIG), checks each result against the rule's, and returns rows
    {shape, pass, overrides, ms, GB/s}; the fastest per shape and pass is printed."""
    from ..norm.plan import ENV_NORM, norm_shape_config
    from .accuracy import rel_err
    from .timing import time_graph
    from ..norm import rmsnorm_fn

    elem = torch.empty((), dtype=dtype).element_size()
    saved = os.environ.get(ENV_NORM)
    rows = []
    try:
        for tokens, hidden, ngroups in shapes:
            gs = hidden // ngroups
            x, z, w, dout = make_inputs(tokens, hidden, dtype)
            fwd_b, bwd_b = norm_bytes(tokens, hidden, ngroups, elem)
            os.environ.pop(ENV_NORM, None)
            want = rmsnorm_fn(x, w, None, z=z, group_size=gs)
            want_bwd = _ours_bwd(x, z, w, dout, gs, True)()
            fwd_space, bwd_space = sweep_space(norm_shape_config(gs))
            for kind, space, nbytes in (("fwd", fwd_space, fwd_b), ("bwd", bwd_space, bwd_b)):
                for over in space:
                    os.environ[ENV_NORM] = ",".join(f"{k}={v}" for k, v in over.items())
                    if kind == "fwd":
                        call = lambda: rmsnorm_fn(x, w, None, z=z, group_size=gs)  # noqa: E731
                        err = rel_err(call(), want)
                    else:
                        call = _ours_bwd(x, z, w, dout, gs, True)
                        err = max(rel_err(a, b) for a, b in zip(call(), want_bwd)
                                  if a.numel())
                    ms = time_graph(call, reps=reps)["median_ms"]
                    rows.append(dict(tokens=tokens, hidden=hidden, ngroups=ngroups,
                                     kind=kind, overrides=over, ms=ms,
                                     gb_s=nbytes / (ms * 1e-3) / 1e9, rel_err_vs_rule=err))
    finally:
        if saved is None:
            os.environ.pop(ENV_NORM, None)
        else:
            os.environ[ENV_NORM] = saved
    return rows


def format_rows(rows) -> str:
    lines = []
    for r in rows:
        shape = f"{r['tokens']:>6} x {r['hidden']:>5} g{r['ngroups']}"
        if "impl" in r:
            extra = f"  diff vs mamba_ssm {r['rel_diff_vs_mamba_ssm']:.1e}" \
                if "rel_diff_vs_mamba_ssm" in r else ""
            lines.append(f"{shape}  {r['impl']:<14} {r['mode']:<7} {r['ms'] * 1e3:9.1f} us  "
                         f"{r['gb_s']:7.0f} GB/s  {100 * r['frac_hbm']:5.1f}% of 4.3 TB/s{extra}")
        else:
            lines.append(f"{shape}  {r['kind']}  {r['overrides']}  {r['ms'] * 1e3:9.1f} us  "
                         f"{r['gb_s']:7.0f} GB/s  err vs rule {r['rel_err_vs_rule']:.1e}")
    return "\n".join(lines)


def best_of_sweep(rows):
    best = {}
    for r in rows:
        key = (r["tokens"], r["hidden"], r["ngroups"], r["kind"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return list(best.values())


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mamba2_cutile.bench.norm",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", choices=("default", "quick"), default="default")
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16")
    ap.add_argument("--no-z", action="store_true", help="plain RMSNorm (no gate)")
    ap.add_argument("--gate-first", action="store_true", help="norm_before_gate=False")
    ap.add_argument("--no-baseline", action="store_true", help="skip mamba_ssm")
    ap.add_argument("--sweep", action="store_true", help="time the configs of sweep_space")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    dtype = _DTYPES[args.dtype]
    if args.sweep:
        rows = sweep_norm(dtype=dtype, reps=args.reps)
        print(format_rows(rows))
        print("fastest:")
        print(format_rows(best_of_sweep(rows)))
    else:
        shapes = DEFAULT_SHAPES if args.shapes == "default" else QUICK_SHAPES
        rows = bench_norm(shapes, dtype, has_z=not args.no_z,
                          norm_before_gate=not args.gate_first, reps=args.reps,
                          baseline=not args.no_baseline)
        print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
