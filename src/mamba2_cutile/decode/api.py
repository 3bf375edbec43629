"""Mamba-2 decode: `selective_state_update`, the token-by-token state update, in place.

A drop-in for mamba_ssm's Mamba-2 `selective_state_update` (state (nslots, h, p, n), x/dt/z
(batch, h, p), A (h, p, n), B/C (batch, g, n), D/dt_bias (h, p)), extended with

- `state_batch_indices` (batch,) int: row r uses state slot state_batch_indices[r] of a larger
  cache (continuous batching); a negative index marks a padding row (y = 0, its state and its
  out_states rows are neither read nor written). Without it, row r uses slot r.
  The slots of one call must be distinct: repeated slots race and are NOT supported.
- several new tokens per call (speculative decoding): x, dt, z (batch, k, h, p), B, C
  (batch, k, g, n) -> y (batch, k, h, p); the k steps are applied in order in one kernel, with
  the state kept on chip (float32) between steps, and `out_states` (batch, k, h, p, n), when
  given, receives the state after each step (cast to its dtype).

Per-head layouts: dt, A, D and dt_bias usually are stride-0 expansions of per-head values
(A = A_h[:, None, None].expand(h, p, n), ...). The dispatcher detects them from the strides and
hands the kernel the compact per-head view (DT_HEAD / A_HEAD / D_MODE=1 / BIAS_MODE=1); general
(non-expanded) tensors go to the general variant of each flag, read in place with their own
strides. Nothing is ever materialized (no copies, no extra launches) except an int64
`state_batch_indices`, converted to int32 (pass int32 to avoid that launch).

The GPU path reads no tensor values (no host sync, CUDA-graph capturable); values are checked
(slot range, distinct slots) only on CPU tensors or with MAMBA2_CUTILE_CHECK=1. Unchecked, a
slot >= nslots is a padding row on the GPU (y = 0, nothing written): the kernel never reaches
past the state, which lets it drop the state's bounds checks when the tiles divide it
exactly. CPU tensors run a plain PyTorch version with the kernel's rounding points
(`cpu.update_torch`); `reference.decode.selective_state_update_ref` is the float64 sequential
definition used by the tests.
"""

from __future__ import annotations

import torch

from ..checks import (FLOATS, INTS, check_gpu_dtypes, check_not_expanded, check_same_device,
                      check_tensor, expect_shape, plain_flag, shape_of, value_checks_enabled)
from ..runtime import launch_calls
from .cpu import update_torch
from .plan import MAX_DSTATE, decode_plan, layout_signature


