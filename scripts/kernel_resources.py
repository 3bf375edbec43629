"""Per-kernel resources of the forward/decode/backward launches, from a CPU compile for sm_90:
registers per thread, spill stack bytes per thread, static shared memory, threads per CTA, and
the CTAs per SM those allow (H100/H200: 64K registers, 227 KB shared memory per SM).

    python scripts/kernel_resources.py [forward|backward|decode] [problem JSON] [override ...]

e.g.  python scripts/kernel_resources.py forward '{"chunk_size": 256, "nheads": 80}' \
          scan_block_n=64 "scan_block_q=64,scan_occupancy=2"

Needs pyelftools (pip install pyelftools), which reads the cubin's ELF sections.
"""
import io
import json
import struct
import sys

from elftools.elf.elffile import ELFFile
from cuda.tile.compilation import export_kernel

from mamba2_cutile import backward, compile_check, decode, launch

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


def compile_resources(call) -> dict:
    buf = io.BytesIO()
    export_kernel(call.kernel, [compile_check.signature_of(call.kernel, call.args)], buf,
                  gpu_code="sm_90", output_format="cubin")
    return resources(buf.getvalue())


def overrides_of(spec):
    if spec in ("", "default"):
        return {}
    return {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}


def main(argv):
    family = argv[0] if argv else "forward"
    problem = json.loads(argv[1]) if len(argv) > 1 else {}
    specs = argv[2:] or ["default"]
    for spec in specs:
        over = overrides_of(spec)
        if family == "forward":
            calls = launch.plan_for_problem(**problem, overrides=over)
        elif family == "backward":
            calls = backward.backward_plan_for_problem(**problem, overrides=over)
        else:
            from dataclasses import replace
            p = dict(problem)
            cfg = decode.default_decode_config(p.get("batch", 4), p.get("nheads", 128),
                                               p.get("headdim", 64), p.get("dstate", 128))
            calls = decode.plan_for_problem(**p, config=replace(cfg, **over))
        for call in calls:
            name = call.kernel._annotated_function.pyfunc.__name__.removesuffix("_fn")
            r = compile_resources(call)
            print(f"{spec:40s} {name:18s} regs {r['regs']!s:>4} stack {r['stack']:>5} B "
                  f"smem {r['smem'] / 1024:6.1f} KB threads {r['threads']!s:>4} "
                  f"-> {r['ctas_per_sm']} CTA/SM", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
