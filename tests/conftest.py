import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "compile: compiles kernels with tileiras on the CPU")
    config.addinivalue_line("markers", "slow: run only with MAMBA2_TEST_SLOW=1 (skipped otherwise)")


def _xdist_group(item):
    """GPU tests that compare with mamba_ssm's backward share a worker per problem shape:
    mamba_ssm autotunes its ~14 backward kernels (about a minute) once per process and shape,
    so spreading one shape over many workers repeats that minute on each (use --dist
    loadgroup)."""
    if not item.nodeid.startswith("tests/ssd/test_backward_gpu.py::"):
        return None
    name = item.name
    if name.startswith("test_options["):
        return "bwd-options-" + name[len("test_options["):].split("-")[0]   # one per dtype
    if name.startswith("test_shapes["):
        return "bwd-shape-" + name[len("test_shapes["):].rsplit("-", 1)[0]
    if name.startswith("test_short_and_partial["):
        return "bwd-short"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("MAMBA2_TEST_SLOW", "") in ("", "0"):
        skip_slow = pytest.mark.skip(reason="slow: set MAMBA2_TEST_SLOW=1 to run")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