def _validate(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx, out_states):
    check_tensor("state", state, 4, FLOATS)
    nslots, h, p, n = state.shape
    check_tensor("x", x, (3, 4), FLOATS)
    steps = x.dim() == 4
    if x.shape[-2:] != (h, p):
        raise ValueError(f"x must have shape (batch, [k,] nheads, headdim) with nheads={h}, "
                         f"headdim={p} (from state), got {shape_of(x)}")
    b = x.shape[0]
    k = x.shape[1] if steps else 1
    lead = (b, k) if steps else (b,)
    lead_txt = "(batch, k, " if steps else "(batch, "
    check_tensor("dt", dt, x.dim(), FLOATS)
    expect_shape("dt", dt, shape_of(x), "x's shape")
    check_tensor("A", A, 3, FLOATS)
    expect_shape("A", A, (h, p, n), "(nheads, headdim, dstate)")
    check_tensor("B", B, x.dim(), FLOATS)
    if B.shape[:-2] != lead or B.shape[-1] != n:
        raise ValueError(f"B must have shape {lead_txt}ngroups, dstate) with "
                         f"{'batch, k' if steps else 'batch'} = {lead} (from x) and dstate = {n} "
                         f"(from state), got {shape_of(B)}")
    g = B.shape[-2]
    check_tensor("C", C, x.dim(), FLOATS)
    expect_shape("C", C, shape_of(B), "B's shape")
    if g == 0 or h % g != 0:
        raise ValueError(f"ngroups ({g}, from B) must divide nheads ({h}, from state)")
    if h == 0 or p == 0 or n == 0:
        raise ValueError(f"state must have nheads, headdim and dstate >= 1, got {shape_of(state)}")
    check_tensor("D", D, (1, 2), FLOATS, optional=True)
    if D is not None and shape_of(D) not in ((h, p), (h,)):
        raise ValueError(f"D must have shape (nheads, headdim) = ({h}, {p}) or (nheads,) = "
                         f"({h},), got {shape_of(D)}")
    check_tensor("z", z, x.dim(), FLOATS, optional=True)
    if z is not None:
        expect_shape("z", z, shape_of(x), "x's shape")
    check_tensor("dt_bias", dt_bias, (1, 2), FLOATS, optional=True)
    if dt_bias is not None and shape_of(dt_bias) not in ((h, p), (h,)):
        raise ValueError(f"dt_bias must have shape (nheads, headdim) = ({h}, {p}) or "
                         f"(nheads,) = ({h},), got {shape_of(dt_bias)}")
    if not isinstance(dt_softplus, (bool, int)):
        raise TypeError(f"dt_softplus must be a bool, got {type(dt_softplus).__name__}")
    check_tensor("state_batch_indices", idx, 1, INTS, optional=True)
    if idx is not None:
        expect_shape("state_batch_indices", idx, (b,), "(batch,)")
    elif nslots < b:
        raise ValueError(f"state has {nslots} slots (state.shape[0]) but batch (x.shape[0]) is "
                         f"{b}: without state_batch_indices row i uses slot i")
    check_tensor("out_states", out_states, (4, 5) if not steps else 5, FLOATS, optional=True)
    if out_states is not None:
        if out_states.dim() == 4:
            expect_shape("out_states", out_states, (b, h, p, n), "(batch, nheads, headdim, dstate)")
        else:
            expect_shape("out_states", out_states, (b, k, h, p, n),
                    "(batch, k, nheads, headdim, dstate)")
        check_not_expanded("out_states", out_states)
    check_not_expanded("state", state)

    tensors = {"state": state, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z,
               "dt_bias": dt_bias, "state_batch_indices": idx, "out_states": out_states}
    check_same_device(tensors)
    check_gpu_dtypes({k: t for k, t in tensors.items() if t is not None and t.is_floating_point()})
    if x.is_cuda:
        if n > MAX_DSTATE:
            raise ValueError(f"dstate (state.shape[3]) must be at most {MAX_DSTATE} on the GPU, "
                             f"got {n}")
    _validate_values(state, x, idx)


_VALIDATED: set = set()     # layout keys (`layout_signature`) that passed `_validate`


def _validate_values(state, x, idx):
    """The checks that read tensor values: every call on CPU inputs, on the GPU only with
    MAMBA2_CUTILE_CHECK=1 (they synchronize)."""
    if idx is not None and value_checks_enabled(x.is_cuda):
        _check_indices(idx, state.shape[0])


