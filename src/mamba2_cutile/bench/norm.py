"""GPU micro-benchmark of the gated RMSNorm: forward, backward alone and forward + backward,
each captured in a CUDA graph and replayed after warm-up with L2 flushed between replays
(`bench.timing.time_graph`), beside mamba_ssm's Triton `rmsnorm_fn` when it is importable.

Bandwidth counts the bytes any implementation must move: the forward reads x, z, weight (and
bias) and writes out and rstd (4 bytes per row and group); the backward reads x, z, dout, rstd
and weight and writes dx, dz, dweight (and dbias); forward + backward is the sum (the backward
must read x and z again). Fractions are of 4.3 TB/s (`bench.roofline.HBM_BYTES_PER_S`).

    python -m mamba2_cutile.bench.norm                      # the default shapes, bf16, z gate
    python -m mamba2_cutile.bench.norm --shapes targets     # the real model widths
    python -m mamba2_cutile.bench.norm --sweep --reps 10    # candidates beside today's rule
    python -m mamba2_cutile.bench.norm --sweep --space full # every sweep_space override
    python -m mamba2_cutile.bench.norm --sweep --sweep-shapes 16384x1536x1,16384x8192x8
    python -m mamba2_cutile.bench.norm --sweep --configs "fwd:warps=8;bwd:bwd_block_m=1,bwd_warps=8"
    python -m mamba2_cutile.bench.norm --sweep --gate-first     # mamba_ssm Mamba2's gate order
    python -m mamba2_cutile.bench.norm --json out.json --gate-first --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import torch

from .roofline import HBM_BYTES_PER_S

#: (tokens, hidden, ngroups): the Mamba-2 layer sizes, 1 and 8 groups, 16K and 64K tokens, and
#: 4K tokens at 4096
DEFAULT_SHAPES = [(t, h, g) for t in (16384, 65536)
                  for h in (1536, 2560, 3072, 4096, 5120, 8192) for g in (1, 8)] + [
                  (4096, 4096, 1), (4096, 4096, 8)]
QUICK_SHAPES = [(16384, 1536, 1), (16384, 8192, 8), (65536, 4096, 1)]
#: the real Mamba-2 / hybrid widths from 16K tokens: d_inner 1536 (also 64K tokens), 2048,
#: 2560, 3072, 4096, 5120 in one group, 8192 in eight, and the whole-d_inner groups of 7680
#: and 10240
TARGET_SHAPES = [(16384, 1536, 1), (65536, 1536, 1), (16384, 2048, 1), (16384, 2560, 1),
                 (16384, 3072, 1), (16384, 4096, 1), (16384, 5120, 1), (16384, 8192, 8),
                 (16384, 7680, 1), (16384, 10240, 1)]
#: the candidate sweep's shapes: one group of 1536 = 3 * 512, 2560 = 5 * 512, 3072 = 3 * 1024,
#: 5120 = 5 * 1024, eight groups of 1024 (8192 channels), one of 2048
CANDIDATE_SHAPES = [(16384, 1536, 1), (16384, 2560, 1), (16384, 3072, 1), (16384, 5120, 1),
                    (16384, 8192, 8), (16384, 2048, 1)]
#: the full sweep's shapes (the padded kernels' timing of today's rule)
FULL_SWEEP_SHAPES = [(16384, 4096, 1), (16384, 4096, 8)]
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
               baseline=True, on_row=None):
    """Rows of {shape, impl, mode, ms, GB/s, fraction of 4.3 TB/s} for ours (fwd, bwd, fwdbwd)
    and mamba_ssm's Triton rmsnorm_fn (fwd, fwdbwd) when importable; each result is checked
    against the other implementation before timing (max relative difference logged).
    `on_row`: called with each row once its shape is done."""
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
        outs, first = {}, len(rows)
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
        if on_row is not None:
            for r in rows[first:]:
                on_row(r)
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


_FWD_FIELDS = ("block_m", "occupancy", "warps", "tma", "chunk", "fwd_ctas_per_sm")
_BWD_FIELDS = ("bwd_block_m", "bwd_ctas_per_sm", "bwd_occupancy", "bwd_warps", "bwd_tma",
               "chunk")


def candidate_space(group_size, gate_first=False):
    """(forward, backward) overrides of the candidate sweep at one group size: the padded
    kernels under their rule (`padded_shape_config`, as before the chunked kernels), the
    dispatcher's rule ({}), and steps away from it: rows per tile halved and doubled; a
    higher occupancy (the 2026-12-01 sweep found lower ones slower at every tile: forward
    occupancy 2 against 4, backward 1 against 2), the backward's also at twice the rule's on
    half the rows (sm_90 compiles: the chunked backward at occupancy 3 is spill-free at 1536
    channels and spills 32-328 bytes from 2560 with the gate first or a bias); the other warp
    count (not TMA off: 1.6-1.9x slower at 4096 channels on 2026-12-01); chunks half as wide
    (a power-of-two group in two chunks); the forward with twice the rows at half the
    occupancy, and persistent (fwd_ctas_per_sm = the occupancy: one wave of programs; a
    power-of-two group as one chunk, also not persistent). Each override names
    the pass's fields it changes; the chunk field reaches both passes."""
    from ..norm.plan import (MAX_CHUNK, MAX_CHUNKS, MIN_CHUNK, norm_shape_config,
                             padded_shape_config)

    rule, padded = norm_shape_config(group_size, gate_first), padded_shape_config(group_size)

    def diff(cfg, names):
        return {k: getattr(cfg, k) for k in names if getattr(cfg, k) != getattr(rule, k)}

    def step(names, **over):
        cand = replace(rule, **over)
        return diff(cand, names)

    fwd = [diff(padded, _FWD_FIELDS), {}]
    bwd = [diff(padded, _BWD_FIELDS), {}]
    fwd += [step(_FWD_FIELDS, block_m=max(1, rule.block_m // 2)),
            step(_FWD_FIELDS, block_m=min(256, rule.block_m * 2)),
            step(_FWD_FIELDS, occupancy=rule.occupancy + 2),
            step(_FWD_FIELDS, warps=4 if rule.warps == 8 else 8),
            # twice the rows with the registers of half the CTAs (at occupancy 4 the
            # doubled tiles spill: 40-128 bytes per thread at 1536 and 2560 channels)
            step(_FWD_FIELDS, block_m=min(256, rule.block_m * 2),
                 occupancy=max(1, rule.occupancy // 2))]
    bwd += [step(_BWD_FIELDS, bwd_block_m=max(1, rule.bwd_block_m // 2)),
            step(_BWD_FIELDS, bwd_block_m=min(256, rule.bwd_block_m * 2)),
            step(_BWD_FIELDS, bwd_ctas_per_sm=4 if rule.bwd_ctas_per_sm == 2 else 2),
            step(_BWD_FIELDS, bwd_occupancy=rule.bwd_occupancy + 1),
            # twice the programs per SM on half the rows (spill-free at 1536 channels)
            step(_BWD_FIELDS, bwd_block_m=max(1, rule.bwd_block_m // 2),
                 bwd_occupancy=2 * rule.bwd_occupancy),
            step(_BWD_FIELDS, bwd_warps=4 if rule.bwd_warps == 8 else 8)]
    # the persistent chunked forward, as many programs per SM as the occupancy lets reside
    pow2 = group_size & (group_size - 1) == 0
    whole = rule.chunk or (group_size if pow2 and MIN_CHUNK <= group_size <= MAX_CHUNK else 0)
    if whole:
        occ = rule.occupancy or 2
        fwd.append(step(_FWD_FIELDS, chunk=whole, fwd_ctas_per_sm=occ))
    if whole and not rule.chunk:
        # the chunked forward's single chunk (x held in its dtype, z read late) vs the padded
        fwd.append(step(_FWD_FIELDS, chunk=whole))
    # chunks half as wide (twice as many); a power-of-two group in two chunks
    half_chunk = (rule.chunk or (group_size if pow2 else 0)) // 2
    if half_chunk >= MIN_CHUNK and half_chunk <= MAX_CHUNK \
            and group_size // half_chunk <= MAX_CHUNKS:
        fwd.append(step(_FWD_FIELDS, chunk=half_chunk))
        bwd.append(step(_BWD_FIELDS, chunk=half_chunk))
    out = []
    for space in (fwd, bwd):
        seen, uniq = set(), []
        for over in space:
            key = tuple(sorted(over.items()))
            if key not in seen:
                seen.add(key)
                uniq.append(over)
        out.append(uniq)
    return tuple(out)


def parse_configs(text):
    """"fwd:warps=8,occupancy=4;bwd:bwd_block_m=1;..." -> (forward, backward) override lists,
    each led by the rule itself ({}); unknown NormConfig fields are refused here."""
    from .. import config as _config
    from ..norm.plan import NormConfig
    fwd, bwd = _config.split_passes(text, "--configs")
    return tuple([{}] + [_config.parse_overrides(NormConfig, spec, "--configs") for spec in specs]
                 for specs in (fwd, bwd))


def _space(space, group_size, gate_first=False):
    from ..norm.plan import norm_shape_config
    if isinstance(space, tuple):          # explicit (forward, backward) override lists
        return space
    if space == "full":
        return sweep_space(norm_shape_config(group_size, gate_first))
    return candidate_space(group_size, gate_first)


def _env_spec(over):
    # "default" (no override) where the candidate is the rule itself
    return ",".join(f"{k}={v}" for k, v in over.items()) or "default"


def _sweep_call(kind, x, z, w, dout, gs, nbg=True):
    from ..norm import rmsnorm_fn
    if kind == "fwd":
        return lambda: rmsnorm_fn(x, w, None, z=z, group_size=gs, norm_before_gate=nbg)
    return _ours_bwd(x, z, w, dout, gs, nbg)


def _warm(task):
    """Runs one sweep candidate once in this (worker) process, so that its kernels are compiled
    into the on-disk cuTile cache before the timing process launches them."""
    from ..norm.plan import ENV_NORM
    tokens, hidden, ngroups, kind, over, dtype, nbg = task
    os.environ[ENV_NORM] = _env_spec(over)
    try:
        x, z, w, dout = make_inputs(tokens, hidden, dtype)
        _sweep_call(kind, x, z, w, dout, hidden // ngroups, nbg)()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the timing process reports it for this candidate
        return f"{task[:5]}: {e!r}"[:300]
    return None


def warm_compile(tasks, jobs):
    """Compiles the sweep's candidates in `jobs` spawned processes (compiling is serial within
    one process and takes seconds per kernel; the timing process then finds them cached)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    pool = cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"))
    try:
        for fut in cf.as_completed([pool.submit(_warm, t) for t in tasks]):
            if fut.result():
                print("compile failed:", fut.result(), flush=True)
    except BaseException:
        # an interrupt (a time limit's SIGINT reaches this process only) must not wait for
        # every queued compile, as leaving the `with` block would
        workers = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            w.terminate()
        raise
    pool.shutdown()


def sweep_norm(shapes=None, dtype=torch.bfloat16, reps=30, space="candidates", jobs=0,
               norm_before_gate=True, on_row=None):
    """Times the forward and the backward under each override of the sweep space ("candidates":
    `candidate_space`, at CANDIDATE_SHAPES by default; "full": `sweep_space` around the rule,
    at FULL_SWEEP_SHAPES) through MAMBA2_CUTILE_NORM_CONFIG, checks each result against the
    rule's, and returns rows {shape, pass, overrides, ms, GB/s}. `jobs` > 1 compiles the
    candidates first in that many processes. `norm_before_gate`: the gate order timed (its
    rule is the candidates' base: the gate-first order has its own hints). `on_row`: called
    with each row as it is timed."""
    from ..norm.plan import ENV_NORM
    from .accuracy import rel_err
    from .timing import time_graph

    if shapes is None:
        shapes = CANDIDATE_SHAPES if space == "candidates" else FULL_SWEEP_SHAPES
    elem = torch.empty((), dtype=dtype).element_size()
    nbg, gf = bool(norm_before_gate), not norm_before_gate
    saved = os.environ.get(ENV_NORM)
    rows = []
    try:
        if jobs > 1:
            warm_compile([(t, h, g, kind, over, dtype, nbg) for t, h, g in shapes
                          for kind, sp in zip(("fwd", "bwd"), _space(space, h // g, gf))
                          for over in sp], jobs)
        for tokens, hidden, ngroups in shapes:
            gs = hidden // ngroups
            x, z, w, dout = make_inputs(tokens, hidden, dtype)
            fwd_b, bwd_b = norm_bytes(tokens, hidden, ngroups, elem)
            os.environ.pop(ENV_NORM, None)
            want = _sweep_call("fwd", x, z, w, dout, gs, nbg)()
            want_bwd = _sweep_call("bwd", x, z, w, dout, gs, nbg)()
            fwd_space, bwd_space = _space(space, gs, gf)
            for kind, sp, nbytes in (("fwd", fwd_space, fwd_b), ("bwd", bwd_space, bwd_b)):
                for over in sp:
                    os.environ[ENV_NORM] = _env_spec(over)
                    row = dict(tokens=tokens, hidden=hidden, ngroups=ngroups, kind=kind,
                               overrides=over, norm_before_gate=nbg)
                    try:
                        call = _sweep_call(kind, x, z, w, dout, gs, nbg)
                        if kind == "fwd":
                            err = rel_err(call(), want)
                        else:
                            err = max(rel_err(a, b) for a, b in zip(call(), want_bwd)
                                      if a.numel())
                        ms = time_graph(call, reps=reps)["median_ms"]
                    except Exception as e:  # noqa: BLE001 - one failed candidate, not the sweep
                        row = dict(row, ms=float("inf"), gb_s=0.0, frac_hbm=0.0,
                                   rel_err_vs_rule=float("nan"), error=repr(e)[:300])
                    else:
                        row = dict(row, ms=ms, gb_s=nbytes / (ms * 1e-3) / 1e9,
                                   frac_hbm=nbytes / (ms * 1e-3) / HBM_BYTES_PER_S,
                                   rel_err_vs_rule=err)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
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
            if "error" in r:
                lines.append(f"{shape}  {r['kind']}  {r['overrides']}  failed: {r['error']}")
                continue
            frac = f"  {100 * r['frac_hbm']:5.1f}%" if "frac_hbm" in r else ""
            lines.append(f"{shape}  {r['kind']}  {r['overrides']}  {r['ms'] * 1e3:9.1f} us  "
                         f"{r['gb_s']:7.0f} GB/s{frac}  err vs rule "
                         f"{r['rel_err_vs_rule']:.1e}")
    return "\n".join(lines)


def best_of_sweep(rows):
    best = {}
    for r in rows:
        key = (r["tokens"], r["hidden"], r["ngroups"], r["kind"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return list(best.values())


def _parse_shapes(text):
    """"16384x1536x1,16384x8192x8" -> [(16384, 1536, 1), (16384, 8192, 8)]."""
    try:
        shapes = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        shapes = []
    if not shapes or any(len(sh) != 3 or min(sh) < 1 or sh[1] % sh[2] for sh in shapes):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected TOKENSxHIDDENxGROUPS,... with GROUPS dividing HIDDEN")
    return shapes


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mamba2_cutile.bench.norm",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", choices=("default", "quick", "targets"), default="default")
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16")
    ap.add_argument("--no-z", action="store_true", help="plain RMSNorm (no gate)")
    ap.add_argument("--gate-first", action="store_true",
                    help="norm_before_gate=False (with --sweep: around that order's rule)")
    ap.add_argument("--no-baseline", action="store_true", help="skip mamba_ssm")
    ap.add_argument("--sweep", action="store_true",
                    help="time config candidates (--space) beside the rule")
    ap.add_argument("--space", choices=("candidates", "full"), default="candidates",
                    help="candidates: candidate_space at CANDIDATE_SHAPES; full: sweep_space "
                         "at FULL_SWEEP_SHAPES")
    ap.add_argument("--sweep-shapes", type=_parse_shapes, default=None,
                    metavar="TOKENSxHIDDENxGROUPS,...",
                    help="the sweep's shapes, e.g. 16384x1536x1,16384x8192x8 (default: the "
                         "space's shapes)")
    ap.add_argument("--configs", default=None, metavar='"fwd:warps=8;bwd:bwd_block_m=1"',
                    help="sweep these overrides of the rule (beside the rule itself) instead "
                         "of --space")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes compiling the sweep's kernels before timing (1: none)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--jsonl", action="store_true",
                    help="print each row as a JSON line as it is timed")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the gated-norm benchmark needs a CUDA GPU")
    dtype = _DTYPES[args.dtype]
    if args.sweep:
        space = parse_configs(args.configs) if args.configs else args.space
        rows = sweep_norm(args.sweep_shapes or (CANDIDATE_SHAPES if args.configs else None),
                          dtype=dtype, reps=args.reps, space=space, jobs=args.jobs,
                          norm_before_gate=not args.gate_first,
                          on_row=(lambda r: print(json.dumps(r), flush=True))
                          if args.jsonl else None)
        print(format_rows(rows))
        print("fastest:")
        print(format_rows(best_of_sweep(rows)))
    else:
        shapes = {"default": DEFAULT_SHAPES, "quick": QUICK_SHAPES,
                  "targets": TARGET_SHAPES}[args.shapes]
        rows = bench_norm(shapes, dtype, has_z=not args.no_z,
                          norm_before_gate=not args.gate_first, reps=args.reps,
                          baseline=not args.no_baseline,
                          on_row=(lambda r: print(json.dumps(r), flush=True))
                          if args.jsonl else None)
        print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
