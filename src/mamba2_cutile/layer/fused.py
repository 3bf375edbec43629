"""`mamba_split_conv1d_scan_combined`: the whole Mamba-2 layer after the input projection in
one autograd node, with mamba_ssm's signature and return conventions.

Arguments are validated here (shapes, dtypes, devices; seq_idx's values only on CPU or with
MAMBA2_CUTILE_CHECK=1, so the GPU path never synchronizes), then the custom op
`torch.ops.mamba2_cutile.split_conv1d_scan` runs (`custom_ops.py`); an eager call runs the
op's body and autograd without its dispatch (`custom_ops.split_conv1d_scan_call`).
"""

from __future__ import annotations

import math
import numbers

from ..checks import (FLOATS, GPU_FLOATS, INTS, check_gpu_dtypes, check_same_device,
                      check_tensor, expect_shape, plain_int, shape_of, value_checks_enabled)
from ..conv1d.plan import MAX_WIDTH
from ..ssd.forward import MAX_DSTATE, MAX_HEADDIM, SUPPORTED_CHUNK_SIZES
from . import custom_ops  # registers torch.ops.mamba2_cutile.split_conv1d_scan

ACTIVATIONS = (None, "silu", "swish")


def _int_arg(name, v, lo=1):
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


def _validate(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states,
              seq_idx, dt_limit, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight,
              outproj_bias, headdim, ngroups, state_dtype, norm_groups):
    """Checks every argument; returns (headdim, dt_lo, dt_hi, the norm's group size)."""
    check_tensor("zxbcdt", zxbcdt, 3, FLOATS)
    b, l, d_in_proj = zxbcdt.shape
    check_tensor("A", A, 1, FLOATS)
    h = A.shape[0]
    if h == 0:
        raise ValueError("A must have nheads >= 1 entries, got shape (0,)")
    check_tensor("D", D, (1, 2), FLOATS)
    if D.dim() == 1:
        expect_shape("D", D, (h,), "(nheads,) (nheads from A)")
        if headdim is None:
            raise ValueError("headdim is required when D has shape (nheads,)")
        _int_arg("headdim", headdim)
    else:
        if D.shape[0] != h:
            raise ValueError(f"D must have shape (nheads, headdim) with nheads = {h} (from A), "
                             f"got {shape_of(D)}")
        if headdim is not None and headdim != D.shape[1]:
            raise ValueError(f"headdim ({headdim!r}) disagrees with D's shape {shape_of(D)} "
                             "(nheads, headdim)")
        headdim = D.shape[1]
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"headdim must be in 1..{MAX_HEADDIM}, got {headdim}")
    _int_arg("ngroups", ngroups)
    if h % ngroups:
        raise ValueError(f"ngroups ({ngroups}) must divide nheads ({h}, from A)")
    dim = h * headdim
    check_tensor("conv1d_weight", conv1d_weight, 2, FLOATS)
    conv_dim, width = conv1d_weight.shape
    if conv_dim <= dim or (conv_dim - dim) % (2 * ngroups) or not 2 <= width <= MAX_WIDTH:
        raise ValueError(
            f"conv1d_weight must have shape (dim + 2 * ngroups * dstate, width) with dim = "
            f"nheads * headdim = {dim}, ngroups = {ngroups}, dstate >= 1, width in "
            f"2..{MAX_WIDTH}, got "
            f"{shape_of(conv1d_weight)} (an nn.Conv1d weight (c, 1, w) needs [:, 0])")
    n = (conv_dim - dim) // (2 * ngroups)
    if n > MAX_DSTATE:
        raise ValueError(f"dstate (from conv1d_weight) must be at most {MAX_DSTATE}, got {n}")
    core = 2 * dim + 2 * ngroups * n + h
    if d_in_proj < core or (d_in_proj - core) % 2:
        raise ValueError(
            f"zxbcdt's last dimension ({d_in_proj}) must be 2 * d_mlp + 2 * dim + 2 * ngroups * "
            f"dstate + nheads = 2 * d_mlp + {core} for some d_mlp >= 0 (dim = {dim}, ngroups = "
            f"{ngroups}, dstate = {n} from conv1d_weight, nheads = {h} from A)")
    d_mlp = (d_in_proj - core) // 2
    check_tensor("conv1d_bias", conv1d_bias, 1, FLOATS, optional=True)
    if conv1d_bias is not None:
        expect_shape("conv1d_bias", conv1d_bias, (conv_dim,), "(conv_dim,)")
    check_tensor("dt_bias", dt_bias, 1, FLOATS, optional=True)
    if dt_bias is not None:
        expect_shape("dt_bias", dt_bias, (h,), "(nheads,)")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or \
            chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES}, got {chunk_size!r}")
    check_tensor("initial_states", initial_states, 4, FLOATS, optional=True)
    if initial_states is not None:
        expect_shape("initial_states", initial_states, (b, h, headdim, n),
                     "(batch, nheads, headdim, dstate)")
    check_tensor("seq_idx", seq_idx, 2, INTS, optional=True)
    if seq_idx is not None:
        expect_shape("seq_idx", seq_idx, (b, l), "(batch, seqlen)")
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"dt_limit must be a pair of numbers (min, max), got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit must satisfy min <= max, got {dt_limit!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _int_arg("norm_groups", norm_groups)
    if dim % norm_groups:
        raise ValueError(f"norm_groups ({norm_groups}) must divide dim ({dim})")
    group_size = dim // norm_groups
    check_tensor("rmsnorm_weight", rmsnorm_weight, 1, FLOATS, optional=True)
    if rmsnorm_weight is not None:
        expect_shape("rmsnorm_weight", rmsnorm_weight, (dim,), "(dim,) = (nheads * headdim,)")
        from ..norm.plan import MAX_GROUP_SIZE
        if zxbcdt.is_cuda and group_size > MAX_GROUP_SIZE:
            what = "ngroups" if norm_groups == ngroups else "norm_groups"
            raise ValueError(f"the gated norm's group (dim // {what} = {group_size}) must be "
                             f"at most {MAX_GROUP_SIZE} on the GPU: use more groups")
    if not isinstance(rmsnorm_eps, numbers.Real) or isinstance(rmsnorm_eps, bool) or \
            not 0 <= rmsnorm_eps < math.inf:
        raise ValueError(f"rmsnorm_eps must be a finite number >= 0, got {rmsnorm_eps!r}")
    check_tensor("outproj_weight", outproj_weight, 2, FLOATS, optional=True)
    if outproj_weight is not None and outproj_weight.shape[1] != d_mlp + dim:
        raise ValueError(f"outproj_weight must have shape (out_dim, d_mlp + dim) with d_mlp + "
                         f"dim = {d_mlp + dim}, got {shape_of(outproj_weight)}")
    check_tensor("outproj_bias", outproj_bias, 1, FLOATS, optional=True)
    if outproj_bias is not None:
        if outproj_weight is None:
            raise ValueError("outproj_bias requires outproj_weight")
        expect_shape("outproj_bias", outproj_bias, (outproj_weight.shape[0],), "(out_dim,)")
    if state_dtype is not None and state_dtype not in (GPU_FLOATS if zxbcdt.is_cuda else FLOATS):
        raise TypeError(f"state_dtype must be torch.float16, bfloat16 or float32, got {state_dtype}")
    tensors = {"zxbcdt": zxbcdt, "conv1d_weight": conv1d_weight, "conv1d_bias": conv1d_bias,
               "dt_bias": dt_bias, "A": A, "D": D, "initial_states": initial_states,
               "seq_idx": seq_idx, "rmsnorm_weight": rmsnorm_weight,
               "outproj_weight": outproj_weight, "outproj_bias": outproj_bias}
    check_same_device(tensors, "zxbcdt")
    check_gpu_dtypes({k: t for k, t in tensors.items() if t is not None and k != "seq_idx"})
    if seq_idx is not None and seq_idx.numel() and value_checks_enabled(zxbcdt.is_cuda):
        if l > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
            raise ValueError("seq_idx must be non-decreasing along each row")
    return headdim, lo, hi, group_size


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                     chunk_size, initial_states=None, seq_idx=None,
                                     dt_limit=(0.0, float("inf")), return_final_states=False,
                                     activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6,
                                     outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, state_dtype=None):
    """The Mamba-2 layer from the input projection's output to the out projection's output.

    zxbcdt (b, l, 2 d_mlp + 2 dim + 2 g n + h) = [zx0 | z | xBC | dt], dim = h p;
    conv1d_weight (dim + 2 g n, w); conv1d_bias (dim + 2 g n,); dt_bias, A (h,); D (h,) (then
    headdim is required) or (h, p); initial_states (b, h, p, n); seq_idx (b, l) int;
    rmsnorm_weight (dim,); outproj_weight (out_dim, d_mlp + dim); outproj_bias (out_dim,).

        x, B, C = split(act(conv1d(xBC)))                 act: silu ("silu"/"swish") or none
        y = scan(x, softplus(dt + dt_bias) clamped to dt_limit, A, B, C, D, initial_states,
                 seq_idx)  -- with z * silu gating inside when rmsnorm_weight is None
        y = rmsnorm_weight * RMSNorm per dim / g channels of (y, gated by z as norm_before_gate)
        out = ([silu(zx0[:d_mlp]) * zx0[d_mlp:] |] y) outproj_weight^T + outproj_bias

    The convolution does not reach across seq_idx changes, the scan's state restarts there.
    Returns out (zxbcdt's dtype), and the final states (float32) if return_final_states.
    Differentiable in every tensor but seq_idx; the backward recomputes the convolution and
    the scan's output instead of keeping them. `state_dtype` is accepted for signature
    compatibility and checked; the final states are float32 whatever it is.
    """
    return split_conv1d_scan_norm_groups(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx,
        dt_limit, return_final_states, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight,
        outproj_bias, headdim, ngroups, norm_before_gate, state_dtype, norm_groups=ngroups)


