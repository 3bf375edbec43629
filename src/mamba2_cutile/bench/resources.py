"""`mamba2-cutile resources`: per-kernel resources of a problem's launches from a CPU compile for
sm_90: registers per thread, spill stack bytes per thread, static shared memory, threads per CTA,
and the CTAs per SM those allow (H100/H200: 64K registers, 227 KB shared memory per SM). Use it
to see why a config is slow before spending GPU time. Needs pyelftools (the `dev` extra), which
reads the cubin's ELF sections."""

from __future__ import annotations

import io
import struct

REGCOUNT, FRAME_SIZE, MIN_STACK, REQNTID = 0x2F, 0x11, 0x12, 0x10
SMEM_PER_SM, REGS_PER_SM = 227 * 1024, 65536


def _attrs(data):
    """(attribute, payload) of an .nv.info section."""
    i = 0
    while i + 4 <= len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == 4:            # a sized value
            size = struct.unpack_from("<H", data, i + 2)[0]
            yield attr, data[i + 4:i + 4 + size]
            i += 4 + size
        else:                   # a 2-byte value inline
            yield attr, data[i + 2:i + 4]
            i += 4


def resources(cubin: bytes) -> dict:
    """regs, stack (spill bytes per thread), smem (bytes), threads and ctas_per_sm of a cubin."""
    from elftools.elf.elffile import ELFFile

    elf = ELFFile(io.BytesIO(cubin))
    out = {"regs": None, "stack": 0, "smem": 0, "threads": None}
    for sec in elf.iter_sections():
        if sec.name == ".nv.info":
            for attr, val in _attrs(sec.data()):
                if attr == REGCOUNT:
                    out["regs"] = struct.unpack_from("<I", val, 4)[0]
                elif attr in (FRAME_SIZE, MIN_STACK):
                    out["stack"] = max(out["stack"], struct.unpack_from("<I", val, 4)[0])
        elif sec.name.startswith(".nv.info."):
            for attr, val in _attrs(sec.data()):
                if attr == REQNTID and len(val) >= 12:
                    out["threads"] = struct.unpack_from("<III", val)[0]
        elif sec.name.startswith(".nv.shared.") and not sec.name.endswith("reserved.0"):
            out["smem"] += sec["sh_size"]
    ctas = []
    if out["smem"]:
        ctas.append(SMEM_PER_SM // out["smem"])
    if out["regs"] and out["threads"]:
        ctas.append(REGS_PER_SM // (out["regs"] * out["threads"]))
    out["ctas_per_sm"] = min(ctas) if ctas else None
    return out


def compile_resources(call, gpu_code: str = "sm_90") -> dict:
    """Resources of one planned launch, compiled on the CPU."""
    from .compile import compile_cubin
    return resources(compile_cubin(call, gpu_code))


def check_problem(family: str, problem):
    """A `resources` problem is a JSON object of its plan builder's keyword arguments: refuse
    anything else by name, with the keys it takes."""
    import inspect

    from . import plans
    if family not in ("forward", "backward", "decode"):
        raise ValueError(f"family must be forward, backward or decode, got {family!r}")
    if not isinstance(problem, dict):
        raise ValueError(f"the problem must be a JSON object of keyword arguments, got "
                         f"{type(problem).__name__}")
    builder = getattr(plans, f"{family}_problem_plan")
    params = {k: p.default for k, p in inspect.signature(builder).parameters.items()
              if k not in ("device", "config", "overrides")}
    unknown = sorted(set(problem) - set(params))
    if unknown:
        raise ValueError(f"unknown {family} problem key(s) {', '.join(map(repr, unknown))}; "
                         f"it takes {', '.join(params)}")
    for k, v in problem.items():
        default = params[k]
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise ValueError(f"problem key {k!r} must be true or false, got {v!r}")
        elif isinstance(default, int) and (not isinstance(v, int) or isinstance(v, bool)
                                           or v < 1):
            raise ValueError(f"problem key {k!r} must be a positive integer, got {v!r}")


def problem_calls(family: str, problem: dict, overrides: dict):
    """The launches of `family` ("forward", "backward", "decode") at a problem (the keyword
    arguments of `bench.plans`'s builders) with config `overrides`."""
    from dataclasses import replace

    from . import plans, problems
    problem = {k: problems.parse_dtype(v) if k.endswith("dtype") and isinstance(v, str) else v
               for k, v in problem.items()}
    if family == "forward":
        return plans.forward_problem_plan(**problem, overrides=overrides)
    if family == "backward":
        return plans.backward_problem_plan(**problem, overrides=overrides)
    if family == "decode":
        from ..decode import decode_config
        p = dict(problem)
        cfg = decode_config(p.get("batch", 4), p.get("nheads", 128), p.get("headdim", 64),
                            p.get("dstate", 128))
        return plans.decode_problem_plan(**p, config=replace(cfg, **overrides))
    raise ValueError(f"family must be forward, backward or decode, got {family!r}")


def kernel_name(call) -> str:
    return call.kernel._annotated_function.pyfunc.__name__.removesuffix("_fn")
