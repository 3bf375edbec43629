"""Helpers shared by the GPU test files: error metric, per-check log, problem shapes, the
mamba_ssm baselines (tolerances: support.tolerances)."""

import os

import pytest

from mamba2_cutile.bench.accuracy import rel_err  # noqa: F401  (max|a - ref| / max|ref|)

#: (b, l, h, g, p, n) problems of the forward and backward shape tests
SHAPES = [
    (1, 1000, 8, 1, 64, 128),
    (2, 333, 6, 3, 80, 96),      # headdim and dstate not powers of two
    (1, 515, 2, 1, 128, 256),
    (3, 129, 4, 4, 16, 16),
    (1, 200, 4, 2, 40, 24),
    (1, 77, 2, 1, 256, 32),
]


def log_result(msg):
    """Errors of every check, appended as they happen to $MAMBA2_TEST_LOG (survives a killed
    test run). The line starts with the test's node id (PYTEST_CURRENT_TEST less its
    " (call)" tail; ids may contain spaces)."""
    path = os.environ.get("MAMBA2_TEST_LOG")
    if path:
        with open(path, "a") as f:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
            f.write(f"{test}: {msg}\n")


def mamba_ssm_scan():
    """mamba_ssm's mamba_chunk_scan_combined, or None if it is not importable."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as f
        return f
    except Exception:  # noqa: BLE001
        return None


def mamba_ssm_state_update():
    """mamba_ssm's Triton selective_state_update, or None if it is not importable."""
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as f
        return f
    except Exception:  # noqa: BLE001
        return None


def _require(get, what):
    if os.environ.get("MAMBA2_TEST_COMPARE_MAMBA", "1") == "0":
        pytest.skip("MAMBA2_TEST_COMPARE_MAMBA=0: the mamba_ssm comparison is off")
    f = get()
    if f is None:
        pytest.skip(f"mamba_ssm is not importable ({what}): no baseline to compare with")
    return f


def require_mamba_ssm_scan():
    """mamba_ssm's mamba_chunk_scan_combined for a comparison test, or skip that test (when
    mamba_ssm is not importable or MAMBA2_TEST_COMPARE_MAMBA=0)."""
    return _require(mamba_ssm_scan, "mamba_ssm.ops.triton.ssd_combined")


def require_mamba_ssm_state_update():
    """mamba_ssm's selective_state_update for a comparison test, or skip that test."""
    return _require(mamba_ssm_state_update, "mamba_ssm.ops.triton.selective_state_update")


def mamba_refused(e):
    """Skip the running comparison test: mamba_ssm raised on this option combination (its
    asserts and NotImplementedError/ValueError/RuntimeError). A TypeError, NameError,
    AttributeError, KeyError or IndexError is a wrong call from the test itself, and an
    out-of-memory or CUDA error says nothing of the inputs: those are re-raised."""
    import torch
    cuda_errors = tuple(getattr(torch, n) for n in ("OutOfMemoryError", "AcceleratorError")
                        if hasattr(torch, n))
    if isinstance(e, (TypeError, NameError, AttributeError, KeyError, IndexError,
                      *cuda_errors)):
        raise e
    pytest.skip(f"mamba_ssm refuses these inputs: {type(e).__name__}: {str(e)[:300]}")