def split_conv1d_scan_norm_groups(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                  initial_states=None, seq_idx=None,
                                  dt_limit=(0.0, float("inf")), return_final_states=False,
                                  activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6,
                                  outproj_weight=None, outproj_bias=None, headdim=None,
                                  ngroups=1, norm_before_gate=True, state_dtype=None, *,
                                  norm_groups):
    """`mamba_split_conv1d_scan_combined` with the gated norm over `norm_groups` groups of
    dim // norm_groups channels instead of mamba_ssm's `ngroups` (the B/C groups). For callers
    whose norm is defined apart from the B/C grouping: transformers before 5.18 normalises the
    Mamba-2, Bamba and GraniteMoeHybrid mixers' output over all of dim (norm_groups=1)."""
    chunk_size, headdim, ngroups, norm_groups = (plain_int(v) for v in (
        chunk_size, headdim, ngroups, norm_groups))
    headdim, lo, hi, group_size = _validate(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx,
        dt_limit, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias,
        headdim, ngroups, state_dtype, norm_groups)
    out, final = custom_ops.split_conv1d_scan_call(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, seq_idx,
        rmsnorm_weight, outproj_weight, outproj_bias, chunk_size, headdim, ngroups, group_size,
        float(rmsnorm_eps), bool(norm_before_gate), activation is not None, lo, hi)
    return (out, final) if return_final_states else out
