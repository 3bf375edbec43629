"""Helpers shared by the GPU test files: error metric, per-check log, baseline imports."""

import os

import torch

# max|err| / max|ref| bounds of the correctness tests, by input dtype
TOL = {torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float32: 2e-3}

#: (b, l, h, g, p, n) problems of the forward and backward shape tests
SHAPES = [
    (1, 1000, 8, 1, 64, 128),
    (2, 333, 6, 3, 80, 96),      # headdim and dstate not powers of two
    (1, 515, 2, 1, 128, 256),
    (3, 129, 4, 4, 16, 16),
    (1, 200, 4, 2, 40, 24),
    (1, 77, 2, 1, 256, 32),
]


def rel_err(a, ref):
    """max|a - ref| / max|ref| in float64 (0 for empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    return ((a.double() - ref.double()).abs().max()
            / ref.double().abs().max().clamp_min(1e-30)).item()


def log_result(msg):
    """Errors of every check, appended as they happen to $MAMBA2_TEST_LOG (survives a killed
    test run)."""
    path = os.environ.get("MAMBA2_TEST_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}: {msg}\n")


def mamba_ssm_scan():
    """mamba_ssm's mamba_chunk_scan_combined, or None (a missing baseline skips comparisons)."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as f
        return f
    except Exception:  # noqa: BLE001
        return None


def mamba_ssm_state_update():
    """mamba_ssm's Triton selective_state_update, or None."""
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as f
        return f
    except Exception:  # noqa: BLE001
        return None
