"""Where bwd_chunk_dx's time goes: time copies of the kernel with one part cut out (the results
are wrong; only the time matters), at the seed problem, beside the unmodified kernel.
(results/2026-11-30-h200-backward-dx-ablation.jsonl came from an older version of the cuts,
against the da_mode 0 kernel of commit 9a48272.)

    python3 scripts/ablate_backward.py [MAMBA2_CUTILE_BWD_CONFIG]       (on the GPU machine)

Each variant's source is written to a temporary module (cuTile reads kernel source), compiled
with the same hints and launched with the plan's own arguments. One JSON line per variant.
"""
import importlib.util
import inspect
import json
import os
import sys
import tempfile

import cuda.tile as ct
import torch

from mamba2_cutile import backward, launch
from mamba2_cutile.bench import problems, timing
from mamba2_cutile.kernels import bwd_chunk_dx

if len(sys.argv) > 1:
    os.environ["MAMBA2_CUTILE_BWD_CONFIG"] = sys.argv[1]

SRC = inspect.getsource(bwd_chunk_dx)
CUTS = {
    "full": [],
    "no_da_store": [("        if DA_MODE != 2:\n            ct.store(da_part, index=(slot, batch, head, k),\n",
                     "        if DA_MODE == 3:\n            ct.store(da_part, index=(slot, batch, head, k),\n"),
                    ("    for k in range(t + 1, k_rest):\n", "    for k in range(t + 1, t + 1):\n")],
    "no_k_loop": [("    for k in range(first, k_end):\n", "    for k in range(first, first):\n")],
    "no_q_loop": [("    for q in range(t, end):\n", "    for q in range(t, t):\n")],
    "no_state_loads": [
        ("    h = load_state(states, batch, head, chunk, p_tile, 0, BLOCK_P, NP)\n",
         "    h = ct.full((BLOCK_P, NP), 0.5, dtype=ct.float32)\n"),
        ("    ds = load_state(dstates, batch, head, chunk, p_tile, 0, BLOCK_P, NP)\n",
         "    ds = ct.full((BLOCK_P, NP), 0.5, dtype=ct.float32)\n")],
    "no_state_mma": [
        ("    ch = ct.mma(ct_t, mma_operand(h.transpose(), mm),\n"
         "                ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32))\n",
         "    ch = ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32) + ct.sum(h)\n"),
        ("    bds = ct.mma(bt, mma_operand(ds.transpose(), mm),\n"
         "                 ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32))\n",
         "    bds = ct.full((BLOCK_Q, BLOCK_P), 0.0, dtype=ct.float32) + ct.sum(ds)\n")],
}


def variant(name, cuts):
    src = SRC
    for old, new in cuts:
        assert old in src, (name, old)
        src = src.replace(old, new)
    src = src.replace("from ._common import", "from mamba2_cutile.kernels._common import")
    src = src.replace("from .bwd_common import", "from mamba2_cutile.kernels.bwd_common import")
    d = tempfile.mkdtemp()
    path = os.path.join(d, f"abl_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"abl_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.bwd_chunk_dx


shape = problems.select("seed")[0]
inp = problems.make_inputs(shape)
dout, dfinal = problems.make_grad_outputs(shape)
calls = []
backward.run_backward(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], shape.chunk, dout,
                      dfinal, D=inp["D"], initial_states=inp["initial_states"],
                      launch_fn=calls.extend, sms=launch.num_sms(0))
stream = torch.cuda.current_stream()
for c in calls:          # fill the scratch the dx kernel reads
    ct.launch(stream, c.grid, c.kernel, c.args)
dx_call = next(c for c in calls
               if c.kernel._annotated_function.pyfunc.__name__ == "bwd_chunk_dx_fn")
cfg = backward.default_backward_config(*[shape.dims()[i] for i in (0, 2, 3, 4, 5)],
                                       shape.chunk, shape.dtype)
for name, cuts in CUTS.items():
    try:
        k = launch.hinted(variant(name, cuts), cfg.dx_occupancy, cfg.dx_warps)

        def one(k=k):
            ct.launch(torch.cuda.current_stream(), dx_call.grid, k, dx_call.args)
        one()
        ms = timing.time_graph(one, reps=30)["median_ms"]
        print(json.dumps({"variant": name, "config": sys.argv[1:], "ms": round(ms, 4)}),
              flush=True)
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}),
              flush=True)
