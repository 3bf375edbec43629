"""One forward + backward of the scan at a shape, for a profiler (ncu) to read the kernels.

    ncu --clock-control none -k regex:bwd -c 6 python3 scripts/profile_backward.py B,T,H,G,P,N,Q

Runs the public function twice (the first call compiles); set MAMBA2_CUTILE_BWD_CONFIG to
profile another config.
"""
import sys

import torch

from mamba2_cutile import mamba_chunk_scan_combined as scan
from mamba2_cutile.bench import problems

shape = problems.parse_custom(sys.argv[1])
inp = problems.make_inputs(shape)
dout, dfinal = problems.make_grad_outputs(shape)
leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()
          if torch.is_tensor(v) and v.is_floating_point()}
for _ in range(2):
    out, fin = scan(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], shape.chunk,
                    D=leaves.get("D"), initial_states=leaves.get("initial_states"),
                    return_final_states=True)
    torch.autograd.backward([out, fin], [dout, dfinal])
torch.cuda.synchronize()
print("done", shape.name)
