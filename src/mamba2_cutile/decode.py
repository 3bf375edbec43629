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
(`_update_torch`);
`selective_state_update_ref` is the float64 sequential definition used by the tests.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import launch
from .checks import (FLOATS, GPU_FLOATS, INTS, check_tensor, config_from_env, expect_shape,
                     shape_of)
from .launch import KernelCall, hinted, needs_int64, next_pow2

MAX_DSTATE = 256           # the whole (padded) dstate is one tile
TILE_ELEMS = 8192          # state elements per program at most (BLOCK_P * NP)



# ----------------------------------------------------------------------------------------------
# configs and plans (meta tensors work: nothing here reads values)

@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes of the state-update kernel (powers of two) and its occupancy hint."""
    block_p: int
    dstate_pad: int
    occupancy: int = 0      # 0: let the compiler choose
    persistent: int = 0     # >0: a fixed grid of this many programs per SM walks the tiles
    block_n: int = 0        # >0: one-token calls walk dstate in slices of this width
    latency: int = 0        # state load latency hint (1-10; 0: none)
    tma: int = 1            # 0: state loads/stores without TMA (plain vector accesses);
                            # 2: loads with TMA (into shared memory), stores without
    tma_vec: int = 1        # 0: the per-step x, B, C loads without TMA too
    warps: int = 0          # num_worker_warps hint (0: the compiler's choice)
    unchecked: int = 1      # 1: state loads/stores without bounds checks when the tiles divide
                            # the state exactly (headdim % block_p == 0, dstate == dstate_pad
                            # or a multiple of block_n) and tileiras is 13.4 or later; 0: always
                            # checked
    flat: int = 0           # 1: a 1-D grid in memory order (p tiles, then heads, then rows
                            # fastest-first), so that programs running together stream one
                            # contiguous stretch of the state

    def __post_init__(self):
        for name in ("block_p", "dstate_pad") + (("block_n",) if self.block_n else ()):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"decode config: {name}={v} is not a power of two")
        if self.occupancy < 0 or self.persistent < 0:
            raise ValueError(f"decode config: occupancy={self.occupancy} and "
                             f"persistent={self.persistent} must be >= 0")
        if self.flat not in (0, 1) or (self.flat and self.persistent):
            raise ValueError(f"decode config: flat={self.flat} must be 0 or 1, and 0 with "
                             "persistent")
        if self.warps not in (0, 4, 8):
            raise ValueError(f"decode config: warps={self.warps} is not 0 (the compiler's "
                             "choice), 4 or 8 (what tileiras 13.4 accepts)")
        if not 0 <= self.latency <= 10:
            raise ValueError(f"decode config: latency={self.latency} is not in 0..10")
        if self.unchecked not in (0, 1):
            raise ValueError(f"decode config: unchecked={self.unchecked} must be 0 or 1")
        if self.tma not in (0, 1, 2) or self.tma_vec not in (0, 1):
            raise ValueError(f"decode config: tma={self.tma} must be 0, 1 or 2 and "
                             f"tma_vec={self.tma_vec} 0 or 1")


def default_decode_config(batch, nheads, headdim, dstate, sms=132) -> DecodeConfig:
    """The dispatcher's tile choice, from the shape alone (no search, no sync).

    The kernel is memory-bound: what matters is the bytes in flight per SM and how they move.
    Measured on the H200 (batch 1-256, H=128 P=64 N=128 G=8, bf16 state; session-3 sweeps in
    results/): 64-channel tiles loaded and stored without TMA (plain vector accesses, no SMEM
    round trip) at 4 programs per SM reach 3.4 TB/s at batch 64 and 3.6 TB/s at batch 256,
    against 2.8 / 3.0 TB/s for the best TMA config (32-channel tiles, 8 per SM); grids of
    under 4 programs per SM (batch 1-4 here) do better with 2 per SM (measured at batch 1
    and 2).
    """
    np_ = max(16, next_pow2(dstate))
    bp = min(64, next_pow2(headdim), max(4, TILE_ELEMS // np_))
    programs = batch * nheads * -(-headdim // bp)
    occupancy = 4 if programs >= 4 * sms else 2
    return config_from_env(DecodeConfig(block_p=bp, dstate_pad=np_, occupancy=occupancy, tma=0),
                           "MAMBA2_CUTILE_DECODE_CONFIG", frozen=("dstate_pad",))


def _per_head(t, dims):
    """True when `t` is constant along `dims` (stride 0 or size 1): a per-head expansion."""
    return all(t.stride(d) == 0 or t.shape[d] == 1 for d in dims)


def _head_mode(t):
    """(mode, kernel tensor) of D / dt_bias: 0 absent, 1 per head (h,), 2 per channel (h, p)."""
    if t is None:
        return 0, None
    if t.dim() == 1:
        return 1, t
    if _per_head(t, (1,)):
        return 1, t[:, 0]
    return 2, t


def _steps(t, ndim3):
    """The k-step form: insert k = 1 into a 3-D x/dt/z/B/C/y (a view)."""
    return None if t is None else (t.unsqueeze(1) if t.dim() == ndim3 else t)


def variant_of(call: KernelCall) -> dict:
    """The compile-time flags of a planned launch, by parameter name, plus "int64"."""
    fn = call.kernel._annotated_function.pyfunc
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    flags = {name: v for name, v in zip(names, call.args) if not isinstance(v, torch.Tensor)}
    flags["int64"] = fn.__annotations__.get("state") is _int64_annotation()
    return flags


@functools.lru_cache(maxsize=None)
def _unchecked_supported() -> bool:
    """Whether the tileiras cuda-tile runs takes `check_bounds=False` (13.4 and later; cuda-tile
    1.7 also runs with 13.2 and 13.3). Unknown counts as no: the checked kernel is slower,
    never wrong."""
    from .tuning import tileiras_version
    m = re.match(r"(\d+)\.(\d+)", tileiras_version())
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (13, 4)


def _int64_annotation():
    import cuda.tile as ct
    return ct.IndexedWithInt64


def _sms(t) -> int:
    return launch.num_sms(t.device.index or 0) if t.device.type == "cuda" else 132


def _layout_key(tensors, dt_softplus):
    """What validation and the launch plan depend on, for caching both per layout: each
    tensor's shape, strides, dtype and device, and dt_softplus. None when an argument is not
    a tensor-like object (validation then reports it)."""
    try:
        return (tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                      for t in tensors), type(dt_softplus), bool(dt_softplus))
    except (AttributeError, TypeError, RuntimeError):
        return None


def decode_plan(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                out_states, y, cfg: DecodeConfig | None = None, layout_key=None):
    """The launch of one (validated) `selective_state_update` call: a list of KernelCall.

    Takes the public shapes (3-D or k-step 4-D x), `y` shaped like x, `state_batch_indices`
    already int32. Picks the kernel variant from the strides (see the module docstring).
    `layout_key`: `_layout_key` of (state, x, dt, A, B, C, D, z, dt_bias, original indices,
    out_states), when the caller has it already.
    """
    if x.shape[0] == 0 or (x.dim() == 4 and x.shape[1] == 0):
        return []
    # The variant, grid and flags depend only on shapes, strides and dtypes: decode is called
    # once per token, so they are computed once per layout (the Python cost is the latency).
    if layout_key is None:
        layout_key = _layout_key((state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices,
                                  out_states), dt_softplus)
    key = (layout_key, (y.shape, y.stride(), y.dtype), state_batch_indices is not None, cfg,
           os.environ.get("MAMBA2_CUTILE_DECODE_CONFIG"))
    x4, dt4, z4, y4 = (_steps(t, 3) for t in (x, dt, z, y))
    B4, C4 = _steps(B, 3), _steps(C, 3)
    out5 = None if out_states is None else _steps(out_states, 4)
    static = _PLAN_CACHE.get(key)
    if static is None:
        static = _static_plan(state, x4, dt4, A, B4, C4, D, z4, dt_bias, dt_softplus,
                              state_batch_indices, out5, y4, cfg, x)
        if len(_PLAN_CACHE) > 256:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = static
    kernel, grid, dt_head, a_head, d_mode, bias_mode, flags = static
    dt_arg = dt4[..., 0] if dt_head else dt4
    a_arg = A[:, 0, 0] if a_head else A
    d_arg = None if D is None else (D[:, 0] if d_mode == 1 and D.dim() == 2 else D)
    bias_arg = None if dt_bias is None else (
        dt_bias[:, 0] if bias_mode == 1 and dt_bias.dim() == 2 else dt_bias)
    # stand-ins for absent optional tensors: never read (their flag is off)
    args = (state, x4, dt_arg, a_arg, B4, C4,
            d_arg if d_arg is not None else a_arg,
            z4 if z4 is not None else x4,
            bias_arg if bias_arg is not None else a_arg,
            state_batch_indices if state_batch_indices is not None else a_arg,
            out5 if out5 is not None else x4,
            y4) + flags
    return [KernelCall(kernel, grid, args)]


_PLAN_CACHE: dict = {}


def _static_plan(state, x4, dt4, A, B4, C4, D, z4, dt_bias, dt_softplus, state_batch_indices,
                 out5, y4, cfg, x):
    from .kernels.state_update import state_update, state_update_i64

    b, k, h, p = x4.shape
    g, n = B4.shape[2], B4.shape[3]
    if cfg is None:
        cfg = default_decode_config(b, h, p, n, _sms(x))
    dt_head = _per_head(dt4, (3,))
    dt_arg = dt4[..., 0] if dt_head else dt4
    a_head = _per_head(A, (1, 2))
    a_arg = A[:, 0, 0] if a_head else A
    d_mode, d_arg = _head_mode(D)
    bias_mode, bias_arg = _head_mode(dt_bias)
    big = needs_int64(state, x4, dt_arg, a_arg, B4, C4, d_arg, z4, bias_arg, out5, y4)
    kernel = hinted(state_update_i64 if big else state_update, cfg.occupancy, cfg.warps)
    block_n = min(cfg.block_n, cfg.dstate_pad) if cfg.block_n and k == 1 else 0
    # every state tile inside the state: the kernel may drop its bounds checks (it maps a
    # slot past the state to a padding row itself)
    inside = p % cfg.block_p == 0 and n % (block_n or cfg.dstate_pad) == 0 \
        and _unchecked_supported()
    flags = (cfg.block_p, cfg.dstate_pad, h // g, dt_head, a_head, d_mode, bias_mode,
             z4 is not None, bool(dt_softplus), state_batch_indices is not None,
             out5 is not None, bool(cfg.persistent or cfg.flat), block_n,
             cfg.latency + (0 if cfg.tma else 16) + (0 if cfg.tma_vec else 32)
             + (0 if cfg.tma == 1 else 64) + (128 if cfg.unchecked and inside else 0))
    tiles = b * h * -(-p // cfg.block_p)
    # flat: the persistent loop with one program per tile, in memory order
    grid = ((min(tiles, cfg.persistent * _sms(x)), 1, 1) if cfg.persistent
            else (tiles, 1, 1) if cfg.flat else (b, h, -(-p // cfg.block_p)))
    return kernel, grid, dt_head, a_head, d_mode, bias_mode, flags


# ----------------------------------------------------------------------------------------------
# validation

def _no_zero_strides(name, t):
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} is written in place and must not be an expanded (stride-0) "
                         f"view, got strides {t.stride()} for shape {shape_of(t)}")


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
        _no_zero_strides("out_states", out_states)
    _no_zero_strides("state", state)

    tensors = {"state": state, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z,
               "dt_bias": dt_bias, "state_batch_indices": idx, "out_states": out_states}
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}: "
                             "all tensors must be on one device")
    if x.is_cuda:
        for name, t in tensors.items():
            if t is not None and t.is_floating_point() and t.dtype not in GPU_FLOATS:
                raise TypeError(f"{name} must be float16, bfloat16 or float32 on the GPU, "
                                f"got {t.dtype}")
        if n > MAX_DSTATE:
            raise ValueError(f"dstate (state.shape[3]) must be at most {MAX_DSTATE} on the GPU, "
                             f"got {n}")
    _validate_values(state, x, idx)


_VALIDATED: set = set()     # layout keys (`_layout_key`) that passed `_validate`


def _validate_values(state, x, idx):
    """The checks that read tensor values: every call on CPU inputs, on the GPU only with
    MAMBA2_CUTILE_CHECK=1 (they synchronize)."""
    if idx is not None and (not x.is_cuda or
                            os.environ.get("MAMBA2_CUTILE_CHECK", "") not in ("", "0")):
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


# ----------------------------------------------------------------------------------------------
# public function

def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None, out_states=None):
    """One decode step (or k steps) of Mamba-2, updating `state` in place; returns y.

    state (nslots, h, p, n) float32/bf16/fp16, updated in place; x, dt, z (batch, h, p) or
    (batch, k, h, p); A (h, p, n); B, C (batch, [k,] g, n); D, dt_bias (h, p) or (h,);
    state_batch_indices (batch,) int (negative: padding row); out_states (batch, k, h, p, n)
    (or (batch, h, p, n) for 3-D x) receives the state after each step.
    Returns y shaped like x, in x's dtype. Per (row, head, channel, state entry, step):

        dt' = softplus?(dt + dt_bias);  state = exp(A dt') state + dt' x B[group]
        y = sum_n state C[group] + D x;  y *= z sigmoid(z)
    """
    key = _layout_key((state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, out_states),
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
    if x.is_cuda:
        _update_cuda(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                     out_states, y, layout_key=key)
    else:
        _update_torch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                      out_states, y)
    return y


def _slots_int32(idx):
    """state_batch_indices as the kernel's int32, value for value: int64 is clamped first (a
    plain cast wraps 2**32 + 1 onto slot 1; clamped, a slot past int32 stays past the state, a
    padding row in the kernel); the narrower integer types convert exactly."""
    if idx.dtype == torch.int64:
        idx = idx.clamp(-1, 2**31 - 1)
    return idx.to(torch.int32)


def _update_cuda(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx, out_states, y,
                 cfg=None, layout_key=None):
    """Launch the kernel. Inputs must already be validated. No host synchronization."""
    import cuda.tile as ct

    if idx is not None and idx.dtype != torch.int32:
        idx = _slots_int32(idx)
    stream = torch.cuda.current_stream(x.device)
    for call in decode_plan(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx,
                            out_states, y, cfg, layout_key=layout_key):
        ct.launch(stream, call.grid, call.kernel, call.args)


def _update_torch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx, out_states, y):
    """The CPU path: the kernel's math in PyTorch, vectorized over rows (float32, or float64
    when the state or x is float64), state kept unrounded across the k steps."""
    x4, dt4, z4, y4, B4, C4 = (_steps(t, 3) for t in (x, dt, z, y, B, C))
    out5 = None if out_states is None else _steps(out_states, 4)
    b, k, h, p = x4.shape
    g = B4.shape[2]
    f64 = torch.float64
    cd = f64 if f64 in (state.dtype, x.dtype) else torch.float32
    slots = torch.arange(b) if idx is None else idx.to(torch.int64)
    padding = slots < 0
    y4[padding] = 0
    rows = torch.nonzero(~padding).flatten()
    slots = slots[rows]
    if rows.numel() == 0 or k == 0:
        return
    cast = lambda t: None if t is None else t.to(cd)  # noqa: E731
    A, D, dt_bias = cast(A), cast(D), cast(dt_bias)
    if D is not None and D.dim() == 1:
        D = D[:, None]
    if dt_bias is not None and dt_bias.dim() == 1:
        dt_bias = dt_bias[:, None]
    s = state[slots].to(cd)                                                    # (r, h, p, n)
    for t in range(k):
        d = dt4[rows, t].to(cd)                                                # (r, h, p)
        if dt_bias is not None:
            d = d + dt_bias
        if dt_softplus:
            d = F.softplus(d)
        xt = x4[rows, t].to(cd)
        Bt = B4[rows, t].to(cd).repeat_interleave(h // g, dim=1)               # (r, h, n)
        Ct = C4[rows, t].to(cd).repeat_interleave(h // g, dim=1)
        s = s * torch.exp(A * d[..., None]) + (d * xt)[..., None] * Bt[:, :, None, :]
        if out5 is not None:
            out5[rows, t] = s.to(out5.dtype)
        yt = (s * Ct[:, :, None, :]).sum(-1)
        if D is not None:
            yt = yt + D * xt
        if z4 is not None:
            zt = z4[rows, t].to(cd)
            yt = yt * (zt * torch.sigmoid(zt))
        y4[rows, t] = yt.to(y4.dtype)
    state[slots] = s.to(state.dtype)


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                               dt_softplus=False, state_batch_indices=None, out_states=None):
    """The definition, in float64, row by row and step by step; `state` is not modified
    (nor `out_states`, accepted only so it takes the same arguments as the real function).

    Returns (y shaped like x, the whole new state (nslots, h, p, n), the state after each
    step (batch, k, h, p, n), zero for padding rows), all float64.
    """
    f = lambda t: None if t is None else t.detach().to(torch.float64)  # noqa: E731
    steps = x.dim() == 4
    x, dt, z, B, C = (None if t is None else (t if steps else t.unsqueeze(1))
                      for t in (x, dt, z, B, C))
    x, dt, z, B, C, A, D, dt_bias = map(f, (x, dt, z, B, C, A, D, dt_bias))
    new = f(state).clone()
    b, k, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if D is not None and D.dim() == 1:
        D = D[:, None].expand(h, p)
    if dt_bias is not None and dt_bias.dim() == 1:
        dt_bias = dt_bias[:, None].expand(h, p)
    dev = x.device
    group = torch.arange(h, device=dev) // (h // g)
    y = torch.zeros(b, k, h, p, dtype=torch.float64, device=dev)
    per_step = torch.zeros(b, k, h, p, n, dtype=torch.float64, device=dev)
    for r in range(b):
        slot = r if state_batch_indices is None else int(state_batch_indices[r])
        if slot < 0:
            continue
        st = new[slot]                                                         # (h, p, n)
        for t in range(k):
            d = dt[r, t]
            if dt_bias is not None:
                d = d + dt_bias
            if dt_softplus:
                d = F.softplus(d)
            dA = torch.exp(A * d[:, :, None])
            st = st * dA + (d * x[r, t])[:, :, None] * B[r, t, group][:, None, :]
            out = (st * C[r, t, group][:, None, :]).sum(-1)
            if D is not None:
                out = out + D * x[r, t]
            if z is not None:
                out = out * z[r, t] * torch.sigmoid(z[r, t])
            y[r, t] = out
            per_step[r, t] = st
        new[slot] = st
    return (y if steps else y[:, 0]), new, per_step


state_update_reference = selective_state_update_ref


# ----------------------------------------------------------------------------------------------
# CPU compile check: the problems whose plans cover every variant the dispatcher picks

def compile_variants():
    """(name, problem dict for `plan_for_problem`): every flag value at least once, the int64
    variant, and the tile-size buckets (NP 16 / 128 / 256, p not a power of two, BLOCK_P 1)."""
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    return [
        ("mamba2-bf16-idx", dict(dtype=bf, state_dtype=bf, layout="head",
                                 options=("D", "z", "bias", "softplus", "idx"))),
        ("mamba2-fp32state-k4-out", dict(dtype=bf, state_dtype=f32, layout="head", k=4,
                                         options=("D", "z", "bias", "softplus", "idx", "out"))),
        ("general-bf16", dict(dtype=bf, state_dtype=bf, layout="general",
                              options=("D", "bias"))),
        ("none-fp16", dict(dtype=f16, state_dtype=f16, layout="head", options=())),
        ("mixed-headD-chanbias", dict(dtype=bf, state_dtype=f32, layout="mixed",
                                      options=("D", "bias", "softplus", "z"))),
        ("int64-state", dict(dtype=bf, state_dtype=bf, layout="head", int64=True,
                             options=("D", "z", "bias", "softplus", "idx"))),
        ("odd-p80-n96", dict(dtype=bf, state_dtype=f32, layout="head", nheads=6, ngroups=3,
                             headdim=80, dstate=96, options=("D", "z", "idx"))),
        ("small-p16-n16", dict(dtype=f32, state_dtype=f32, layout="general", nheads=4,
                               ngroups=1, headdim=16, dstate=16, k=2,
                               options=("D", "out"))),
        ("tiny-p1-n1", dict(dtype=bf, state_dtype=bf, layout="head", nheads=2, ngroups=1,
                            headdim=1, dstate=1, options=("D", "z", "bias", "softplus", "idx"))),
        ("n256-p128", dict(dtype=bf, state_dtype=bf, layout="head", nheads=16, ngroups=2,
                           headdim=128, dstate=256, options=("D", "z", "bias", "softplus"))),
        ("persistent-bf16-idx", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=32, dstate_pad=128, occupancy=4, persistent=4))),
        ("split-n-bf16-out", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx", "out"), config=DecodeConfig(
                block_p=32, dstate_pad=128, occupancy=8, block_n=32))),
        ("split-n-general-n96", dict(dtype=bf, state_dtype=f32, layout="general", nheads=6,
                                     ngroups=3, headdim=80, dstate=96, options=("D", "bias"),
                                     config=DecodeConfig(block_p=16, dstate_pad=128,
                                                         block_n=64, persistent=2))),
        ("flat-no-tma-idx", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=0, flat=1))),
        ("tma-load-only", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=2))),
        ("checked-tma-load-only", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=2, unchecked=0))),
        ("checked-no-tma-idx", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=0, unchecked=0))),
        ("latency-no-tma", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=32, dstate_pad=128, occupancy=8, latency=4, tma=0))),
        ("split-n-latency", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus"), config=DecodeConfig(
                block_p=32, dstate_pad=128, occupancy=8, block_n=64, latency=2))),
        ("no-tma-vec", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=0, tma_vec=0))),
        ("split-n-no-tma", dict(dtype=bf, state_dtype=f32, layout="head", options=("D",),
                                config=DecodeConfig(block_p=32, dstate_pad=128, occupancy=8,
                                                    block_n=32, tma=0, tma_vec=0))),
    ]


ALL_OPTIONS = ("D", "z", "bias", "softplus", "idx", "out")


def plan_for_problem(dtype=torch.bfloat16, state_dtype=None, batch=4, k=None, nheads=128,
                     ngroups=8, headdim=64, dstate=128, layout="head", options=ALL_OPTIONS,
                     int64=False, device="meta", config=None):
    """The decode plan for a problem, on `meta` tensors by default (for compiling).

    layout "head": dt, A, D, dt_bias are per-head expansions (Mamba-2); "general": full
    tensors; "mixed": dt per head with a per-channel dt_bias, general A, D given as (h,).
    k None: the 3-D (one token) form.
    """
    b, h, g, p, n = batch, nheads, ngroups, headdim, dstate
    kk = 1 if k is None else k
    e = lambda *s, dt=dtype: torch.empty(s, dtype=dt, device=device)  # noqa: E731
    lead = (b,) if k is None else (b, kk)
    f32 = torch.float32
    nslots = b + 3
    if int64:
        nslots = max(nslots, -(-(2**31) // (h * p * n)) + 1)
    state = e(nslots, h, p, n, dt=state_dtype or dtype)
    x = e(*lead, h, p)
    if layout == "head":
        dt = e(*lead, h, dt=f32)[..., None].expand(*lead, h, p)
        A = e(h, dt=f32)[:, None, None].expand(h, p, n)
        D = e(h, dt=f32)[:, None].expand(h, p)
        bias = e(h, dt=f32)[:, None].expand(h, p)
    elif layout == "general":
        dt, A, D, bias = e(*lead, h, p, dt=f32), e(h, p, n, dt=f32), e(h, p), e(h, p, dt=f32)
    else:  # mixed
        dt = e(*lead, h, dt=dtype)[..., None].expand(*lead, h, p)
        A, D, bias = e(h, p, n, dt=f32), e(h, dt=f32), e(h, p, dt=f32)
    opt = lambda name, t: t if name in options else None  # noqa: E731
    out = e(b, kk, h, p, n, dt=state_dtype or dtype) if "out" in options else None
    if out is not None and k is None:
        out = out[:, 0]
    return decode_plan(state, x, dt, A, e(*lead, g, n), e(*lead, g, n), opt("D", D),
                       opt("z", e(*lead, h, p)), opt("bias", bias), "softplus" in options,
                       opt("idx", e(b, dt=torch.int32)), out, torch.empty_like(x), config)
