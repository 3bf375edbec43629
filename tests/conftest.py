import gc
import os

import pytest
import torch


#: reserved GPU memory above which a GPU test's process hands its cached blocks back
RELEASE_GPU_MEMORY_ABOVE = 2 << 30


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a GPU test that left more than RELEASE_GPU_MEMORY_ABOVE cached but unallocated in
    PyTorch's caching allocator (current device), return the cached blocks to the driver. Test groups run as parallel
    processes on one GPU (scripts/gpu_tests.py): a process that once held the 2^31-element
    tensors otherwise keeps their memory for the rest of its run, and other processes' tests
    fail out of memory (on an H100 on 2026-12-06 one such process held 72.9 of 80 GB and 9
    tests of other groups failed so)."""
    yield
    if "gpu" not in request.keywords or not torch.cuda.is_initialized():
        return
    try:
        if torch.cuda.memory_reserved() - torch.cuda.memory_allocated() > \
                RELEASE_GPU_MEMORY_ABOVE:
            gc.collect()
            torch.cuda.empty_cache()
    except RuntimeError:
        pass        # a sticky CUDA error: the test itself reports it


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "compile: compiles kernels with tileiras on the CPU")
    config.addinivalue_line("markers", "slow: run only with MAMBA2_TEST_SLOW=1 (skipped otherwise)")


def _xdist_group(item):
    """The mamba_ssm comparison tests (test_against_mamba_ssm_*) of the backward share one
    worker, and those of the forward another: mamba_ssm autotunes its Triton kernels (about a
    minute per backward kernel shape on an H200) once per process, so spreading them over many
    workers would repeat that on each (use --dist loadgroup). The decode comparisons need no autotune
    and stay ungrouped. The conv1d tests of 2^31+-element tensors (4.3 GB a bf16 tensor, several
    per test) share one worker too, so that no two of them fill the GPU's memory at once. The
    bad-input GPU cases of one kernel variant (dtype, chunk, seq_idx, causal mode, dt_bias) share
    a worker: each variant's first case compiles four kernels (tens of seconds), and workers
    missing the compile cache at once would each compile the same ones."""
    if item.nodeid.startswith("tests/ssd/test_bad_input.py::") and "gpu" in item.keywords \
            and hasattr(item, "callspec"):
        p = item.callspec.params
        return "bad-input-" + "-".join(str(p.get(k)) for k in ("dtype", "Q", "seq", "causal")) \
            + ("-raw-dt" if p.get("name") == "dt_raw" else "")
    if item.nodeid.startswith("tests/conv1d/test_conv1d_gpu.py::") and item.name.startswith(
            ("test_int64_indexing", "test_long_sequence", "test_row_streaming_int64")):
        return "conv1d-2g-elements"
    if not item.name.startswith("test_against_mamba_ssm"):
        return None
    if item.nodeid.startswith("tests/ssd/test_backward_gpu.py::"):
        return "mamba-bwd"
    if item.nodeid.startswith("tests/ssd/test_forward_gpu.py::"):
        return "mamba-fwd"
    return None


#: test functions with many parametrized cases whose default run keeps a covering subset:
#: the cases, in collection order, that bring a parameter value not yet seen, so every value
#: of every parameter runs at least once; the whole cross product runs with
#: MAMBA2_TEST_SLOW=1 (the rest are marked slow). Each is a float64 emulation or CPU compile
#: of the same kernels over options, tiles and segment counts (seconds a case on 2 cores).
COVERED = {
    "tests/ssd/test_backward_emulation.py": (
        "test_emulated_side_streams", "test_emulated_group_dcb", "test_emulated_dx_heads",
        "test_emulated_segmented_state_passes", "test_emulated_dcb_head_split",
        "test_emulated_dbc_fused_options", "test_emulated_reverse_pass_forms",
        "test_emulated_head_split"),
    "tests/ssd/test_forward_emulation.py": (
        "test_emulated_segment_fold", "test_emulated_state_resweep", "test_emulated_walk",
        "test_emulated_scan_heads", "test_emulated_segmented_state_pass",
        "test_emulated_scan_heads_other_causal_modes",
        "test_emulated_forward_matches_recurrence"),
    "tests/ssd/test_bad_input.py": (
        "test_emulated_kernels_causal_with_scan_cb_and_fold", "test_emulated_kernels_causal",
        "test_emulated_walk_causal", "test_emulated_kernels_causal_with_scan_heads",
        "test_emulated_head_flags_many_heads", "test_cpu_path_causal"),
    "tests/conv1d/test_conv1d.py": (
        "test_kernels_emulated_forward_backward", "test_kernels_emulated_row_streaming"),
    "tests/ssd/test_ssd_compile.py": (
        "test_dx_heads_compiles", "test_scan_heads_compiles",
        "test_segmented_state_pass_compiles"),
}


def _mark_beyond_cover(items):
    """Marks slow the cases of each COVERED function that add no new parameter value."""
    seen = {}
    for item in items:
        path, _, name = item.nodeid.partition("::")
        func = name.split("[")[0]
        if func not in COVERED.get(path, ()) or not hasattr(item, "callspec"):
            continue
        values = {(k, repr(v)) for k, v in item.callspec.params.items()}
        covered = seen.setdefault((path, func), set())
        if values <= covered:
            item.add_marker(pytest.mark.slow)
        covered |= values


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # first: xdist's worker hook turns xdist_group marks into node-id suffixes (--dist
    # loadgroup) in this same hook, and marks added after it are ignored
    for item in items:
        group = _xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    _mark_beyond_cover(items)
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


def pytest_runtest_logreport(report):
    """With $MAMBA2_TEST_FAILLOG set, each failure's traceback is appended to that file as it
    happens: a GPU run cut by its time limit keeps why its failed tests failed (pytest prints
    tracebacks only in its final report, which a killed run never writes)."""
    path = os.environ.get("MAMBA2_TEST_FAILLOG")
    if not path or not report.failed or getattr(report, "node", None) is not None:
        return                  # (under xdist the controller's copy of a worker's report has .node)
    with open(path, "a") as f:
        f.write(f"=== {report.when} FAILED {report.nodeid}\n{report.longreprtext[-4000:]}\n")
