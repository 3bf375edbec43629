"""Accuracy probe of short, init-dominated problems (tests' test_short_and_partial shape):
ours (several configs / state dtypes) vs mamba_ssm vs the bf16 rounding floor, over seeds."""
import os
import sys

import torch

sys.path.insert(0, "tests")
from gpu_common import mamba_ssm_scan, rel_err  # noqa: E402
from test_forward_gpu import make_problem  # noqa: E402

from mamba2_cutile import mamba_chunk_scan_combined, reference  # noqa: E402

f = mamba_ssm_scan()
for l in (1, 65):
    for seed in range(6):
        inp, kw = make_problem(2, l, 4, 1, 32, 64, torch.bfloat16, {"D": "h", "init": True},
                               seed=seed)
        y_ref, _, _ = reference.ssd_recurrence(**inp, **kw)
        floor = rel_err(y_ref.to(torch.bfloat16), y_ref)
        ym = f(**inp, chunk_size=256, **kw)
        res = {"mamba": rel_err(ym, y_ref)}
        for name, cfg, sd in (("ours", "default", None), ("tf32", "scan_lowp=0", None),
                              ("fp32state", "default", torch.float32)):
            os.environ["MAMBA2_CUTILE_CONFIG"] = cfg
            y = mamba_chunk_scan_combined(**inp, chunk_size=256, state_dtype=sd, **kw)
            res[name] = rel_err(y, y_ref)
        os.environ["MAMBA2_CUTILE_CONFIG"] = "default"
        print(f"l={l} seed={seed} floor={floor:.2e} " +
              " ".join(f"{k}={v:.2e}" for k, v in res.items()), flush=True)
