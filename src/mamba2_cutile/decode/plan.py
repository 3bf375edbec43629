"""The decode launch: its config, and the plan of one `selective_state_update` call.

The variant, grid and flags depend only on shapes, strides and dtypes, so they are computed
once per layout and cached (decode runs once per token: the Python cost is the latency).
Per-head layouts are detected from the strides: dt, A, D and dt_bias usually are stride-0
expansions of per-head values, and the kernel then reads the compact per-head view (DT_HEAD /
A_HEAD / D_MODE=1 / BIAS_MODE=1). Plans work on `meta` tensors: nothing here reads values.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .. import config as _config
from ..kernels.state_update import state_update, state_update_i64
from ..runtime import (DEFAULT_SMS, KernelCall, narrow_unit_strides, needs_int64, next_pow2,
                       num_sms, tileiras_version, version_at_least, with_hints)

MAX_DSTATE = 256           # the whole (padded) dstate is one tile
TILE_ELEMS = 8192          # state elements per program at most (BLOCK_P * NP)


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

    FIXED = ("dstate_pad",)     # set by the problem, never overridden

    def __post_init__(self):
        c = _config
        c.check_pow2(self, "block_p", "dstate_pad")
        c.check_pow2(self, "block_n", allow_zero=True)
        c.check_range(self, "occupancy", 0, 32)
        c.check_range(self, "persistent", 0, 64)
        c.check_choice(self, "flat", (0, 1))
        if self.flat and self.persistent:
            raise ValueError(f"DecodeConfig: flat={self.flat} needs persistent=0, got "
                             f"persistent={self.persistent}")
        c.check_choice(self, "warps", (0, 4, 8))     # what tileiras 13.4 accepts (0: its choice)
        c.check_range(self, "latency", 0, 10)
        c.check_choice(self, "unchecked", (0, 1))
        c.check_choice(self, "tma", (0, 1, 2))
        c.check_choice(self, "tma_vec", (0, 1))


def decode_config(batch, nheads, headdim, dstate, sms=DEFAULT_SMS) -> DecodeConfig:
    """The dispatcher's tile choice, from the shape alone (no search, no sync).

    The kernel is memory-bound: what matters is the bytes in flight per SM and how they move.
    Measured on the H200 (batch 1-256, H=128 P=64 N=128 G=8, bf16 state;
    benchmarks/results/2026-11-30-h200-decode-sweep-plain-state-loads.jsonl): 64-channel tiles loaded and stored without TMA (plain vector accesses, no SMEM
    round trip) at 4 programs per SM reach 3.4 TB/s at batch 64 and 3.6 TB/s at batch 256,
    against 2.8 / 3.0 TB/s for the best TMA config (32-channel tiles, 8 per SM); grids of
    under 4 programs per SM (batch 1-4 here) do better with 2 per SM (measured at batch 1
    and 2).
    """
    np_ = max(16, next_pow2(dstate))
    bp = min(64, next_pow2(headdim), max(4, TILE_ELEMS // np_))
    programs = batch * nheads * -(-headdim // bp)
    occupancy = 4 if programs >= 4 * sms else 2
    cfg = DecodeConfig(block_p=bp, dstate_pad=np_, occupancy=occupancy, tma=0)
    return _config.with_env(cfg, _config.ENV_DECODE)


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


def steps_view(t, ndim3):
    """The k-step form: insert k = 1 into a 3-D x/dt/z/B/C/y (a view)."""
    return None if t is None else (t.unsqueeze(1) if t.dim() == ndim3 else t)


@functools.lru_cache(maxsize=None)
def _unchecked_supported() -> bool:
    """Whether the tileiras cuda-tile runs takes `check_bounds=False` (13.4 and later; cuda-tile
    1.7 also runs with 13.2 and 13.3). Unknown counts as no: the checked kernel is slower,
    never wrong."""
    return version_at_least(tileiras_version(), 13, 4)


def layout_signature(tensors, dt_softplus):
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
    `layout_key`: `layout_signature` of (state, x, dt, A, B, C, D, z, dt_bias, original indices,
    out_states), when the caller has it already.
    """
    if x.shape[0] == 0 or (x.dim() == 4 and x.shape[1] == 0):
        return []
    # The variant, grid and flags depend only on shapes, strides and dtypes: decode is called
    # once per token, so they are computed once per layout (the Python cost is the latency).
    if layout_key is None:
        layout_key = layout_signature((state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices,
                                  out_states), dt_softplus)
    key = (layout_key, (y.shape, y.stride(), y.dtype), state_batch_indices is not None, cfg,
           os.environ.get(_config.ENV_DECODE))
    x4, dt4, z4, y4 = (steps_view(t, 3) for t in (x, dt, z, y))
    B4, C4 = steps_view(B, 3), steps_view(C, 3)
    out5 = None if out_states is None else steps_view(out_states, 4)
    static = _PLAN_CACHE.get(key)
    if static is None:
        static = _static_plan(state, x4, dt4, A, B4, C4, D, z4, dt_bias, dt_softplus,
                              state_batch_indices, out5, y4, cfg, x)
        if len(_PLAN_CACHE) > 256:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = static
    kernel, grid, dt_head, a_head, d_mode, bias_mode, flags, narrow = static
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
    if narrow:
        args = tuple(narrow_unit_strides(a) for a in args)
    return [KernelCall(kernel, grid, args)]


