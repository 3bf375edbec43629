"""How outputs are compared: the relative error against a reference, and the forward's
tolerance per input dtype (used by `verify`, the bench's cross-check and the tests)."""

from __future__ import annotations

import torch

#: max|err| / max|ref| bound of the forward's outputs against the float64 recurrence, by input
#: dtype: about 4x the largest error the GPU tests measured on the H200 (bf16 4.8e-3, fp16
#: 5.1e-4, fp32 6.3e-4 with tf32 tensor-core products);
#: benchmarks/results/2026-11-30-h200-gpu-test-errors-forward-decode-backward.txt
FORWARD_TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 2e-3}


def rel_err(a, ref, window=None) -> float:
    """max|a - ref| / max|ref| in float64 (0 for empty tensors; NaN anywhere gives NaN).
    window: take the maxima over slices of that many elements of the last axis (the float64
    copies of a 2^31-element tensor would take 17 GB each); the same value."""
    if ref.numel() == 0:
        return 0.0
    if not window or ref.dim() == 0:
        ref = ref.double()
        return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    n, step = ref.shape[-1], window
    # torch.maximum keeps a NaN from any window
    num = den = torch.zeros((), dtype=torch.float64, device=ref.device)
    for s in range(0, n, step):
        r = ref[..., s:s + step].double()
        num = torch.maximum(num, (a[..., s:s + step].double() - r).abs().max())
        den = torch.maximum(den, r.abs().max())
    return (num / den.clamp_min(1e-30)).item()
