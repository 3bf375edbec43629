"""The causal conv1d launches: the config, the dispatcher's rule, the plans (lists of
`runtime.KernelCall`, built on any device, `meta` included) and the CUDA launchers.

Layouts. x (batch, dim, seqlen) is read in its physical order, without a copy: with
x.stride(2) == 1 as (batch, dim, seqlen) ("contiguous"), else with x.stride(1) == 1 as the
(batch, seqlen, dim) view x.transpose(1, 2) ("channel-last", e.g. a channel slice of one
in_proj output); any other strides are copied to contiguous first. Outputs (out, dx) are
allocated in x's layout family: channel-last x gives out = empty(batch, seqlen, dim)
.transpose(1, 2). Nothing here reads tensor values (CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import config as _config
from ..kernels.causal_conv1d_bwd import causal_conv1d_bwd, causal_conv1d_bwd_i64
from ..kernels.causal_conv1d_bwd_stream import (causal_conv1d_bwd_stream,
                                                 causal_conv1d_bwd_stream_i64)
from ..kernels.causal_conv1d_fwd import causal_conv1d_fwd, causal_conv1d_fwd_i64
from ..kernels.causal_conv1d_fwd_stream import (causal_conv1d_fwd_stream,
                                                 causal_conv1d_fwd_stream_i64)
from ..kernels.causal_conv1d_bwd_rows import causal_conv1d_bwd_rows, causal_conv1d_bwd_rows_i64
from ..kernels.causal_conv1d_fwd_rows import causal_conv1d_fwd_rows, causal_conv1d_fwd_rows_i64
from ..kernels.causal_conv1d_fwd_taps import causal_conv1d_fwd_taps, causal_conv1d_fwd_taps_i64
from ..kernels.causal_conv1d_update import (causal_conv1d_state_copy,
                                            causal_conv1d_state_copy_i64,
                                            causal_conv1d_update, causal_conv1d_update_i64)
from ..runtime import DEFAULT_SMS, KernelCall, launch_calls, needs_int64, next_pow2, num_sms, \
    sum_partials_call, with_hints

ENV_CONV1D = "MAMBA2_CUTILE_CONV1D_CONFIG"
MAX_WIDTH = 8
#: Conv1dConfig.form -> ((forward, forward 64-bit), (backward, backward 64-bit)) kernels
FORMS = {
    0: ((causal_conv1d_fwd, causal_conv1d_fwd_i64), (causal_conv1d_bwd, causal_conv1d_bwd_i64)),
    1: ((causal_conv1d_fwd_stream, causal_conv1d_fwd_stream_i64),
        (causal_conv1d_bwd_stream, causal_conv1d_bwd_stream_i64)),
    2: ((causal_conv1d_fwd_taps, causal_conv1d_fwd_taps_i64),
        (causal_conv1d_bwd_stream, causal_conv1d_bwd_stream_i64)),
    3: ((causal_conv1d_fwd_rows, causal_conv1d_fwd_rows_i64),
        (causal_conv1d_bwd_rows, causal_conv1d_bwd_rows_i64)),
}
#: the largest block_d (form 3's row tiles are (1, block_d): 1024 bf16 channels is 16 bytes a
#: thread at 4 warps)
MAX_BLOCK_D = 1024


@dataclass(frozen=True)
class Conv1dConfig:
    """Tile sizes (powers of two) of the conv1d kernels.

    block_l x block_d: the (tokens, channels) tile of the forward; tiles: token blocks per
    forward program. bwd_*: the same for the backward (its programs also sum dweight/dbias
    partials over their bwd_tiles blocks). shift_tma: 1 lets the token-shifted loads use TMA
    (0: plain loads, which hit L1 for the overlapping taps). occupancy: hint for both (0: the
    compiler's choice; for form 3 see ctas_hint). form: which kernels, 0 =
    `causal_conv1d_fwd` / `causal_conv1d_bwd`
    (every tap behind a head/x/zero branch; the backward keeps its 2W-1 input tiles), 1 = the
    streamed ones (`causal_conv1d_fwd_stream` / `causal_conv1d_bwd_stream`: branch-free taps
    in interior blocks, the backward's taps streamed through a W-tile window), 2 = form 1
    with the forward `causal_conv1d_fwd_taps` (channel-last x of at least width tokens: each
    tap an aligned load of an overlapping (batch, width, seqlen-width+1, dim) view; other
    inputs take form 1's forward), 3 = the row-streaming kernels (`causal_conv1d_fwd_rows` /
    `causal_conv1d_bwd_rows`, channel-last x only, other layouts take form 1: every input row
    read once, the last W-1 rows carried in registers). span, rows, row_tile (form 3): tokens
    per forward program (0: `rows_span` picks it from the shape; else any multiple of rows
    from max(8, rows) to 65536, a run-time kernel argument, so no compile per span), rows per
    unrolled step, 1 = one (rows, block_d) tile load per step with the rows extracted on chip
    (0: one (1, block_d) load per row); bwd_span, bwd_rows, bwd_row_tile: the same for the
    backward. ctas_per_sm, bwd_ctas_per_sm (form 3, 1..32): the CTAs an SM is taken to hold
    at once, whose CTA slots (ctas_per_sm x SMs) the automatic span fills in whole waves
    (`rows_span`): 8 for the forward (the sm_90 compile needs 80 registers, 6 per SM, and 64
    under the occupancy-8 hint it gets by default at 16-bit inputs; unhinted variants fill
    at most 6), 8 for the backward (82 registers unhinted, 6 per SM; 64 under the
    occupancy-8 hint). ctas_hint (form 3): 1 gives the forward the hint
    occupancy=ctas_per_sm and the backward bwd_occupancy=bwd_ctas_per_sm when `occupancy` /
    `bwd_occupancy` is 0, where that compiles without spills (`rows_forward_occupancy`,
    `rows_backward_occupancy`: 16-bit, 32-bit indexing, the dispatcher's tiles; 0: no hint;
    a set occupancy always wins). prefetch, bwd_prefetch:
    1 issues the next step's loads before the current step's math (software pipelining in
    registers). unchecked
    (forms 1, 3): 1 lets interior blocks skip the bounds checks of their loads and stores when
    block_d divides dim (and tileiras is 13.4+; otherwise it has no effect). warps: the
    num_worker_warps hint (0: the compiler's choice; 4 or 8). store_tma (form 1): 1 lets the
    output stores use TMA. bwd_occupancy, bwd_warps: the
    backward's own hints (0: occupancy, warps). bwd_reduce: 1 sums the backward's dweight /
    dbias partials and casts them in one launch of `kernels.sum_partials` (0: `torch.sum`, a
    transpose and casts, five launches with a bias)."""
    block_l: int = 32
    block_d: int = 128
    tiles: int = 1
    bwd_block_l: int = 16
    bwd_block_d: int = 64
    bwd_tiles: int = 8
    shift_tma: int = 0
    occupancy: int = 0
    form: int = 0
    unchecked: int = 1
    warps: int = 0
    store_tma: int = 0
    bwd_occupancy: int = 0
    bwd_warps: int = 0
    span: int = 0
    rows: int = 8
    row_tile: int = 0
    bwd_span: int = 0
    bwd_rows: int = 8
    bwd_row_tile: int = 0
    prefetch: int = 0
    bwd_prefetch: int = 0
    ctas_per_sm: int = 8
    bwd_ctas_per_sm: int = 8
    ctas_hint: int = 1
    bwd_reduce: int = 1

    FIXED = ()

    def __post_init__(self):
        c = _config
        c.check_choice(self, "bwd_reduce", (0, 1))
        c.check_pow2(self, "block_l", "bwd_block_l")
        for name, hi in (("block_d", MAX_BLOCK_D), ("bwd_block_d", MAX_BLOCK_D), ("rows", 64),
                         ("bwd_rows", 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1) or v > hi:
                raise ValueError(f"Conv1dConfig: {name}={v!r} is not a power of two in 1..{hi}")
        for name in ("block_d", "bwd_block_d"):
            if self.form != 3 and getattr(self, name) > 256:
                # forms 0-2 hold (block_l, block_d) tiles per tap: built and compiled up to 256
                raise ValueError(f"Conv1dConfig: {name}={getattr(self, name)} above 256 needs "
                                 f"form=3 (form={self.form})")
        for span, rows in (("span", "rows"), ("bwd_span", "bwd_rows")):
            v, r = getattr(self, span), getattr(self, rows)
            if v == 0:
                continue            # automatic (`rows_span`)
            if not isinstance(v, int) or not max(8, r) <= v <= 65536 or v % r:
                raise ValueError(f"Conv1dConfig: {span}={v!r} must be 0 (automatic) or a "
                                 f"multiple of {rows}={r} from {max(8, r)} to 65536 (at least "
                                 f"8: the width-1 halo lies in the previous span)")
        c.check_choice(self, "row_tile", (0, 1))
        c.check_choice(self, "bwd_row_tile", (0, 1))
        c.check_choice(self, "prefetch", (0, 1))
        c.check_choice(self, "bwd_prefetch", (0, 1))
        for name in ("block_l", "bwd_block_l"):
            if getattr(self, name) < 8:
                raise ValueError(f"Conv1dConfig: {name}={getattr(self, name)} must be at "
                                 "least 8 (the width-1 halo of a block lies in the previous one)")
        c.check_range(self, "tiles", 1, 64)
        c.check_range(self, "bwd_tiles", 1, 64)
        c.check_choice(self, "shift_tma", (0, 1))
        c.check_range(self, "occupancy", 0, 32)
        c.check_choice(self, "form", tuple(FORMS))
        c.check_choice(self, "unchecked", (0, 1))
        c.check_range(self, "bwd_occupancy", 0, 32)
        c.check_choice(self, "warps", (0, 4, 8))
        c.check_choice(self, "store_tma", (0, 1))
        c.check_choice(self, "bwd_warps", (0, 4, 8))
        c.check_range(self, "ctas_per_sm", 1, 32)
        c.check_range(self, "bwd_ctas_per_sm", 1, 32)
        c.check_choice(self, "ctas_hint", (0, 1))


def conv1d_config(batch, dim, seqlen, channel_last, sms=DEFAULT_SMS,
                  width=4) -> Conv1dConfig:
    """The dispatcher's tiles, from the shape alone (no search, no sync).

    Channel-last tiles are wide along the channels (64 bf16 channels are 128-byte rows),
    contiguous-layout tiles long along the tokens (form 0 there: 32x32 at 216 registers in the
    sm_90 CPU compile, where 64x32 spills 96 bytes). Above width 4 the blocks hold half the
    tokens (more taps live). The backward's programs walk up to 8 token blocks (so that the
    dweight partials stay ~1% of the traffic) but keep at least 4 programs per SM.
    Channel-last inputs up to width 4 take the row-streaming kernels (form 3: each x and dout
    row read once, the last width-1 rows carried in registers): 256-channel forward programs
    and 128-channel backward ones, 8 rows per step, no prefetch, spans chosen by `rows_span`
    to fill whole waves of 8 CTAs per SM (forward and backward), under the matching
    occupancy hints where they compile without spills (else the forward's spans fill 6).
    Timed on the H200 (bf16, width 4, SiLU + bias, kernel alone in a CUDA graph, L2 flushed,
    median of 10; benchmarks/results/2026-12-02-h200-conv1d-rows-sweep.txt and
    ...-conv1d-waves-sweep.txt): forward 0.259 -> 0.108 ms at (1, 16384, 5376) and 0.326 ->
    0.153 ms at (1, 65536, 1792) against form 1 (32-34% -> 71-76% of 4.3 TB/s), backward
    1.047 -> 0.189 ms and 1.388 -> 0.247 ms (12% -> 65-66%; 70% at (4, 8192, 10240));
    power-of-two spans of 512 tokens
    gave 0.124 / 0.158 and 0.207 / 0.250 ms; prefetching, 4 or 16 rows per step, 8 warps and
    row tiles were slower. Backward, where 256 divides dim: 256-channel programs (two
    channels per thread) at 7 per SM under the occupancy-7 hint, 0.1886 -> 0.1602,
    0.2462 -> 0.2119 and 0.7026 -> 0.6201 ms (65-67% -> 75-77%) at (1, 16384, 5376),
    (1, 65536, 1792) and (4, 8192, 10240) (...-conv1d-bwd-256-occupancy-sweep.txt; 8 per
    SM 0.1596 / 0.2097 / 0.7540, 6 per SM 0.1729 / 0.2287 / 0.6396). Wider
    filters keep form 1 (streamed taps, 32 x 64 forward tiles: 0.404 -> 0.258 ms against form 0
    at (1, 16384, 5376), benchmarks/results/2026-12-01-h200-conv1d-form-sweep.txt), as form 3
    was timed at width 4 only; the tap-view forward (form 2) was slower than form 1. The
    contiguous layout keeps form 0 (not timed).
    `MAMBA2_CUTILE_CONV1D_CONFIG="field=value,..."` overrides any field.
    """
    if channel_last and width <= 4:
        cfg = dict(block_l=32, block_d=256, bwd_block_l=16, bwd_block_d=128, form=3, rows=8,
                   bwd_rows=8)
        if dim % 256 == 0:
            # two channels per thread (32-bit loads and stores) at 7 per SM under the
            # occupancy-7 hint (72 registers, no stack): twice the bytes in flight per warp
            cfg.update(bwd_block_d=256, bwd_ctas_per_sm=7)
    elif channel_last:
        cfg = dict(block_l=32, block_d=64, bwd_block_l=16, bwd_block_d=64, form=1)
    else:
        cfg = dict(block_l=32, block_d=32, bwd_block_l=32, bwd_block_d=32)
    if width > 4:
        cfg["block_l"] = max(8, cfg["block_l"] // 2)
        cfg["bwd_block_l"] = max(8, cfg["bwd_block_l"] // 2)
    blocks = -(-seqlen // cfg["bwd_block_l"]) * -(-dim // cfg["bwd_block_d"]) * batch
    tiles = 8
    while tiles > 1 and blocks // tiles < 4 * sms:
        tiles //= 2
    return _config.with_env(Conv1dConfig(**cfg, bwd_tiles=tiles), ENV_CONV1D)


# ---------------------------------------------------------------------------------- layouts

def is_channel_last(x) -> bool:
    """Whether x (batch, dim, seqlen) is read as the (batch, seqlen, dim) view (unit channel
    stride) rather than as itself (unit token stride)."""
    return x.stride(2) != 1 and x.stride(1) == 1


def kernel_layout(x):
    """(x readable by the kernels, channel_last): x itself when one of its two inner strides
    is 1 (and no stride-0 expansion), else a contiguous copy."""
    if x.stride(2) != 1 and x.stride(1) != 1 or any(
            st == 0 and sz > 1 for st, sz in zip(x.stride(), x.shape)):
        x = x.contiguous()
    return x, is_channel_last(x)


def physical(t, channel_last):
    """The view the kernels index: (batch, seqlen, dim) for channel-last, else t itself."""
    return t.transpose(1, 2) if channel_last else t


def empty_like_layout(x, channel_last, dtype=None):
    """A new (batch, dim, seqlen) tensor in x's layout family (contiguous physical view)."""
    b, d, l = x.shape
    dtype = dtype or x.dtype
    if channel_last:
        return torch.empty(b, l, d, dtype=dtype, device=x.device).transpose(1, 2)
    return torch.empty(b, d, l, dtype=dtype, device=x.device)


def in_layout(t, channel_last):
    """t (batch, dim, seqlen) in the given layout family, copied only when it is not."""
    p = physical(t, channel_last)
    if p.stride(-1) != 1 or any(st == 0 and sz > 1 for st, sz in zip(p.stride(), p.shape)):
        p = p.contiguous()
    return physical(p, channel_last)


# ---------------------------------------------------------------------------------- plans

def halo_rows(width) -> int:
    """width - 1 rounded up to a power of two."""
    return next_pow2(max(width - 1, 1))


def head_front(width) -> int:
    """Tokens before token 0 in a head (see `kernels.causal_conv1d_common`): the backward's
    first-block taps reach back to 2 - 2*width."""
    return 2 * halo_rows(width)


def make_head(t, front, block_l, width, channel_last):
    """The head of t (batch, dim, seqlen): e(u) for u = -head_front .. block_l-1, with
    `front` (batch, dim, width-1) (the initial states) just before token 0 and zeros elsewhere
    outside t; in t's layout family. A small copy (block_l + 4 * (width-1) tokens at most)."""
    b, d, l = t.shape
    hf = head_front(width)
    head = torch.zeros(b, d, hf + block_l, dtype=t.dtype, device=t.device)
    if channel_last:
        head = torch.zeros(b, hf + block_l, d, dtype=t.dtype, device=t.device).transpose(1, 2)
    n = min(l, block_l)
    head[..., hf:hf + n] = t[..., :n]
    if front is not None:
        head[..., hf - (width - 1):hf] = front
    return head


def make_id_head(seq_idx, block_l, width):
    """The ids of the head: the row's first id before token 0, seq_idx, 0 past the end."""
    b, l = seq_idx.shape
    hf = head_front(width)
    head = torch.zeros(b, hf + block_l, dtype=torch.int32, device=seq_idx.device)
    head[:, :hf] = seq_idx[:, :1]
    n = min(l, block_l)
    head[:, hf:hf + n] = seq_idx[:, :n]
    return head


def _unchecked(cfg, dim, block_d) -> bool:
    """The form-1 kernels' UNCHECKED: interior blocks skip bounds checks (every tile inside the
    tensors needs a full channel block; check_bounds=False needs tileiras 13.4+)."""
    return bool(cfg.unchecked) and dim % block_d == 0 and unchecked_supported()


def unchecked_supported() -> bool:
    """Whether tileiras takes check_bounds=False (13.4+; see `decode.plan`)."""
    from ..decode.plan import _unchecked_supported
    return _unchecked_supported()


def forward_plan(x, weight_t, bias, initial_states, seq_idx, out, final, silu,
                 cfg: Conv1dConfig | None = None):
    """The forward launch. x and out in one layout family (see `kernel_layout`), weight_t
    (width, dim) contiguous, seq_idx int32 (batch, seqlen), final (batch, dim, width-1) or None.
    Builds the heads (small copies; nothing reads values on the host)."""
    b, d, l = x.shape
    w = weight_t.shape[0]
    cl = is_channel_last(x)
    if cfg is None:
        cfg = conv1d_config(b, d, l, cl, num_sms(x), w)
    cfg = fit_grid(cfg, l, cfg.form == 3 and cl, backward=False)
    xp, op = physical(x, cl), physical(out, cl)
    if cfg.form == 2 and cl and l >= w:
        return [_taps_forward_call(xp, op, weight_t, bias, initial_states, seq_idx, final,
                                   silu, cfg, x)]
    if cfg.form == 3 and cl:
        return [_rows_forward_call(xp, op, weight_t, bias, initial_states, seq_idx, final,
                                   silu, cfg)]
    form = 1 if cfg.form in (2, 3) else cfg.form
    kernel = FORMS[form][0][1 if needs_int64(xp, op) else 0]
    kernel = with_hints(kernel, cfg.occupancy, cfg.warps)
    head = physical(make_head(x, initial_states, cfg.block_l, w, cl), cl)
    id_head = make_id_head(seq_idx, cfg.block_l, w) if seq_idx is not None else weight_t
    stand_in = weight_t
    grid = (-(-d // cfg.block_d), -(-(-(-l // cfg.block_l)) // cfg.tiles), b)
    # stand-ins for absent arrays are small (head): an unread stand-in still passes through
    # ct.launch's stride check, which x's 64-bit strides fail outside the int64 variants' list
    args = (xp, head, weight_t, bias if bias is not None else stand_in,
            seq_idx if seq_idx is not None else stand_in, id_head, op,
            final if final is not None else head,
            w, halo_rows(w), head_front(w), cfg.block_l, cfg.block_d, cfg.tiles, cl,
            bias is not None, seq_idx is not None, bool(silu), final is not None,
            bool(cfg.shift_tma))
    if form == 1:
        args += (_unchecked(cfg, d, cfg.block_d), bool(cfg.store_tma))
    return [KernelCall(kernel, grid, args)]


#: form 3's longest automatic span (the halo re-read, (W-1)/span, stays under 0.6% above it)
#: and its shortest (4.7% at width 4)
ROWS_SPAN_MAX, ROWS_SPAN_MIN = 512, 64
#: CUDA's limit on a grid's second (and third) dimension: the token axis of every conv1d grid
MAX_GRID_Y = 65535


def fit_grid(cfg: Conv1dConfig, seqlen: int, rows: bool, backward: bool) -> Conv1dConfig:
    """cfg with a grid whose token axis stays within MAX_GRID_Y programs (a 2^21-token sequence
    is 65537 blocks of 32), for the launch at hand: `rows` (form 3, channel-last x) checks a
    set span / bwd_span (the automatic spans grow by themselves, `rows_span`); otherwise
    tiles (forward) or bwd_tiles (`backward`) grow to enough token blocks per program.
    Raises ValueError where a set span, or even 64 blocks per program, cannot fit."""
    if rows:
        span = "bwd_span" if backward else "span"
        v = getattr(cfg, span)
        if v and -(-seqlen // v) > MAX_GRID_Y:
            raise ValueError(f"Conv1dConfig: {span}={v} cuts seqlen={seqlen} into more than "
                             f"{MAX_GRID_Y} spans (the grid's limit): use a longer span or 0")
        return cfg
    tiles, block_l = ("bwd_tiles", "bwd_block_l") if backward else ("tiles", "block_l")
    need = -(-(-(-seqlen // getattr(cfg, block_l))) // MAX_GRID_Y)
    if need <= getattr(cfg, tiles):
        return cfg
    if need > 64:
        raise ValueError(f"x: seqlen={seqlen} is too long for the conv1d grid at {block_l}="
                         f"{getattr(cfg, block_l)} (at most {64 * MAX_GRID_Y} blocks)")
    return replace(cfg, **{tiles: need})


def rows_span(span, rows, batch, dim, seqlen, block_d, sms, ctas_per_sm) -> int:
    """Form 3's tokens per program: `span` when set, else (0) the span whose grid fills whole
    waves of the GPU's CTA slots.

    With blocks = batch * cdiv(dim, block_d) channel blocks and slots = ctas_per_sm * sms
    programs resident at once, each row is cut into k spans:

        k_min = cdiv(seqlen, 512)                         (spans of at most 512 tokens)
        waves = cdiv(blocks * k_min, slots)
        k     = max(k_min, floor(waves * slots / blocks))
        span  = max(round_up(cdiv(seqlen, k), rows), 64 rounded up to rows)

    so blocks * cdiv(seqlen, span) <= waves * slots: the last wave is as full as the rows
    allow (a power-of-two span leaves it part empty: 672 programs on 924 slots at (1, 16384,
    5376)), and the span stays a multiple of rows, at most 512 and at least 64 tokens (short
    sequences then take fewer programs). Bandwidth was measured to follow the resident CTAs
    (H200: 512-token spans 66-70% of 4.3 TB/s at 5-7 programs per SM, 74% under the
    occupancy-8 hint)."""
    if span:
        return span
    blocks = -(-dim // block_d) * batch
    slots = ctas_per_sm * sms
    k_min = -(-seqlen // ROWS_SPAN_MAX)
    waves = -(-(blocks * k_min) // slots)
    k = max(k_min, waves * slots // blocks)
    span = -(-(-(-seqlen // k)) // rows) * rows
    # past 512 * 65535 tokens the spans grow beyond 512 (the grid's token axis limit)
    longest = -(-(-(-seqlen // MAX_GRID_Y)) // rows) * rows
    return max(span, -(-ROWS_SPAN_MIN // rows) * rows, longest)


#: CTAs per SM of form 3's forward without an occupancy hint (sm_90 CPU compile, bf16, bias +
#: SiLU, width 4, block_d 256, rows 8: 80 registers)
ROWS_FWD_CTAS_UNHINTED = 6


def rows_forward_occupancy(cfg, xp, op, width) -> tuple:
    """(CTAs per SM the forward's automatic span fills, its occupancy hint; 0 = none).

    A set `occupancy` is the hint, with ctas_per_sm. Else, under ctas_hint, the hint is
    ctas_per_sm for the variants whose sm_90 compile fits its register budget (64 at 8 per
    SM) without spilling: 16-bit x, 32-bit indexing, width <= 4, block_d <= 256, rows <= 8,
    no row tile (CPU compile: 60-64 registers, no stack; float32 inputs spill 24 bytes,
    64-bit indexing 170-250, 16 rows 400, row tiles 8). The others run unhinted and their
    span fills min(ctas_per_sm, 6) CTAs per SM (`ROWS_FWD_CTAS_UNHINTED`)."""
    if cfg.occupancy:
        return cfg.ctas_per_sm, cfg.occupancy
    lean = (xp.dtype in (torch.float16, torch.bfloat16) and not needs_int64(xp, op)
            and width <= 4 and cfg.block_d <= 256 and cfg.rows <= 8 and not cfg.row_tile
            and cfg.warps in (0, 4))            # 8 warps: 5 CTAs per SM fit, not 8
    if cfg.ctas_hint and lean:
        return cfg.ctas_per_sm, cfg.ctas_per_sm
    return min(cfg.ctas_per_sm, ROWS_FWD_CTAS_UNHINTED), 0


def rows_backward_occupancy(cfg, xp, dop, dxp, width) -> int:
    """The backward's occupancy hint (0 = none): a set bwd_occupancy (or occupancy), else
    under ctas_hint bwd_ctas_per_sm for the lean variants: 16-bit x, 32-bit indexing,
    width <= 4, bwd_block_d <= 256 dividing dim (the unchecked interior loads; a partial
    channel block's checks cost 8 bytes of stack), bwd_rows <= 8, no row tile (sm_90, bf16
    and fp16, bias + SiLU: 64 registers at 8 per SM, no stack; with seq_idx, or with initial
    and final states, 62-64 and no stack; with all three 64 and 24 bytes of stack, untimed).
    fp16 at width 4 and bwd_prefetch=1 spill 16 bytes under the hint (untimed) but keep it:
    unhinted, fp16 with every option takes 163 registers (3 per SM) and bf16 bias + SiLU with
    bwd_prefetch 105 (4 per SM). H200, bf16, width 4 (2026-12-02 conv1d waves sweep): 0.2019
    -> 0.1936 ms at (1, 16384, 5376), 0.2660 -> 0.2521 at (1, 65536, 1792), 0.8456 -> 0.7243
    at (4, 8192, 10240) against 6 per SM unhinted; 8 per SM under the occupancy-8 hint 0.1921
    -> 0.1891, 0.2517 -> 0.2473, 0.6893 -> 0.6695 ms against 7 (2026-12-02 conv1d backward
    sweep, benchmarks/results/2026-12-02-h200-conv1d-bwd-ctas-norm-sweeps.txt). The
    automatic span fills bwd_ctas_per_sm
    per SM either way (the grid, and so the dweight partials, must not depend on the hint)."""
    if cfg.bwd_occupancy or cfg.occupancy:
        return cfg.bwd_occupancy or cfg.occupancy
    lean = (xp.dtype in (torch.float16, torch.bfloat16) and not needs_int64(xp, dop, dxp)
            and width <= 4 and cfg.bwd_block_d <= 256 and cfg.bwd_rows <= 8
            and not cfg.bwd_row_tile and _unchecked(cfg, xp.shape[2], cfg.bwd_block_d)
            and (cfg.bwd_warps or cfg.warps) in (0, 4))
    return cfg.bwd_ctas_per_sm if cfg.ctas_hint and lean else 0


def rows_spans(cfg, batch, dim, seqlen, sms, fwd_ctas=None) -> tuple:
    """(forward span, backward span) of form 3 at cfg (see `rows_span`); fwd_ctas: the
    forward's CTAs per SM (`rows_forward_occupancy`; default cfg.ctas_per_sm)."""
    return (rows_span(cfg.span, cfg.rows, batch, dim, seqlen, cfg.block_d, sms,
                      fwd_ctas or cfg.ctas_per_sm),
            rows_span(cfg.bwd_span, cfg.bwd_rows, batch, dim, seqlen, cfg.bwd_block_d, sms,
                      cfg.bwd_ctas_per_sm))


def _rows_silu(silu, xp) -> int:
    """Form 3's SILU: 0 none, 1 IEEE float32 (float32 inputs), 2 the approximate exp2 and
    reciprocal (16-bit inputs, whose output rounding dwarfs their error)."""
    if not silu:
        return 0
    return 2 if xp.dtype in (torch.float16, torch.bfloat16) else 1


def _rows_forward_call(xp, op, weight_t, bias, initial_states, seq_idx, final, silu, cfg):
    """Form 3's forward launch (`kernels.causal_conv1d_fwd_rows`), channel-last x: no head
    copies (the first span's halo is read from initial_states itself)."""
    b, l, d = xp.shape
    w = weight_t.shape[0]
    kernel = FORMS[3][0][1 if needs_int64(xp, op) else 0]
    ctas, occupancy = rows_forward_occupancy(cfg, xp, op, w)
    kernel = with_hints(kernel, occupancy, cfg.warps)
    stand_in = weight_t
    span = rows_spans(cfg, b, d, l, num_sms(xp), ctas)[0]
    grid = (-(-d // cfg.block_d), -(-l // span), b)
    args = (xp, weight_t, bias if bias is not None else stand_in,
            initial_states if initial_states is not None else stand_in,
            seq_idx if seq_idx is not None else stand_in, op,
            final if final is not None else stand_in,
            w, span, cfg.rows, cfg.block_d, bias is not None, initial_states is not None,
            seq_idx is not None, _rows_silu(silu, xp), final is not None, bool(cfg.row_tile),
            _unchecked(cfg, d, cfg.block_d), bool(cfg.prefetch))
    return KernelCall(kernel, grid, args)


def tap_views(xp, width):
    """The overlapping (batch, width, seqlen-width+1, ...) view of a (batch, seqlen, ...)
    tensor whose tap axis has the token stride: v[b, k, r] = xp[b, r + k] (no copy)."""
    b, l = xp.shape[:2]
    rest, rest_st = tuple(xp.shape[2:]), tuple(xp.stride()[2:])
    return xp.as_strided((b, width, l - width + 1) + rest,
                         (xp.stride(0), xp.stride(1), xp.stride(1)) + rest_st,
                         xp.storage_offset())


def _taps_forward_call(xp, op, weight_t, bias, initial_states, seq_idx, final, silu, cfg, x):
    """Form 2's forward launch (`kernels.causal_conv1d_fwd_taps`), channel-last x with
    seqlen >= width."""
    b, l, d = xp.shape
    w = weight_t.shape[0]
    kernel = FORMS[2][0][1 if needs_int64(xp, op) else 0]
    kernel = with_hints(kernel, cfg.occupancy, cfg.warps)
    head = physical(make_head(x, initial_states, cfg.block_l, w, True), True)
    stand_in = weight_t
    ids = seq_idx
    if seq_idx is not None and seq_idx.stride(1) != 1:
        ids = seq_idx.contiguous()
    id_head = make_id_head(ids, cfg.block_l, w) if ids is not None else stand_in
    rows = l - (w - 1)
    grid = (-(-d // cfg.block_d), max(1, -(-(-(-rows // cfg.block_l)) // cfg.tiles)), b)
    args = (xp, head, tap_views(xp, w), weight_t, bias if bias is not None else stand_in,
            ids if ids is not None else stand_in, id_head,
            tap_views(ids, w) if ids is not None else stand_in, op, op[:, w - 1:],
            final if final is not None else head,
            w, halo_rows(w), head_front(w), cfg.block_l, cfg.block_d, cfg.tiles,
            bias is not None, ids is not None, bool(silu), final is not None)
    return KernelCall(kernel, grid, args)


def backward_grid(x, cfg):
    """The backward's grid; its axis 1 times batch is the number of dw/dbias partial rows."""
    b, d, l = x.shape
    rows = cfg.form == 3 and is_channel_last(x)
    cfg = fit_grid(cfg, l, rows, backward=True)
    if rows:
        span = rows_spans(cfg, b, d, l, num_sms(x))[1]
        return (-(-d // cfg.bwd_block_d), -(-l // span), b)
    return (-(-d // cfg.bwd_block_d), -(-(-(-l // cfg.bwd_block_l)) // cfg.bwd_tiles), b)


def backward_plan(x, weight_t, bias, initial_states, seq_idx, dout, dfinal, dx, dw_part,
                  db_part, dinit, silu, cfg: Conv1dConfig | None = None, dweight=None,
                  dbias=None):
    """The backward launch. x, dout and dx in one layout family; dw_part (P, width, dim) and
    db_part (P, dim) float32 with P = batch * backward_grid(x, cfg)[1]; dinit (batch, dim,
    width-1) or None (with initial_states None too). With dweight (dim, width) (and dbias
    (dim,) with a bias) and cfg.bwd_reduce, then the launch that sums the partials into
    them (`kernels.sum_partials`)."""
    if cfg is None:
        b, d, l = x.shape
        cfg = conv1d_config(b, d, l, is_channel_last(x), num_sms(x), weight_t.shape[0])
    calls = _backward_calls(x, weight_t, bias, initial_states, seq_idx, dout, dfinal, dx,
                            dw_part, db_part, dinit, silu, cfg)
    if dweight is not None and cfg.bwd_reduce:
        parts, d = db_part.shape
        calls.append(sum_partials_call(
            dw_part, dweight.t(), None if dbias is None else db_part.view(parts, 1, d),
            None if dbias is None else dbias.view(1, d), num_sms(x)))
    return calls


def _backward_calls(x, weight_t, bias, initial_states, seq_idx, dout, dfinal, dx, dw_part,
                    db_part, dinit, silu, cfg: Conv1dConfig | None = None):
    """backward_plan's convolution launch (one KernelCall in a list)."""
    b, d, l = x.shape
    w = weight_t.shape[0]
    cl = is_channel_last(x)
    if cfg is None:
        cfg = conv1d_config(b, d, l, cl, num_sms(x), w)
    cfg = fit_grid(cfg, l, cfg.form == 3 and cl, backward=True)
    xp, dop, dxp = physical(x, cl), physical(dout, cl), physical(dx, cl)
    if cfg.form == 3 and cl:
        return [_rows_backward_call(xp, weight_t, bias, initial_states, seq_idx, dop, dfinal,
                                    dxp, dw_part, db_part, dinit, silu, cfg, x)]
    form = 1 if cfg.form == 3 else cfg.form
    kernel = FORMS[form][1][1 if needs_int64(xp, dop, dxp) else 0]
    kernel = with_hints(kernel, cfg.bwd_occupancy or cfg.occupancy, cfg.bwd_warps or cfg.warps)
    bl = cfg.bwd_block_l
    head = physical(make_head(x, initial_states, bl, w, cl), cl)
    if form in (1, 2) and initial_states is None:
        # form 1 reads dout before token 0 only for dinit: no head to build (two small
        # launches fewer); the stand-in is never read (and small: see forward_plan)
        dout_head = head
    else:
        dout_head = physical(make_head(dout, None, bl, w, cl), cl)
    id_head = make_id_head(seq_idx, bl, w) if seq_idx is not None else weight_t
    stand_in = weight_t
    args = (xp, head, weight_t, bias if bias is not None else stand_in,
            seq_idx if seq_idx is not None else stand_in, id_head, dop, dout_head,
            dfinal if dfinal is not None else head, dxp, dw_part, db_part,
            dinit if dinit is not None else head,
            w, next_pow2(w), halo_rows(w), head_front(w), bl, cfg.bwd_block_d,
            cfg.bwd_tiles, cl, bias is not None, initial_states is not None,
            seq_idx is not None, bool(silu), dfinal is not None, bool(cfg.shift_tma))
    if form in (1, 2):
        args += (_unchecked(cfg, d, cfg.bwd_block_d), bool(cfg.store_tma))
    return [KernelCall(kernel, backward_grid(x, cfg), args)]


def _rows_backward_call(xp, weight_t, bias, initial_states, seq_idx, dop, dfinal, dxp, dw_part,
                        db_part, dinit, silu, cfg, x):
    """Form 3's backward launch (`kernels.causal_conv1d_bwd_rows`), channel-last x."""
    d = xp.shape[2]
    w = weight_t.shape[0]
    kernel = FORMS[3][1][1 if needs_int64(xp, dop, dxp) else 0]
    kernel = with_hints(kernel, rows_backward_occupancy(cfg, xp, dop, dxp, w),
                        cfg.bwd_warps or cfg.warps)
    stand_in = weight_t
    args = (xp, weight_t, bias if bias is not None else stand_in,
            initial_states if initial_states is not None else stand_in,
            seq_idx if seq_idx is not None else stand_in, dop,
            dfinal if dfinal is not None else stand_in, dxp, dw_part, db_part,
            dinit if dinit is not None else stand_in,
            w, rows_spans(cfg, xp.shape[0], d, xp.shape[1], num_sms(xp))[1], cfg.bwd_rows,
            cfg.bwd_block_d, bias is not None,
            initial_states is not None, seq_idx is not None, _rows_silu(silu, xp),
            dfinal is not None, bool(cfg.bwd_row_tile), _unchecked(cfg, d, cfg.bwd_block_d),
            bool(cfg.bwd_prefetch))
    return KernelCall(kernel, backward_grid(x, cfg), args)


UPDATE_BLOCK_D = 64


def update_plan(x3, conv_state, weight_t, bias, cache_seqlens, slots, out3, new_state, silu):
    """The two update launches (see `kernels.causal_conv1d_update`). x3, out3 (batch, dim, k);
    new_state (batch, dim, state_len) scratch; cache_seqlens / slots int32 (batch,) or None."""
    b, d, k = x3.shape
    S = conv_state.shape[2]
    w = weight_t.shape[0]
    big = needs_int64(conv_state)
    upd = causal_conv1d_update_i64 if big else causal_conv1d_update
    cpy = causal_conv1d_state_copy_i64 if big else causal_conv1d_state_copy
    grid = (-(-d // UPDATE_BLOCK_D), b, 1)
    stand_in = weight_t
    sp = next_pow2(S)
    has_idx = slots is not None
    first = KernelCall(upd, grid, (
        x3, conv_state, weight_t, bias if bias is not None else stand_in,
        cache_seqlens if cache_seqlens is not None else stand_in,
        slots if has_idx else stand_in, out3, new_state,
        w, UPDATE_BLOCK_D, next_pow2(k), sp, bias is not None, bool(silu),
        cache_seqlens is not None, has_idx))
    second = KernelCall(cpy, grid, (new_state, slots if has_idx else stand_in, conv_state,
                                    UPDATE_BLOCK_D, sp, has_idx))
    return [first, second]


# ---------------------------------------------------------------------------------- launchers

def _weight_t(weight):
    return weight.t().contiguous()


def conv1d_forward_cuda(x, weight, bias, seq_idx, initial_states, silu, want_final,
                        cfg: Conv1dConfig | None = None):
    """(out in x's layout family, final (batch, dim, width-1) contiguous or None)."""
    if x.numel() == 0:      # a zero-sized grid is a launch error; PyTorch ops handle it
        from .cpu import conv1d_forward
        return conv1d_forward(x, weight, bias, seq_idx, initial_states, silu, want_final)
    x, _ = kernel_layout(x)
    cl = is_channel_last(x)
    out = empty_like_layout(x, cl)
    b, d, _ = x.shape
    w = weight.shape[1]
    final = torch.empty(b, d, w - 1, dtype=x.dtype, device=x.device) if want_final else None
    calls = forward_plan(x, _weight_t(weight), None if bias is None else bias.contiguous(),
                         initial_states, seq_idx, out, final, silu, cfg)
    launch_calls(calls, x.device)
    return out, final


def conv1d_backward_cuda(x, weight, bias, seq_idx, initial_states, dout, dfinal, silu,
                         cfg: Conv1dConfig | None = None):
    """(dx in x's layout family, dweight (dim, width), dbias or None, dinit or None)."""
    if x.numel() == 0:      # a zero-sized grid is a launch error; PyTorch ops handle it
        from .cpu import conv1d_backward
        return conv1d_backward(x, weight, bias, seq_idx, initial_states, dout, dfinal, silu)
    x, _ = kernel_layout(x)
    cl = is_channel_last(x)
    b, d, l = x.shape
    w = weight.shape[1]
    if cfg is None:
        cfg = conv1d_config(b, d, l, cl, num_sms(x), w)
    if dout is None:
        dout = torch.zeros_like(x)
    dout = in_layout(dout, cl)
    dx = empty_like_layout(x, cl)
    parts = b * backward_grid(x, cfg)[1]
    dw_part = torch.empty(parts, w, d, dtype=torch.float32, device=x.device)
    db_part = torch.empty(parts, d, dtype=torch.float32, device=x.device)
    dinit = None
    if initial_states is not None:
        dinit = torch.empty(b, d, w - 1, dtype=initial_states.dtype, device=x.device)
    # the partials summed in a fixed order (deterministic), by the plan's second launch
    dweight = torch.empty(d, w, dtype=weight.dtype, device=x.device)
    dbias = None if bias is None else torch.empty(d, dtype=bias.dtype, device=x.device)
    calls = backward_plan(x, _weight_t(weight), None if bias is None else bias.contiguous(),
                          initial_states, seq_idx, dout, dfinal, dx, dw_part, db_part, dinit,
                          silu, cfg, dweight, dbias)
    launch_calls(calls, x.device)
    if not cfg.bwd_reduce:
        dweight = dw_part.sum(0).t().to(weight.dtype).contiguous()
        dbias = None if bias is None else db_part.sum(0).to(bias.dtype)
    return dx, dweight, dbias, dinit


def conv1d_update_cuda(x3, conv_state, weight, bias, silu, cache_seqlens, slots):
    """out (batch, dim, k) in x's dtype; conv_state updated in place."""
    b, d, k = x3.shape
    if conv_state.shape[0] == 0:     # an empty cache: every row is padding (slots checked)
        return torch.zeros(b, d, k, dtype=x3.dtype, device=x3.device)
    out = torch.empty(b, d, k, dtype=x3.dtype, device=x3.device)
    new_state = torch.empty(b, d, conv_state.shape[2], dtype=conv_state.dtype,
                            device=x3.device)
    calls = update_plan(x3, conv_state, _weight_t(weight),
                        None if bias is None else bias.contiguous(), cache_seqlens, slots, out,
                        new_state, silu)
    launch_calls(calls, x3.device)
    return out
