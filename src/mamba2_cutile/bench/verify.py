"""`mamba2-cutile verify`: a correctness matrix of the forward against the float64 recurrence.

Each case runs `mamba_chunk_scan_combined` on the GPU (or, with `--cpu`, the PyTorch path)
and `reference.ssd_recurrence` in float64 on the same device, and compares the output, the
final state and (varlen cases) the varlen states: max|err| / max|ref| must be at most
`bench.accuracy.FORWARD_TOL` of the input dtype (2e-2 for bf16, 2e-3 for fp16 and fp32).
Exit code 1 if any case fails.

Cases (`CASES`): every option alone and all together, each input dtype, partial last chunks
(T not a multiple of the chunk, T = 1), headdim/dstate not powers of two at every chunk size,
varlen states, float32 chunk states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..runtime import dtype_tag
from . import problems
from .accuracy import FORWARD_TOL as TOL, rel_err

#: option names a Case may carry
OPTIONS = ("D_head", "D_chan", "z", "dt_bias", "dt_limit", "init", "seq_idx", "varlen",
           "state_fp32")
ALL = ("D_chan", "z", "dt_bias", "dt_limit", "init", "seq_idx")


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seqlen: int
    nheads: int
    ngroups: int
    headdim: int
    dstate: int
    chunk: int
    dtype: torch.dtype = torch.bfloat16
    opts: tuple = ()

    def describe(self):
        dt = dtype_tag(self.dtype)
        return (f"B={self.batch} T={self.seqlen} H={self.nheads} G={self.ngroups} "
                f"P={self.headdim} N={self.dstate} Q={self.chunk} {dt} "
                f"{'+'.join(self.opts) or 'no options'}")


def _cases():
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    base = (2, 300, 4, 2, 64, 64, 128)
    out = []
    for opt in ("none",) + ALL + ("D_head",):
        out.append(Case(f"opt-{opt}", *base, bf, () if opt == "none" else (opt,)))
    for dt, tag in ((f16, "fp16"), (f32, "fp32")):
        out.append(Case(f"dtype-{tag}-none", *base, dt, ()))
    for dt, tag in ((bf, "bf16"), (f16, "fp16"), (f32, "fp32")):
        out.append(Case(f"all-{tag}", *base, dt, ALL))
    for l in (1, 17, 64, 65, 255):
        out.append(Case(f"partial-T{l}-Q256", 2, l, 4, 1, 32, 64, 256, bf, ("D_head", "init")))
    out.append(Case("partial-T300-Q64-all", 2, 300, 4, 2, 64, 64, 64, bf, ALL))
    shapes = [(2, 333, 6, 3, 80, 96), (1, 200, 4, 2, 40, 24), (1, 77, 2, 1, 256, 32),
              (3, 129, 4, 4, 16, 16), (1, 515, 2, 1, 128, 256), (1, 1000, 8, 1, 64, 128)]
    chunks = (64, 128, 256)
    for i, s in enumerate(shapes):
        q = chunks[i % 3]
        out.append(Case(f"shape-{'x'.join(map(str, s))}-Q{q}", *s, q, bf, ALL))
    out.append(Case("shape-2x333x6x3x80x96-Q256-fp32", 2, 333, 6, 3, 80, 96, 256, f32, ALL))
    out.append(Case("varlen-states", 1, 624, 4, 2, 48, 80, 128, bf, ("D_head", "z", "varlen")))
    out.append(Case("varlen-states-init", 1, 624, 4, 2, 48, 80, 128, bf,
                    ("D_head", "z", "init", "varlen")))
    out.append(Case("state-fp32-all", 2, 700, 4, 1, 64, 128, 256, bf, ALL + ("state_fp32",)))
    return out


CASES = _cases()
VARLEN_LENS = (100, 28, 1, 300, 128, 67)


def make_problem(case: Case, device="cuda", seed=0):
    """(inputs, keyword options, cu_seqlens or None) of a case, in realistic Mamba-2 ranges:
    A in [-16, -1], dt in [1e-3, 1e-1]."""
    b, l, h, g, p, n = (case.batch, case.seqlen, case.nheads, case.ngroups, case.headdim,
                        case.dstate)
    o = set(case.opts)
    inp, kw = problems.random_problem(
        b, l, h, g, p, n, case.dtype, D="hp" if "D_chan" in o else "h" if "D_head" in o else None,
        z="z" in o, dt_bias="dt_bias" in o, dt_limit=(0.004, 0.05) if "dt_limit" in o else None,
        init="init" in o,
        seq_cuts=problems.default_seq_cuts(l) if "seq_idx" in o and "varlen" not in o else None,
        device=device, seed=seed)
    cu = None
    if "varlen" in o:
        if b != 1 or sum(VARLEN_LENS) != l:
            raise ValueError(f"{case.name}: varlen cases need batch 1 and T={sum(VARLEN_LENS)}")
        lens = torch.tensor(VARLEN_LENS)
        cu = torch.tensor([0] + lens.cumsum(0).tolist(), dtype=torch.int32, device=device)
        kw["seq_idx"] = torch.repeat_interleave(
            torch.arange(len(VARLEN_LENS), dtype=torch.int32), lens).to(device)[None]
    return inp, kw, cu


def run_case(case: Case, device="cuda"):
    """{"case", "describe", "errors": {out, final[, varlen]}, "tol", "passed", "error",
    "seconds"} of one case."""
    from .. import mamba_chunk_scan_combined, reference

    t0 = time.perf_counter()
    res = {"case": case.name, "describe": case.describe(), "tol": TOL[case.dtype],
           "errors": {}, "passed": False, "error": None}
    try:
        inp, kw, cu = make_problem(case, device)
        state_dtype = torch.float32 if "state_fp32" in case.opts else None
        got = mamba_chunk_scan_combined(**inp, chunk_size=case.chunk, return_final_states=True,
                                        cu_seqlens=cu, return_varlen_states=cu is not None,
                                        state_dtype=state_dtype, **kw)
        y_ref, h_ref, v_ref = reference.ssd_recurrence(**inp, cu_seqlens=cu, **kw)
        y, h = got[0], got[1]
        errs = {"out": rel_err(y, y_ref), "final": rel_err(h, h_ref)}
        if cu is not None:
            errs["varlen"] = rel_err(got[2], v_ref)
        shape_ok = (y.shape == inp["x"].shape and y.dtype == inp["x"].dtype
                    and h.dtype == torch.float32)
        finite = bool(torch.isfinite(y).all()) and bool(torch.isfinite(h).all())
        res["errors"] = errs
        res["passed"] = shape_ok and finite and all(e <= res["tol"] for e in errs.values())
        if not shape_ok:
            res["error"] = f"wrong output shape/dtype: {tuple(y.shape)} {y.dtype}, {h.dtype}"
        elif not finite:
            res["error"] = "non-finite output"
    except Exception as e:  # noqa: BLE001 - a crash is a failed case, not a crashed matrix
        res["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    res["seconds"] = time.perf_counter() - t0
    return res


def select(match=None):
    if not match:
        return list(CASES)
    from .problems import compile_match
    rx = compile_match(match)
    return [c for c in CASES if rx.search(c.name)]


def run(cases=None, device="cuda", progress=None):
    results = []
    for case in cases if cases is not None else CASES:
        if progress:
            progress(case)
        results.append(run_case(case, device))
    return results


def format_results(results):
    """Plain-text lines, one per case, and a summary line."""
    lines = []
    w = max((len(r["case"]) for r in results), default=4)
    for r in results:
        errs = ", ".join(f"{k} {v:.2e}" for k, v in r["errors"].items())
        mark = "PASS" if r["passed"] else "FAIL"
        extra = f"  [{r['error']}]" if r["error"] else ""
        lines.append(f"{mark}  {r['case']:<{w}}  {errs or '-':<48} tol {r['tol']:.0e}  "
                     f"({r['describe']}){extra}")
    n_fail = sum(not r["passed"] for r in results)
    lines.append(f"{len(results) - n_fail}/{len(results)} passed"
                 + (f", {n_fail} FAILED" if n_fail else ""))
    return lines


def render(results, console=None):
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title="mamba2-cutile verify: max|err| / max|ref| against the float64 recurrence")
    for c in ("result", "case", "out", "final", "varlen", "tol", "problem", "note"):
        t.add_column(c, overflow="fold")
    for r in results:
        e = r["errors"]
        fmt = lambda k: f"{e[k]:.2e}" if k in e else ""  # noqa: E731
        t.add_row("[green]PASS[/]" if r["passed"] else "[bold red]FAIL[/]", r["case"],
                  fmt("out"), fmt("final"), fmt("varlen"), f"{r['tol']:.0e}", r["describe"],
                  r["error"] or "")
    console.print(t)
    console.print(format_results(results)[-1], highlight=False)


def exit_code(results) -> int:
    return 0 if results and all(r["passed"] for r in results) else 1
