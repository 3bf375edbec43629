"""How outputs are compared: the relative error against a reference, and the forward's
tolerance per input dtype (used by `verify`, the bench's cross-check and the tests)."""

from __future__ import annotations

import torch

#: max|err| / max|ref| bound of the forward's outputs against the float64 recurrence, by input
#: dtype. The largest errors measured on the H200 are about 5e-3 (bf16), 6e-4 (fp16) and 2e-5
#: (fp32, tf32 tensor-core products); docs/results/2026-11-30-h200-gpu-test-errors.txt.
FORWARD_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-4}


def rel_err(a, ref) -> float:
    """max|a - ref| / max|ref| in float64 (0 for empty tensors; NaN anywhere gives NaN)."""
    if ref.numel() == 0:
        return 0.0
    ref = ref.double()
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