_PLAN_CACHE: dict = {}


def _static_plan(state, x4, dt4, A, B4, C4, D, z4, dt_bias, dt_softplus, state_batch_indices,
                 out5, y4, cfg, x):
    b, k, h, p = x4.shape
    g, n = B4.shape[2], B4.shape[3]
    if cfg is None:
        cfg = decode_config(b, h, p, n, num_sms(x))
    dt_head = _per_head(dt4, (3,))
    dt_arg = dt4[..., 0] if dt_head else dt4
    a_head = _per_head(A, (1, 2))
    a_arg = A[:, 0, 0] if a_head else A
    d_mode, d_arg = _head_mode(D)
    bias_mode, bias_arg = _head_mode(dt_bias)
    int64 = needs_int64(state, x4, dt_arg, a_arg, B4, C4, d_arg, z4, bias_arg, out5, y4)
    kernel = with_hints(state_update_i64 if int64 else state_update, cfg.occupancy, cfg.warps)
    block_n = min(cfg.block_n, cfg.dstate_pad) if cfg.block_n and k == 1 else 0
    # every state tile inside the state: the kernel may drop its bounds checks (it maps a
    # slot past the state to a padding row itself)
    inside = p % cfg.block_p == 0 and n % (block_n or cfg.dstate_pad) == 0 \
        and _unchecked_supported()
    flags = (cfg.block_p, cfg.dstate_pad, h // g, dt_head, a_head, d_mode, bias_mode,
             z4 is not None, bool(dt_softplus), state_batch_indices is not None,
             out5 is not None, bool(cfg.persistent or cfg.flat), block_n,
             cfg.latency, cfg.tma != 0, cfg.tma == 1, bool(cfg.tma_vec),
             bool(cfg.unchecked) and inside)
    tiles = b * h * -(-p // cfg.block_p)
    # flat: the persistent loop with one program per tile, in memory order
    grid = ((min(tiles, cfg.persistent * num_sms(x)), 1, 1) if cfg.persistent
            else (tiles, 1, 1) if cfg.flat else (b, h, -(-p // cfg.block_p)))
    # a size-1 dimension whose stride passes int32 (a batch-1 view of a larger tensor): narrowed
    # per call (runtime.narrow_unit_strides); decided once per layout, like the rest
    narrow = any(narrow_unit_strides(t) is not t for t in (
        state, x4, dt_arg, a_arg, B4, C4, d_arg, z4, bias_arg, out5, y4, state_batch_indices))
    return kernel, grid, dt_head, a_head, d_mode, bias_mode, flags, narrow
