"""Comparing dicts of gradients (x, dt, A, B, C, D, z, dt_bias, initial_states) on the CPU."""

import torch

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")

#: what a double backward through an opaque backward raises: the eager path's guard
#: (`mamba2_cutile.eager.no_double_backward`), or torch.library on the op's path
DOUBLE_BACKWARD = {"eager": "no double backward through", "op": "no autograd formula"}


def assert_grads_close(got, ref, tol, check_dtype=True):
    """Every gradient present in `ref` is present in `got` with its shape (and dtype), finite,
    and within tol * max|ref| of it elementwise; absent ones (None) are absent in both."""
    for k in NAMES:
        if ref[k] is None:
            assert got[k] is None, f"d{k} should be None"
            continue
        assert got[k] is not None, f"d{k} missing"
        assert got[k].shape == ref[k].shape, f"d{k}: shape {got[k].shape} != {ref[k].shape}"
        if check_dtype:
            assert got[k].dtype == ref[k].dtype, f"d{k}: dtype {got[k].dtype} != {ref[k].dtype}"
        assert torch.isfinite(got[k]).all(), f"d{k} has non-finite entries"
        scale = ref[k].abs().max().item()
        err = (got[k] - ref[k]).abs().max().item()
        assert err <= tol * max(scale, 1e-12), f"d{k}: error {err:.3e}, scale {scale:.3e}"