def _check_indices(idx, nslots):
    """Checks that read the index values (they synchronize on a GPU)."""
    v = idx.to("cpu", torch.int64)
    if bool((v >= nslots).any()):
        raise ValueError(f"state_batch_indices must be < nslots ({nslots}, state.shape[0]), "
                         f"got max {int(v.max())}")
    used = v[v >= 0]
    if used.numel() != torch.unique(used).numel():
        raise ValueError("state_batch_indices must not repeat a slot (negative = padding rows "
                         "excepted): repeated slots in one call are not supported")


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None, out_states=None):
    """One decode step (or k steps) of Mamba-2, updating `state` in place; returns y. No
    autograd, as mamba_ssm's kernel: nothing is recorded, and a gradient taken through a
    state that required grad before the step misses the step.

    state (nslots, h, p, n) float32/bf16/fp16, updated in place; x, dt, z (batch, h, p) or
    (batch, k, h, p); A (h, p, n); B, C (batch, [k,] g, n); D, dt_bias (h, p) or (h,);
    state_batch_indices (batch,) int (negative: padding row); out_states (batch, k, h, p, n)
    (or (batch, h, p, n) for 3-D x) receives the state after each step.
    Returns y shaped like x, in x's dtype. Per (row, head, channel, state entry, step):

        dt' = softplus?(dt + dt_bias);  state = exp(A dt') state + dt' x B[group]
        y = sum_n state C[group] + D x;  y *= z sigmoid(z)

    mamba_ssm's form without a head dimension is taken too: state (nslots, dim, n); x, dt, z
    (batch, dim); A (dim, n); B, C (batch, n); D, dt_bias (dim,); out_states (batch, dim, n)
    (one head of `dim` channels; y (batch, dim)).
    """
    dt_softplus = plain_flag(dt_softplus)
    if isinstance(state, torch.Tensor) and state.dim() == 3:
        return _without_heads(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                              state_batch_indices, out_states)
    key = layout_signature((state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, out_states),
                      dt_softplus)
    if key is None or key not in _VALIDATED:
        _validate(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                  out_states)
        if key is not None:
            if len(_VALIDATED) > 256:
                _VALIDATED.clear()
            _VALIDATED.add(key)
    else:
        _validate_values(state, x, state_batch_indices)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # a decode step has no gradient: on the CPU path autograd would otherwise record the
    # in-place writes and chain every step's graph onto the state's
    with torch.no_grad():
        if x.is_cuda:
            update_cuda(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                        out_states, y, layout_key=key)
        else:
            update_torch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                         state_batch_indices, out_states, y)
    return y


def _without_heads(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx, out_states):
    """The form without heads as one head: a view with a head dimension of 1 (the state is
    still updated in place)."""
    if isinstance(x, torch.Tensor) and x.dim() in (3, 4):
        raise ValueError(f"state must have 4 dimensions (nslots, nheads, headdim, dstate) with "
                         f"x of {x.dim()} dimensions, got 3 (a 3-D state is mamba_ssm's form "
                         f"without heads, with x (batch, dim))")
    ndims = dict(x=(x, 2), dt=(dt, 2), A=(A, 2), B=(B, 2), C=(C, 2), D=(D, 1), z=(z, 2),
                 dt_bias=(dt_bias, 1), out_states=(out_states, 3))
    for name, (t, nd) in ndims.items():
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != nd):
            got = t.dim() if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have {nd} dimensions with a 3-D state (mamba_ssm's "
                             f"form without heads), got {got}")
    head = lambda t, d: None if t is None else t.unsqueeze(d)  # noqa: E731
    y = selective_state_update(state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1),
                               A.unsqueeze(0), B.unsqueeze(1), C.unsqueeze(1), D=head(D, 0),
                               z=head(z, 1), dt_bias=head(dt_bias, 0), dt_softplus=dt_softplus,
                               state_batch_indices=idx, out_states=head(out_states, 1))
    return y.squeeze(1)


def _slots_int32(idx):
    """state_batch_indices as the kernel's int32, value for value: int64 is clamped first (a
    plain cast wraps 2**32 + 1 onto slot 1; clamped, a slot past int32 stays past the state, a
    padding row in the kernel); the narrower integer types convert exactly."""
    if idx.dtype == torch.int64:
        idx = idx.clamp(-1, 2**31 - 1)
    return idx.to(torch.int32)


def update_cuda(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx, out_states, y,
                 cfg=None, layout_key=None):
    """Launch the kernel. Inputs must already be validated. No host synchronization."""
    if idx is not None and idx.dtype != torch.int32:
        idx = _slots_int32(idx)
    launch_calls(decode_plan(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx,
                             out_states, y, cfg, layout_key=layout_key), x.device)
