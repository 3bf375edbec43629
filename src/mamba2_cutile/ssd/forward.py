"""The forward pass of the chunked SSD on CUDA tensors: its config, its plan of launches (three
kernels; chunk_scan twice with scan_causal 1 to 4), and the launcher.

| launch | kernel | what |
| --- | --- | --- |
| 1 | `decay_cumsum` | dt' = clamp(softplus(dt + bias)) and the per-chunk cumsum of A dt' in log2 space |
| 2 | `chunk_state_pass` | the chunk entry states, one sequential pass over chunks (`state_segments` S > 1: S parallel passes from zero states) |
| 2b | `chunk_state_carry` | (S > 1 only) the states entering each segment, added to its states (with `segment_fold`, only written for the output launch to add); the final state |
| 2c | `chunk_cb` | (`scan_cb` only) C B^T of every chunk and group, once, for chunk_scan |
| 3 | `chunk_scan` (`scan_heads` > 1: `chunk_scan_group`) | the output: carried-state term, masked decayed C B^T times X, D x, z gate (with `scan_causal=1`, and per tile the count of non-finite outputs; 2 / 3: the sum / the row sums of the accumulator); `chunk_scan_group`: the plain tile for several heads of a group a program, C B^T formed once |
| 4 | `chunk_scan` | (`scan_causal` 1 to 4 only) the tiles counted non-zero (1; same grid), summed non-finite (2, 3; a program per `FIX_SPAN` tiles) or of the heads `chunk_state_pass` flagged, their chunks holding a non-finite input (4; a program per head), again in the causal form: a NaN/Inf input never changes an earlier output |

With `scan_walk` (`walk_plan`) launches 2 and 3 are one, `chunk_scan_walk`: a program per (batch,
head, p-tile) walks its chunks with the state in registers (with `state_segments`, after 2 and
2b for the runs' entering states), and again over the runs it flagged (scan_causal 4 and 5), or
each program walks its own flagged run again (`walk_fix_inline`: the rule's short walk up to
1024 tokens, `short_walk`, two launches in all).

A plan is built from tensors (real CUDA tensors at run time, or `meta` tensors when compiling on
a CPU), so the CPU compile check exercises exactly the argument lists the GPU path launches.
Nothing here reads tensor values: plans are safe under CUDA-graph capture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .. import config as _config
from ..kernels.chunk_cb import chunk_cb, chunk_cb_i64
from ..kernels.chunk_scan import FIX_SPAN, chunk_scan, chunk_scan_i64
from ..kernels.chunk_scan_group import chunk_scan_group, chunk_scan_group_i64
from ..kernels.chunk_scan_walk import chunk_scan_walk, chunk_scan_walk_i64
from ..kernels.chunk_state_carry import chunk_state_carry, chunk_state_carry_i64
from ..kernels.chunk_state_pass import chunk_state_pass, chunk_state_pass_i64
from ..kernels.decay_cumsum import decay_cumsum, decay_cumsum_i64
from ..runtime import (DEFAULT_SMS, KernelCall, as_kernel_input, dt_clamp_bounds,
                       launch_calls, needs_int64, next_pow2, num_sms, seq_ids_int32,
                       with_hints)
from .varlen import empty_varlen_states, varlen_states_from_chunks

SUPPORTED_CHUNK_SIZES = (64, 128, 256)
MAX_HEADDIM = 256
MAX_DSTATE = 256


@dataclass(frozen=True)
class ForwardConfig:
    """Tile sizes and hints of the three forward kernels (all powers of two).

    `chunk_size` is the chunk length the forward computes with. It may differ from the
    caller's (`forward_shape_config`): the chunked algorithm is an exact rewrite of the
    recurrence for any chunk length, so outputs and final states differ only in rounding."""
    chunk_size: int
    cumsum_block_h: int
    state_block_p: int
    state_block_n: int
    state_load_latency: int
    scan_block_q: int
    scan_block_p: int
    dstate_pad: int
    state_occupancy: int = 0        # 0: let the compiler choose
    scan_occupancy: int = 0
    scan_load_latency: int = 0      # 0: let the compiler choose
    scan_persistent: int = 0        # >0: a persistent grid of this many programs per SM
    scan_lowp: int = 0              # 1: (C B^T) X MMA in the input dtype (fp16/bf16), not tf32
    scan_head_major: int = 0        # 1: heads fastest in the grid (they share B and C tiles)
    scan_warps: int = 0             # num_worker_warps hint of chunk_scan (0: compiler's choice)
    state_scale_x: int = -1         # 1: chunk_state_pass weights X, 0: B, -1: the smaller
    scan_block_n: int = 0           # dstate tile of chunk_scan's K loop (0: all of dstate_pad)
    state_fresh_acc: int = 0        # 1: chunk_state_pass MMA into a fresh accumulator, then add
    scan_causal: int = 0            # a NaN/Inf never reaches an earlier output
                                    # (0 here; the shape rule sets 4)
                                    # (kernels/chunk_scan.py): 1: chunk_scan counts each tile's
                                    # non-finite outputs and a second launch over the same grid
                                    # recomputes the counted tiles in a sanitizing form; on clean
                                    # input the seed problem's forward 0.251 -> 0.297 ms on the
                                    # H200 (the count +0.017 ms, the second launch 0.032 ms;
                                    # benchmarks/results/2026-12-02-h200-forward-sweep-causal.jsonl)
                                    # 2: the same with a sum per tile (row sums first: a third of
                                    # the count's instructions) and a second launch of a program
                                    # per FIX_SPAN tiles (one short wave: 128 programs, not 8192,
                                    # at the seed problem); 3: as 2 with a sum per query row
                                    # stored (no exchange between warps; BLOCK_Q floats a tile).
                                    # 3 on the H200: +2.3-3.4% on clean input (benchmarks/
                                    # results/2026-12-03-h200-forward-causal3-cost.jsonl.txt).
                                    # 4: chunk_state_pass flags the runs that bring a
                                    # non-finite value into the state (an elementwise sum of
                                    # the chunks' own terms, one check after the loop),
                                    # chunk_scan runs plain, and a program per (batch, head)
                                    # recomputes the tiles of a flagged head's chunks holding
                                    # a non-finite input (nothing added to chunk_scan); the
                                    # shape rule's choice (forward_shape_config: +1.3% at the
                                    # seed problem on the H100, -1% to +1.8% elsewhere).
                                    # 5: as 4 with the fix-up a program per (batch, head)
                                    # and tile of a chunk: its sm_90 compile a quarter of
                                    # the size and time; not timed
    state_segments: int = 1         # S > 1: chunk_state_pass's chunk loop in S parallel runs
                                    # from zero states, then chunk_state_carry adds each run's
                                    # entering state (kernels/chunk_state_pass.py); 1: one run.
                                    # Runs share SMs only under state_occupancy (4: 4 per SM at
                                    # the seed problem's tiles). Timed on the H200 on 2026-12-03:
                                    # slower (docs/measurements.md)
    scan_cb: int = 0                # 1: C B^T formed once per chunk and group by chunk_cb
                                    # (B * chunks * G * Q * Q float32 scratch) and read by
                                    # chunk_scan, instead of formed in each of its H / G heads'
                                    # tiles. Not timed yet
    segment_fold: int = 0           # 1 (with state_segments S > 1): chunk_state_carry writes
                                    # only the S states entering the segments and the output
                                    # launch (chunk_scan or chunk_scan_group) adds f_c H_s to
                                    # the local state it loads, instead of a launch rewriting
                                    # every chunk state (2x the state bytes). Timed with
                                    # chunk_scan only (docs/measurements.md)
    state_resweep: int = 0          # 1 (with state_segments S > 1, not segment_fold): the
                                    # segmented pass runs twice: first for the runs' end
                                    # states only (no chunk state written), then, after
                                    # chunk_state_carry forms the S entering states, again
                                    # with each run starting from its true entering state,
                                    # writing the chunk states: the chunks' inputs read twice,
                                    # no launch rewriting the states and nothing added in the
                                    # output launch. Not timed yet
    scan_heads: int = 1             # > 1 where the plain tile is launched (scan_causal 0, 4,
                                    # 5; not with scan_cb or scan_persistent): the
                                    # output launch is kernels/chunk_scan_group.py, a program
                                    # per query block, group and p-tile walking this many of
                                    # the group's heads (clamped to the largest power-of-two
                                    # divisor of the heads per group at most this; its grid
                                    # has no head-major order, so scan_head_major does not
                                    # apply) with C B^T of the block against its chunk formed
                                    # once. 1: chunk_scan, C B^T in every head's tile
    scan_walk: int = 0              # 1: the state and the output in one pass over chunks
                                    # (kernels/chunk_scan_walk.py): a program per (batch,
                                    # head, scan_block_p channels) walks its chunks with the
                                    # state in registers, no chunk state written; with
                                    # state_segments S > 1 the runs' entering states first
                                    # (chunk_state_pass for the runs' ends, chunk_state_carry).
                                    # Where it applies (`uses_walk`: no seq_idx, scan_causal 0,
                                    # 4 or 5, not scan_cb, chunk_size <= 128; not where varlen
                                    # states read the chunk states) it replaces
                                    # chunk_state_pass and the output launch; scan_block_q,
                                    # scan_heads, segment_fold and state_resweep then do not
                                    # apply. The rule's choice: `walk_form`
    walk_occupancy: int = 0         # occupancy hint of chunk_scan_walk (0: compiler's choice,
                                    # one per SM; the rule sets 2 where its grid needs two)
    walk_warps: int = 0             # num_worker_warps hint of chunk_scan_walk (0: compiler's)
    walk_carry: int = 0             # 1: with state_segments S > 1 each walk program forms
                                    # its run's entering state from the segmented pass's run
                                    # ends itself (CARRY), one launch fewer (no
                                    # chunk_state_carry); the rule's with S > 1
                                    # (`walk_config`). sm_90, the rule's
                                    # walks with D: 128 registers, no stack (8 B without),
                                    # 109 KB of shared memory (84), still two per SM
    walk_fix_inline: int = 0        # 1 (scan_causal 4 or 5): a walk program whose run's
                                    # last state is non-finite walks the run again itself,
                                    # recomputing its bad chunks causally (FIX_INLINE),
                                    # instead of a second launch over the grid

    FIXED = ("dstate_pad",)     # set by the problem, never overridden

    def __post_init__(self):
        c = _config
        c.check_pow2(self, "chunk_size")      # the API takes SUPPORTED_CHUNK_SIZES; smaller
        if not 16 <= self.chunk_size <= max(SUPPORTED_CHUNK_SIZES):   # ones run emulated
            raise ValueError(f"ForwardConfig: chunk_size={self.chunk_size} must be 16 to "
                             f"{max(SUPPORTED_CHUNK_SIZES)}")
        c.check_pow2(self, "cumsum_block_h", "state_block_p", "state_block_n", "scan_block_q",
                     "scan_block_p", "dstate_pad")
        c.check_pow2(self, "scan_block_n", allow_zero=True)
        for name in ("state_load_latency", "scan_load_latency"):
            c.check_range(self, name, 0, 10)
        for name in ("state_occupancy", "scan_occupancy", "walk_occupancy"):
            c.check_range(self, name, 0, 32)
        c.check_range(self, "scan_persistent", 0, 16)
        c.check_range(self, "state_segments", 1, 64)
        c.check_pow2(self, "scan_heads")
        c.check_range(self, "state_scale_x", -1, 1)
        for name in ("state_fresh_acc", "scan_lowp", "scan_head_major", "scan_cb",
                     "segment_fold", "state_resweep", "scan_walk", "walk_carry",
                     "walk_fix_inline"):
            c.check_choice(self, name, (0, 1))
        if self.state_resweep and self.segment_fold:
            raise ValueError("ForwardConfig: state_resweep=1 and segment_fold=1 are two ways "
                             "to carry the segments' entering states: choose one")
        c.check_choice(self, "scan_causal", (0, 1, 2, 3, 4, 5))
        c.check_choice(self, "scan_warps", (0, 4, 8))
        c.check_choice(self, "walk_warps", (0, 4, 8))
        if self.scan_block_q > self.chunk_size:
            raise ValueError(f"ForwardConfig: scan_block_q={self.scan_block_q} is larger than "
                             f"chunk_size={self.chunk_size}")
        if self.state_block_n > self.dstate_pad:
            raise ValueError(f"ForwardConfig: state_block_n={self.state_block_n} is larger than "
                             f"dstate_pad={self.dstate_pad}")


def scale_x(cfg: ForwardConfig) -> bool:
    """Whether chunk_state_pass puts the decay weights on X (else on B): an explicit 0/1, or
    by default on the smaller of the two MMA operand tiles (BLOCK_P vs BLOCK_N)."""
    if cfg.state_scale_x >= 0:
        return bool(cfg.state_scale_x)
    return cfg.state_block_n > cfg.state_block_p


#: the chunk length chunk_scan_group computes with (a chunk-256 call where it applies)
GROUP_CHUNK = 128
GROUP_HEADS = 16            # heads a chunk_scan_group program walks (at most)
GROUP_BLOCK_Q = 64


def pow2_divisor(n, cap) -> int:
    """The largest power-of-two divisor of `n` that is at most `cap`."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def group_heads(nheads, ngroups) -> int:
    """The heads one chunk_scan_group program of the shape rule walks (`group_scan_heads`)."""
    return pow2_divisor(max(1, nheads // max(1, ngroups)), GROUP_HEADS)


def uses_group_scan(batch, seqlen, nheads, ngroups, headdim, dstate, chunk_size, dtype,
                    sms=DEFAULT_SMS) -> bool:
    """Whether the shape rule's output launch is chunk_scan_group, computed at GROUP_CHUNK:
    where it was timed (16-bit inputs, chunk 128 or 256, and either headdim <= 128 with
    dstate <= 128 or headdim <= 64 with dstate <= 256), and
    its grid gives every SM a program (`seqlen` None: assumed long). Its grid is a program per
    64-token block, group, p-tile and `group_heads` heads, a fraction of chunk_scan's: at B=1
    T=512 H=24 chunk 256 it had 24 programs, 0.033 -> 0.041 ms; at B=1 T=2048 H=64, 128
    programs, 0.0895 -> 0.0915 ms; at B=4 T=4096 H=8 chunk 128, 256 programs, 0.093 -> 0.068 ms
    (H100, 2026-12-05; the others H200, 2026-12-05). Headdim 128 (two 64-channel p-tiles) at
    B=2 T=8K H=48 chunk 256: forward 0.639 -> 0.477 ms (mamba_ssm 0.712; chunk_scan 0.444 ->
    chunk_scan_group 0.290), outputs 5.1e-3 of the largest element from mamba_ssm's as at
    chunk 256 (H100, 2026-12-06, benchmarks/results/2026-12-06-h100-forward-sweep-group-
    headdim128-dstate256.jsonl); that one bf16 shape is the timing behind headdims 65-128
    (fp16 and partial second p-tiles, headdim 80 or 96, follow it untimed). The program
    count below leaves p-tiles out, as the short-sequence limits were timed at headdim 64
    (one p-tile): at headdims 65-128 a short sequence keeps chunk_scan until its group grid
    is twice the SMs. dstate 129-256 (one 256-wide tile) at headdim <= 64 ran faster too: at
    B=2 T=8K H=32 chunk 256 forward 0.312 -> 0.272 ms (chunk_scan 0.213 -> chunk_scan_group
    0.158; H100, 2026-12-06, benchmarks/results/2026-12-06-h100-forward-sweep-group-dstate256
    .jsonl), the same config's output against float64 checked on the GPU
    (tests/ssd/test_forward_gpu.py::test_scan_heads_dstate256, bf16, dstate 200, chunks 128
    and 256, through explicit overrides; fp16 follows untimed and unchecked there); headdims
    65-128 with such a state (untimed) keep chunk_scan."""
    if (chunk_size not in (128, 256) or dtype == torch.float32 or headdim > 128
            or dstate > 256 or (dstate > 128 and headdim > 64)):
        return False
    if chunk_size == 256 and dtype not in (torch.bfloat16, torch.float16):
        return False        # the float64 emulation keeps chunk-256 plans at 256
    if seqlen is None:
        return True
    ngroups = max(1, ngroups)
    programs = (-(-seqlen // GROUP_BLOCK_Q) * batch * ngroups
                * (max(1, nheads // ngroups) // group_heads(nheads, ngroups)))
    return programs >= sms


def state_tiles(slices, dstate, dstate_pad, chunk_size, dtype, sms=DEFAULT_SMS):
    """(state_block_n, state_occupancy) of chunk_state_pass for `slices` (batch, head, p-tile)
    slices of the state. Its chunk loop is sequential, so the grid must fill the GPU by
    splitting the state: the widest n-tile that still gives most SMs a program (on the H200 at
    the seed problem 128 programs of 64 x 32 beat 256 of 64 x 16 and 64 of 64 x 64). Where
    that grid is more than one program per SM (a second wave as long as the first), 16-bit
    inputs at chunk 128 (a chunk-256 call computed at 128 included) take two programs per SM,
    and a 64-wide tile of a wider state is halved.

    On the H100 (bf16, B=2 T=8K, chunk 256 computed at 128, 2026-12-06,
    benchmarks/results/2026-12-06-h100-forward-sweep-state-waves.jsonl): 48 heads, 192
    programs of 64 x 64, 0.280 ms; two per SM 0.233; 64 x 32 two per SM 0.191 (64 x 16 0.233);
    80 heads, 160 programs of the whole state, 0.198 -> 0.162 ms at two per SM (64 x 64 two
    per SM 0.461, 64 x 32 0.315); at the seed problem (128 programs) two per SM was slower,
    0.114 -> 0.152 ms. Where the whole state already gives three eighths to three quarters of
    the SMs a program, it stays whole (two per SM): 48 heads, 96 programs, 0.192 -> 0.116 ms
    against 64 x 32 two per SM (whole forward 0.347 -> 0.270, mamba_ssm 0.453); 32 heads, 64
    programs, 0.148 -> 0.106 against 64 x 64 one per SM (whole forward 0.256 -> 0.210)
    (benchmarks/results/2026-12-06-h100-forward-sweep-state-whole*.jsonl). 24 heads (48
    programs) were not timed and stay split, as does a 256-wide state. Measured in bf16 at
    dstate 128 with 64 to 192 programs: fp16, larger grids and the backward's recompute of
    the states take it unmeasured. At chunk 256 itself (short sequences, where the output
    launch is not chunk_scan_group) a grid of more than one wave also takes two per SM:
    B=1 T=512 H=24, 192 programs of 64 x 16, 214 KB of shared memory at one per SM, 91 KB
    at two, state pass 0.0129 -> 0.0090 ms, forward 0.0328 -> 0.0289 (H100, 2026-12-07,
    benchmarks/results/2026-12-07-h100-forward-sweep-walk-runs-occupancy-carry.jsonl). Tiles
    up to 64 wide follow it untimed (sm_90 without seq_idx: no stack; with seq_idx and every
    option 8 B at 64 x 16, and 224 B at 64 x 64, one CTA an SM with or without the hint);
    a 128-wide tile spills two per SM and stays at one. An override of `state_block_n`
    keeps the rule's occupancy (64 x 64 tiles at two per SM were the slowest form at 80
    heads)."""
    def programs(bn):
        return slices * -(-dstate // bn)
    lowp = dtype in (torch.bfloat16, torch.float16)
    lowp128 = chunk_size == 128 and lowp
    lowp256 = chunk_size == 256 and lowp
    bn = dstate_pad
    if lowp128 and dstate_pad == 128 and (3 * sms) // 8 <= programs(bn) < (3 * sms) // 4:
        # the whole state on three eighths to three quarters of the SMs, two programs per SM:
        # one whole-state program does a chunk in less time than two split ones
        return bn, 2
    while bn > 16 and programs(bn) < (3 * sms) // 4:
        bn //= 2
    occupancy = 0
    if programs(bn) > sms and lowp128:
        occupancy = 2
        if bn == 64 < dstate_pad:
            bn = 32
    elif programs(bn) > sms and lowp256 and bn <= 64:
        # (a 128-wide tile at chunk 256 spills two per SM: 144 B of stack at sm_90)
        occupancy = 2
    return bn, occupancy


def forward_shape_config(batch, nheads, headdim, dstate, chunk_size, dtype,
                         sms=DEFAULT_SMS, seqlen=None, ngroups=1) -> ForwardConfig:
    """The dispatcher's rule: a good config from the shape alone (no search, no sync).
    `seqlen` None: a long sequence."""
    return _shape_config(batch, nheads, headdim, dstate, chunk_size, dtype, sms,
                         uses_group_scan(batch, seqlen, nheads, ngroups, headdim, dstate,
                                         chunk_size, dtype, sms))


@functools.lru_cache(maxsize=1024)
def _shape_config(batch, nheads, headdim, dstate, chunk_size, dtype, sms,
                  group) -> ForwardConfig:
    """`forward_shape_config` after the choice of the output launch. Memoized: a pure function
    of its arguments (no sequence length among them), on every call's hot path (the configs
    are frozen)."""
    if group:
        # a chunk-256 call computed at chunk 128 (`ForwardConfig.chunk_size`: the chunked
        # algorithm is exact for any chunk, outputs differ in rounding only), where
        # chunk_scan_group runs: on the H200 at B=2 T=8K, 80 heads 0.554 -> 0.420 ms (mamba_ssm
        # 0.696), 64 heads 0.400 -> 0.295 (0.557), 128 heads G=8 0.775 -> 0.582 (1.139), 24
        # heads 0.221 -> 0.192 (0.234) (benchmarks/results/2026-12-05-h200-forward-sweep-
        # computed-chunk-128.jsonl); at chunk 256 itself the group launch was slower
        chunk_size = GROUP_CHUNK
    np_ = max(16, next_pow2(dstate))
    bp = min(64, max(16, next_pow2(headdim)))
    p_tiles = -(-headdim // bp)
    bn, state_occ = state_tiles(batch * nheads * p_tiles, dstate, np_, chunk_size, dtype,
                                 sms)
    wide = np_ >= 256 or dtype == torch.float32      # larger tiles per query row
    bq = min(chunk_size, 64 if wide else 128)
    # the output launch as chunk_scan_group, up to 16 of a group's heads a program (the plan
    # clamps to a divisor of the heads per group) with C B^T formed once, in 64-token blocks
    # at 2 CTAs/SM: on the H100 chunk_scan 0.212 -> 0.112 ms at the seed problem, 0.790 ->
    # 0.387 ms at B=2 T=8K H=128 G=8 chunk 128 (benchmarks/results/2026-12-05-h100-forward-
    # sweep-scan-heads.jsonl)
    heads = GROUP_HEADS if group else 1
    if group:
        bq = GROUP_BLOCK_Q
    # Measured on the H200 (2026-11-30; benchmarks/results/, docs/measurements.md): the
    # (C B^T) X MMA in the input dtype (scan_lowp, as mamba_ssm) cut chunk_scan from 0.280 to 0.210 ms at the seed problem; the
    # state pass's MMA into a fresh accumulator was as fast or faster at both shapes swept; the
    # decay weights belong on the smaller MMA operand (weighting X instead of a 128-wide B cut
    # the state pass from 0.458 to 0.174 ms at B=2 T=8K H=80 chunk 256).
    cfg = ForwardConfig(
        chunk_size=chunk_size,
        cumsum_block_h=min(16, max(2, next_pow2(nheads))),
        state_block_p=bp,
        state_block_n=bn,
        state_load_latency=8,
        state_occupancy=state_occ,
        scan_block_q=bq,
        scan_block_p=bp,
        dstate_pad=np_,
        scan_lowp=1,
        state_fresh_acc=1,
        # a chunk of several query blocks (the K-loop path): two CTAs per SM cut chunk_scan
        # from 0.662 to 0.374 ms at B=2 T=8K H=80 chunk 256, and 0.207 to 0.122 ms at H=24
        # (H200, benchmarks/results/2026-11-30-h200-forward-sweep-scan-occupancy.jsonl)
        scan_occupancy=2 if bq < chunk_size else 0,
        scan_heads=heads,
        # a NaN/Inf input never changes an earlier output (module docstring of
        # kernels/chunk_scan.py): on the H100 at the seed problem 0.327 -> 0.332 ms, at B=2
        # T=8K H=80 chunk 256 0.558-0.565 -> 0.572 ms, at B=4 T=64K 1.308-1.321 -> 1.300 ms
        # (benchmarks/results/2026-12-05-h100-forward-sweep-causal4-cost.jsonl)
        scan_causal=4,
    )
    return cfg


#: the shortest sequence the walk rule takes: 8192 tokens, 2048 in two runs (`walk_form`)
WALK_MIN_SEQLEN = 8192
WALK_MIN_SEQLEN_TWO_RUNS = 2048


def walk_block_p(dstate_pad: int) -> int:
    """The channels a walk program of the rule holds (`scan_block_p`): a 64-channel tile (a
    whole head of 64), or 32 channels at a state padded to 256 (a (64, 256) float32 state
    tile does not compile in the fix-up walk: WALK_MAX_STATE)."""
    return min(64, WALK_MAX_STATE // dstate_pad)


#: the most runs the two-per-SM walk takes (`walk_form`; 8 timed at the seed problem)
WALK_MAX_RUNS = 8


def walk_form(batch, nheads, headdim, dstate, dtype, seqlen, sms=DEFAULT_SMS):
    """The shape rule's walk (`ForwardConfig.scan_walk`, computed at chunk 64, a program per
    (batch, head, `walk_block_p` channels): dstate <= 256, 16-bit inputs,
    sequences of WALK_MIN_SEQLEN+ tokens, WALK_MIN_SEQLEN_TWO_RUNS+ with S = 2) as (S, O):
    its run count S (0 for the three-kernel forward) and its occupancy hint O
    (`ForwardConfig.walk_occupancy`; 0 leaves the compiler's one program per SM, at sm_90
    255 registers at 256 threads in the rule's one-run form at dstate 128, 168 at 384 in its
    runs and at dstate 256; 2 gives two per SM, 128 registers at 256 threads). A walk
    program is one sequential chain of chunks, so its grid of S n programs (n = B * H *
    channel tiles) must fill the SMs:

    - SMs < n <= 2 SMs at dstate <= 128: S = 1, two per SM (one wave);
    - 70% of the SMs <= n <= SMs: S = 1, one per SM (at most 30% of them idle);
    - fewer, at dstate <= 128: the largest S <= WALK_MAX_RUNS with S n at 90-100% of
      2 SMs, two per SM (the runs' ends first: the segmented state pass over whole
      128-wide states, two per SM; each walk program then forms its run's entering state,
      `walk_config`); below 8192 tokens S = 2 with 2 n at 90-100% of the SMs, one per SM;
    - n > 2 SMs (or n > SMs at dstate 129-256): S = 1, one per SM, where the last wave is at
      least 90% full;
    - headdim above 64: only headdim 128 at SMs < n <= 2 SMs, dstate <= 128, two per SM
      (the one such form timed; 192 or 256 channels and the other grids stay three-kernel).

    On the H100 (bf16, D per head, chunk 256 unless named; three-kernel forward or the
    earlier walk -> this rule, ms, ours only in the same run unless named;
    benchmarks/results/2026-12-07-h100-forward-sweep-walk*.jsonl):

    - two per SM, 2026-12-07 (`...-sweep-walk-occupancy.jsonl`): B=2 T=8K H=128 G=8 (256
      programs; one per SM in two waves) 0.497 -> 0.366; H=80 (160; three-kernel) 0.414 ->
      0.339 (one per SM in two waves: 0.463; 8 warps at two per SM 0.826); the seed problem
      (B=4 T=16K H=8, 8 x 32 runs; 4 x 32 one per SM) 0.216 -> 0.186, at T=64K 0.762 ->
      0.616; H=32 (4 x 64 runs; 2 x 64) 0.209 -> 0.178; H=24 (5 x 48 runs; three-kernel)
      0.176 -> 0.151. Where one wave holds the grid already it lost: H=48 (96 programs)
      0.236 -> 0.280, in 2 x 96 runs 0.313; H=64 (128) 0.248 -> 0.293, in 2 x 128 runs
      0.319; 8 warps at two per SM lost everywhere (seed 0.208, H=24 0.171, H=32 0.204).
    - one per SM, beside mamba_ssm: B=2 T=8K H=64 (128 programs) 0.326 -> 0.248 (mamba_ssm
      0.597); H=48 (96) 0.271 -> 0.239 (0.453); dstate 256 at H=32 (2 x 64 programs of 32
      channels) 0.271 -> 0.235 (0.436); B=1 H=64 in 2 x 64 runs at T=2048 0.0904 -> 0.0742
      (0.0884).
    - headdim 128 beside mamba_ssm (`...-bench-fwd-headdim128-walk.jsonl`; the three-kernel
      time from the day's earlier run): B=2 T=8K H=48 (192 programs two per SM) 0.477 ->
      0.343 (mamba_ssm 0.718); forward + backward 2.215 -> 2.066 (3.170).

    Left out, as measured: headdim 128 in 64-channel programs one per SM (192) 0.477 ->
    0.466 (2%); B=1 T=512 H=24 (0.0328: 4 runs 0.0338, chunk 128 in 16-channel programs
    0.0298, a form this rule does not make); the seed problem at T=4096 in 4 runs 0.0681 ->
    0.0780, and two per SM in 8 / 4 runs 0.0792 / 0.0809 against the three-kernel 0.0668
    (`...-forward-sweep-seed-t4k-runs.jsonl`), so runs other than 2 keep 8192+ tokens.
    Shapes matching these conditions but not timed (133-159 and 161-255 programs two per
    SM, S = 3, 6 and 7, dstate 64, z or dt_bias, other sequence lengths) follow the rule
    untimed."""
    if (dtype not in (torch.bfloat16, torch.float16) or dstate > 256
            or seqlen is None or seqlen < WALK_MIN_SEQLEN_TWO_RUNS):
        return 0, 0
    np_ = max(16, next_pow2(dstate))
    programs = batch * nheads * -(-headdim // walk_block_p(np_))
    long_enough = seqlen >= WALK_MIN_SEQLEN
    if programs <= 0:
        return 0, 0
    if headdim > 64:
        # headdim 128 (two 64-channel tiles) two per SM only: the one form timed above 64
        wide_ok = headdim == 128 and np_ <= 128 and sms < programs <= 2 * sms
        return (1, 2) if wide_ok and long_enough else (0, 0)
    if programs > 2 * sms or (programs > sms and np_ > 128):
        full = programs % sms == 0 or programs % sms >= 0.9 * sms
        return (1, 0) if full and long_enough else (0, 0)
    if programs > sms:
        return (1, 2) if long_enough else (0, 0)
    if programs >= 0.7 * sms:
        return (1, 0) if long_enough else (0, 0)
    if np_ > 128:
        return 0, 0
    runs = min(WALK_MAX_RUNS, 2 * sms // programs)
    if long_enough and runs >= 2 and runs * programs >= 0.9 * 2 * sms:
        return runs, 2
    # shorter sequences: two runs one per SM (from 8192 tokens the line above takes these
    # grids, n = 60-66, in four runs two per SM)
    return (2, 0) if 0.9 * sms <= 2 * programs <= sms else (0, 0)


def walk_config(cfg: ForwardConfig, segments: int, occupancy: int = 0) -> ForwardConfig:
    """`cfg` as the walk rule runs it (`walk_form`): chunk 64, `walk_block_p` channels a
    program, the occupancy hint, and with S > 1 runs whose entering states the segmented
    pass forms over whole 128-wide state tiles, two programs an SM, each walk program
    forming its own run's entering state from the runs' ends (`walk_carry`).

    The runs' state pass at one program an SM (242 registers at 256 threads, 231 KB of
    shared memory at sm_90) took its 240-256 programs in two waves; at two an SM (128
    registers, 115 KB, no stack) in one. On the H100 (bf16, D per head, ms, mamba_ssm in the
    same run; benchmarks/results/2026-12-07-h100-forward-sweep-walk-runs-occupancy-carry.jsonl),
    the rule before -> two per SM -> and walk_carry: the seed problem (8 x 32 runs) 0.188 ->
    0.164 -> 0.155 (mamba_ssm 0.437; state pass 0.073 -> 0.050); B=2 T=8K H=24 (5 x 48)
    0.152 -> 0.127 -> 0.120 (0.248); H=32 (4 x 64) 0.179 -> 0.150 -> 0.144 (0.316); B=4 T=64K
    H=8 0.611 -> 0.516 (1.668); B=1 T=64K H=64 (4 x 64) 1.159 -> 0.939 (2.745). walk_carry
    alone (one per SM) 0.177, 0.143, 0.171, 0.608, 1.158: the walk gains 0.002-0.004 ms
    where chunk_state_carry's 0.015-0.020 goes. The two-run form below 8192 tokens (its
    state pass one wave either way) was timed only with both settings at once, in a bench
    run against the earlier rule's: B=1 T=2048 H=64 0.0735 -> 0.0599 ms."""
    over = dict(scan_walk=1, chunk_size=64, scan_block_q=64,
                scan_block_p=walk_block_p(cfg.dstate_pad), state_segments=segments,
                walk_occupancy=occupancy)
    if segments > 1:
        over.update(state_block_p=64, state_block_n=cfg.dstate_pad, state_occupancy=2,
                    walk_carry=1)
    return replace(cfg, **over)


#: the longest sequence the short walk takes (`short_walk`) and its programs' channels
WALK_SHORT_MAX_SEQLEN = 1024
WALK_SHORT_BLOCK_P = 16


def short_walk(batch, nheads, headdim, dstate, dtype, seqlen, sms=DEFAULT_SMS) -> bool:
    """Whether the shape rule takes the short walk (`short_walk_config`): 16-bit inputs,
    sequences of at most WALK_SHORT_MAX_SEQLEN tokens, headdim 16-64, dstate <= 128, and a
    grid of B * H * cdiv(headdim, 16) programs within one wave of the SMs.

    At a few hundred tokens the launches are the cost: the three-kernel forward's four
    (decay_cumsum, the state pass, chunk_scan and its causal fix-up) against two here
    (decay_cumsum and the walk, which walks a flagged run again itself). On the H100 (bf16,
    D per head, chunk 256, ms, mamba_ssm in the same run;
    benchmarks/results/2026-12-08-h100-forward-sweep-short-walk-fix-inline.jsonl): B=1 T=512
    H=24 (96 programs) three-kernel 0.0290, chunk-64 walk of 16 channels with the fix-up
    launch 0.0259, without it 0.0214 (mamba_ssm 0.0263); at T=1000 0.0338 -> 0.0333
    (0.0326): each 64-token chunk costs the walk about 1.4 us and the three-kernel forward
    about 0.6, so past about a thousand tokens it stays three-kernel. Shapes in these bounds
    but not timed (other grids, headdim 16-32, dstate 16-64, fp16, 513-999 tokens) follow
    the rule untimed."""
    if (dtype not in (torch.bfloat16, torch.float16) or seqlen is None
            or not 0 < seqlen <= WALK_SHORT_MAX_SEQLEN or dstate > 128
            or not 16 <= headdim <= 64):
        return False
    programs = batch * nheads * -(-headdim // WALK_SHORT_BLOCK_P)
    return 0 < programs <= sms


def short_walk_config(cfg: ForwardConfig) -> ForwardConfig:
    """`cfg` as the short walk runs it (`short_walk`): chunk 64, one run, WALK_SHORT_BLOCK_P
    channels a program at the compiler's occupancy (sm_90: 168 registers at 384 threads, one
    CTA an SM, 32 B of stack with D, 48 with every option), and the causal fix-up inside each
    program (`walk_fix_inline`). That fix-up inside the rule's larger walks lost: their compiles
    changed shape (the seed problem's runs at 4 warps and 243 registers, 64-channel
    programs with 512 B of stack) and the forward slowed from 0.155 to 0.247 ms at the seed
    problem, 0.237 -> 0.343 at B=2 T=8K H=48 and 0.234 -> 0.465 at dstate 256 (H100,
    2026-12-08, the same data file)."""
    return replace(cfg, scan_walk=1, chunk_size=64, scan_block_q=64,
                   scan_block_p=WALK_SHORT_BLOCK_P, state_segments=1, walk_occupancy=0,
                   walk_carry=0, walk_fix_inline=1)


def forward_config(batch, nheads, headdim, dstate, chunk_size, dtype, sms=DEFAULT_SMS, seqlen=None,
                   device_index=None, has_seq=False, ngroups=1, walk_ok=True) -> ForwardConfig:
    """The config a forward launch uses, in the precedence of `mamba2_cutile.config`: the shape
    rule, then the tuning table's overrides for the shape's bucket on this GPU when `seqlen`
    and `device_index` are given, then the seq_idx rule below, then the walk rule
    (`walk_form`, or `short_walk` up to 1024 tokens; not with seq_idx, nor where `walk_ok`
    is False: varlen states read the chunk states), then MAMBA2_CUTILE_CONFIG.
    `has_seq`: seq_idx is given (its same-sequence mask changes the best chunk_scan tile).
    `seqlen` and `ngroups` size the output grid for the rule (`uses_group_scan`)."""
    cfg = forward_shape_config(batch, nheads, headdim, dstate, chunk_size, dtype, sms, seqlen,
                               ngroups)
    if seqlen is not None and device_index is not None:
        from ..tuning import apply_forward
        cfg = apply_forward(cfg, batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim,
                            dstate=dstate, dtype=dtype, device_index=device_index)
    if has_seq and cfg.scan_block_q > 64:
        # after the tuning table, whose entries are measured without seq_idx: with seq_idx,
        # 64-token query blocks at 2 CTAs/SM (128-token blocks were slower with the
        # run-start mask: 0.335 against 0.306 ms at B=2 T=8K H=24 chunk 256 with z, dt_bias and
        # seq_idx; benchmarks/results/2026-11-30-h200-forward-sweep-options.jsonl)
        cfg = replace(cfg, scan_block_q=64, scan_occupancy=2)
    segments, occupancy = walk_form(batch, nheads, headdim, dstate, dtype, seqlen, sms)
    if walk_ok and not has_seq and segments:
        cfg = walk_config(cfg, segments, occupancy)
    elif walk_ok and not has_seq and short_walk(batch, nheads, headdim, dstate, dtype, seqlen,
                                                sms):
        cfg = short_walk_config(cfg)
    return _config.with_env(cfg, _config.ENV_FORWARD)


def segment_buffers(segments, nchunks, state, vector):
    """(S, (seg_final, seg_factor, chunk_factor)) of a segmented state pass: S = `segments`
    clamped to the chunk count, and the scratch of its runs (`kernels.chunk_state_pass`) in
    the dtype of `state` (B, H, P, N), (B, H, S, P, N) / (B, H, S) / (B, H, nchunks); with
    S = 1 the stand-ins `state` and `vector` (a 3-d float tensor), never read."""
    segs = max(1, min(segments, nchunks))
    if segs == 1:
        return 1, (state, vector, vector)
    b, h, p, n = state.shape
    new = lambda *s: torch.empty(s, dtype=state.dtype, device=state.device)  # noqa: E731
    return segs, (new(b, h, segs, p, n), new(b, h, segs), new(b, h, nchunks))


def group_scan_heads(cfg: ForwardConfig, heads_per_group: int) -> int:
    """The heads one output program walks (`ForwardConfig.scan_heads`), or 1 where
    chunk_scan_group does not apply: the flagging forms (scan_causal 1 to 3), C B^T from
    chunk_cb, or a persistent grid."""
    if (cfg.scan_heads <= 1 or cfg.scan_cb or cfg.scan_causal in (1, 2, 3)
            or cfg.scan_persistent):
        return 1
    return pow2_divisor(heads_per_group, cfg.scan_heads)


#: the largest state tile (scan_block_p x dstate_pad, float32) a walk program holds: at 64 x
#: 256 its fix-up launch fails to compile for sm_90 (tileiras exit status 5, 2026-12-07)
WALK_MAX_STATE = 64 * 128


def uses_walk(cfg: ForwardConfig, has_seq: bool) -> bool:
    """Whether the plan is the walk (`ForwardConfig.scan_walk`: kernels/chunk_scan_walk.py):
    asked for, no seq_idx, a causal mode it has (0, or 4 and 5: its own flags and fix-up
    launch), not scan_cb, a computed chunk of at most 128 tokens (a program holds the
    chunk's (Q, Q) scores and (Q, dstate) C and B tiles at once) and a state tile of at most
    WALK_MAX_STATE (so that an override of `scan_block_p` at dstate 256, meant for the
    three-kernel forward, takes that forward rather than a walk that does not build)."""
    return (bool(cfg.scan_walk) and not has_seq and cfg.scan_causal in (0, 4, 5)
            and not cfg.scan_cb and cfg.chunk_size <= 128
            and cfg.scan_block_p * cfg.dstate_pad <= WALK_MAX_STATE)


def walk_scale_x(cfg: ForwardConfig) -> bool:
    """Whether chunk_scan_walk's update puts the decay weights on X (its state tile is
    scan_block_p x dstate_pad): `state_scale_x` if set, else on the smaller operand."""
    if cfg.state_scale_x >= 0:
        return bool(cfg.state_scale_x)
    return cfg.dstate_pad > cfg.scan_block_p


def _decay_cumsum_call(dt, A, dt_bias, dt_lo, dt_hi, dt_softplus, seq_idx, seq_arg, seq_start,
                       dt_buf, cum_buf, nchunks, cfg, int64):
    """Launch 1: dt' and the chunk cumsums of A dt' (and the run starts with seq_idx)."""
    batch, nheads = dt.shape[0], dt.shape[2]
    return KernelCall(
        decay_cumsum_i64 if int64 else decay_cumsum,
        (batch * nchunks, -(-nheads // cfg.cumsum_block_h), 1),
        (dt, A, dt_bias if dt_bias is not None else A, float(dt_lo), float(dt_hi),
         dt_buf, cum_buf, seq_arg, seq_start, cfg.chunk_size, cfg.cumsum_block_h,
         dt_bias is not None, bool(dt_softplus), seq_idx is not None),
    )


def _state_pass_head(x, B, dt_buf, cum_buf, init, seq_arg, states, final, has_seq, segs,
                     seg_final, seg_factor, chunk_factor, flags, cfg: ForwardConfig):
    """chunk_state_pass's arguments before (FLAG, seg_entry, SEG_MODE), as both plans pass
    them (`init` None: `final` stands in, never read)."""
    nheads, ngroups = x.shape[2], B.shape[2]
    return (x, B, dt_buf, cum_buf, init if init is not None else final, seq_arg, states, final,
            cfg.chunk_size, cfg.state_block_p, cfg.state_block_n, nheads // ngroups,
            init is not None, has_seq, cfg.state_load_latency, scale_x(cfg),
            bool(cfg.state_fresh_acc), segs, seg_final, seg_factor, chunk_factor, flags)


def walk_plan(x, dt, A, B, C, z, D, dt_bias, dt_lo, dt_hi, dt_softplus, init, dt_buf, cum_buf,
              states, final, out, cfg: ForwardConfig):
    """The launches of the walk (`uses_walk`): decay_cumsum; with S = state_segments > 1
    (clamped to the chunks) chunk_state_pass for the runs' end states (SEG_MODE=1: `states`
    is never written, a stand-in will do) and chunk_state_carry for the states entering them
    and the final state (not with walk_carry, where each walk program forms its own and the
    last run writes the final state); chunk_scan_walk; with scan_causal 4 or 5
    chunk_scan_walk again over the flagged runs (FIX), unless each program does that itself
    (walk_fix_inline)."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    Q = cfg.chunk_size
    nchunks = cum_buf.shape[2] // Q
    seq_arg = seq_start = torch.empty((1, 1), dtype=torch.int32, device=x.device)
    segs, (seg_final, seg_factor, chunk_factor) = segment_buffers(
        cfg.state_segments, nchunks, final, cum_buf)
    carry = bool(cfg.walk_carry) and segs > 1
    flag = cfg.scan_causal in (4, 5)
    inline = flag and bool(cfg.walk_fix_inline)
    seg_entry = torch.empty(seg_final.shape if segs > 1 and not carry else (1, 1, 1, 1, 1),
                            dtype=final.dtype, device=x.device)
    p_tiles = -(-headdim // cfg.scan_block_p)
    flags = torch.empty((batch * nheads, p_tiles * segs) if flag and not inline else (1, 1),
                        dtype=torch.float32, device=x.device)
    int64 = needs_int64(x, dt, B, C, z, init, dt_buf, cum_buf, out, seg_final, seg_entry,
                        flags)
    calls = [_decay_cumsum_call(dt, A, dt_bias, dt_lo, dt_hi, dt_softplus, None, seq_arg,
                                seq_start, dt_buf, cum_buf, nchunks, cfg, int64)]
    if segs > 1:
        state_grid = (batch * nheads, -(-headdim // cfg.state_block_p),
                      -(-dstate // cfg.state_block_n) * segs)
        calls.append(KernelCall(
            with_hints(chunk_state_pass_i64 if int64 else chunk_state_pass,
                       cfg.state_occupancy),
            state_grid,
            _state_pass_head(x, B, dt_buf, cum_buf, init, seq_arg, states, final, False, segs,
                             seg_final, seg_factor, chunk_factor, flags, cfg)
            + (False, seg_entry, 1)))
        if not carry:
            calls.append(KernelCall(
                chunk_state_carry_i64 if int64 else chunk_state_carry, state_grid,
                (seg_final, seg_factor, chunk_factor, states, final, seg_entry,
                 cfg.state_block_p, cfg.state_block_n, segs, cfg.state_load_latency, False,
                 True, True)))
    walk_args = (x, B, C, z if z is not None else x, D if D is not None else A, dt_buf, cum_buf,
                 init if init is not None else final, seg_entry, final, out, flags,
                 seg_final if segs > 1 else seg_entry, seg_factor, Q,
                 cfg.scan_block_p, cfg.dstate_pad, nheads // ngroups,
                 0 if D is None else D.dim(), z is not None, init is not None,
                 cfg.scan_load_latency, bool(cfg.scan_lowp) and x.dtype != torch.float32,
                 walk_scale_x(cfg), segs, flag)
    walk = chunk_scan_walk_i64 if int64 else chunk_scan_walk
    grid = (batch * nheads, p_tiles, segs)
    options = (carry, inline)
    calls.append(KernelCall(with_hints(walk, cfg.walk_occupancy, cfg.walk_warps), grid,
                            walk_args + (False,) + options))
    if flag and not inline:
        # the flagged runs again, their bad chunks causally (no hints: a different program)
        calls.append(KernelCall(walk, grid, walk_args + (True,) + options))
    return calls


def forward_plan(x, dt, A, B, C, z, D, dt_bias, dt_lo, dt_hi, dt_softplus, init, seq_idx,
                 dt_buf, cum_buf, states, final, out, cfg: ForwardConfig):
    """The launches of the forward pass (module docstring; `walk_plan` where `uses_walk`).
    Unused optional inputs must be None."""
    if uses_walk(cfg, seq_idx is not None):
        return walk_plan(x, dt, A, B, C, z, D, dt_bias, dt_lo, dt_hi, dt_softplus, init,
                         dt_buf, cum_buf, states, final, out, cfg)
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    Q = cfg.chunk_size
    nchunks = cum_buf.shape[2] // Q
    if seq_idx is None:      # stand-ins for an absent seq_idx: never read (its flag is off)
        seq_arg = seq_start = torch.empty((1, 1), dtype=torch.int32, device=x.device)
    else:
        seq_arg = seq_idx
        # where each token's sequence run begins in its chunk (decay_cumsum writes it)
        seq_start = torch.empty((batch, nchunks * Q), dtype=torch.int32, device=x.device)
    # the segmented state pass (never more segments than chunks); its scratch in final's
    # dtype (float32 on the GPU)
    segs, (seg_final, seg_factor, chunk_factor) = segment_buffers(
        cfg.state_segments, nchunks, final, cum_buf)
    # scan_causal=4: chunk_state_pass's flags, one per (batch, head) and state program
    state_programs = (-(-headdim // cfg.state_block_p) * -(-dstate // cfg.state_block_n)
                      * segs)
    head_flags = cfg.scan_causal in (4, 5)
    chunk_flags = torch.empty((batch * nheads, state_programs) if head_flags
                              else (1, 1), dtype=torch.float32, device=x.device)
    # scan_cb: C B^T per chunk and group (blocks on or below the diagonal written, read), in
    # final's dtype (float32 on the GPU)
    cbuf = torch.empty((batch, nchunks, ngroups, Q, Q) if cfg.scan_cb else (1, 1, 1, 1, 1),
                       dtype=final.dtype, device=x.device)
    # segment_fold: the states entering the segments, added by the output launch (chunk_scan
    # or chunk_scan_group; a stand-in else)
    fold = segs > 1 and bool(cfg.segment_fold)
    # state_resweep: the runs' ends, their entering states, then the runs again from them
    resweep = segs > 1 and bool(cfg.state_resweep)
    seg_entry = torch.empty(seg_final.shape if fold or resweep else (1, 1, 1, 1, 1),
                            dtype=final.dtype, device=x.device)
    int64 = needs_int64(x, dt, B, C, z, seq_idx, seq_start, init, dt_buf, cum_buf, states, out,
                        seg_final, chunk_flags)
    # the scratch of scan_cb / segment_fold (the C B^T one can pass 2^31 elements before x
    # does: B * L * G * Q) turns 64-bit indexing on only in the launches that touch it
    wide = int64 or needs_int64(cbuf, seg_entry)
    n_q = -(-seqlen // cfg.scan_block_q)       # query blocks holding at least one token
    p_tiles = -(-headdim // cfg.scan_block_p)
    # chunk_scan's flags: scan_causal=1 counts per tile (in its grid's shape); 2 and 3 sums in
    # flag order, one per tile (2) or one per query row (3); a stand-in otherwise
    n_tiles = batch * nheads * n_q * p_tiles
    flags_shape = {1: (batch * nheads, n_q, p_tiles), 2: (n_tiles, 1),
                   3: (n_tiles, cfg.scan_block_q)}
    flags = torch.empty(flags_shape.get(cfg.scan_causal, (1, 1, 1)), dtype=torch.float32,
                        device=x.device)
    if cfg.scan_persistent:
        scan_grid = (min(n_tiles, cfg.scan_persistent * num_sms(x)), 1, 1)
    else:
        scan_grid = (n_q * batch * nheads, p_tiles, 1)
    n_state_tiles = -(-dstate // cfg.state_block_n)
    state_grid = (batch * nheads, -(-headdim // cfg.state_block_p), n_state_tiles * segs)
    state_head = _state_pass_head(x, B, dt_buf, cum_buf, init, seq_arg, states, final,
                                  seq_idx is not None, segs, seg_final, seg_factor,
                                  chunk_factor, chunk_flags, cfg)
    calls = [
        _decay_cumsum_call(dt, A, dt_bias, dt_lo, dt_hi, dt_softplus, seq_idx, seq_arg,
                           seq_start, dt_buf, cum_buf, nchunks, cfg, int64),
        KernelCall(
            with_hints(chunk_state_pass_i64 if int64 else chunk_state_pass, cfg.state_occupancy),
            state_grid,
            state_head + (head_flags and not resweep, seg_entry, 1 if resweep else 0),
        ),
        KernelCall(
            with_hints(chunk_scan_i64 if wide else chunk_scan, cfg.scan_occupancy, cfg.scan_warps),
            scan_grid,
            (x, B, C, z if z is not None else x, D if D is not None else A, dt_buf, cum_buf,
             seq_start, states, cbuf, seg_entry, chunk_factor, out, Q, cfg.scan_block_q,
             cfg.scan_block_p,
             cfg.dstate_pad, nheads // ngroups, 0 if D is None else D.dim(), z is not None,
             seq_idx is not None, cfg.scan_load_latency, cfg.scan_persistent > 0,
             bool(cfg.scan_lowp) and x.dtype != torch.float32,
             bool(cfg.scan_head_major),
             min(cfg.scan_block_n or cfg.dstate_pad, cfg.dstate_pad), bool(cfg.scan_cb),
             segs if fold else 1, 1, flags,
             (0, 1, 3, 5, 0, 0)[cfg.scan_causal]),
        ),
    ]
    if cfg.scan_cb:
        nbpc = Q // cfg.scan_block_q
        calls.insert(2, KernelCall(chunk_cb_i64 if wide else chunk_cb,
                                   (nchunks * batch * ngroups, nbpc, nbpc),
                                   (B, C, cbuf, Q, cfg.scan_block_q, cfg.dstate_pad)))
    if segs > 1:
        # each segment's entering state added to its local states (fold, resweep: only
        # written, for the output launch or the second pass), the final state
        calls.insert(2, KernelCall(
            chunk_state_carry_i64 if wide else chunk_state_carry, state_grid,
            (seg_final, seg_factor, chunk_factor, states, final, seg_entry, cfg.state_block_p,
             cfg.state_block_n, segs, cfg.state_load_latency, False, True, fold or resweep)))
    if resweep:
        # the runs again, from their entering states, writing the chunk states (and the flags)
        # (seg_entry has seg_final's shape, which `int64` counts)
        calls.insert(3, KernelCall(calls[1].kernel, state_grid,
                                   state_head + (head_flags, seg_entry, 2)))
    scan = calls[-1]
    heads = group_scan_heads(cfg, nheads // ngroups)
    if heads > 1:
        # the plain tile for `heads` heads of a group per program (kernels/chunk_scan_group.py);
        # a fix-up launch below still takes chunk_scan's arguments from `scan`
        calls[-1] = KernelCall(
            with_hints(chunk_scan_group_i64 if wide else chunk_scan_group, cfg.scan_occupancy,
                       cfg.scan_warps),
            (n_q * batch * ngroups * (nheads // ngroups // heads), p_tiles, 1),
            (x, B, C, z if z is not None else x, D if D is not None else A, dt_buf, cum_buf,
             seq_start, states, seg_entry, chunk_factor, out, Q, cfg.scan_block_q,
             cfg.scan_block_p, cfg.dstate_pad, nheads // ngroups,
             heads, 0 if D is None else D.dim(), z is not None, seq_idx is not None,
             cfg.scan_load_latency, bool(cfg.scan_lowp) and x.dtype != torch.float32,
             min(cfg.scan_block_n or cfg.dstate_pad, cfg.dstate_pad), segs if fold else 1))
    if cfg.scan_causal == 1:
        # the same grid again: tiles with non-finite outputs are recomputed causally
        calls.append(KernelCall(scan.kernel, scan.grid, scan.args[:-1] + (2,)))
    elif head_flags:
        # a program per (batch, head) (5: and tile of a chunk): where chunk_state_pass flagged
        # it, the chunks holding a non-finite input, every tile causally (without the scan's
        # hints, as the FIX_SPAN pass below)
        # (scan_causal 4's chunk_scan launch is the default one, FLAG_W = 1: the same kernel)
        per_tile = cfg.scan_causal == 5
        calls.append(KernelCall(chunk_scan_i64 if wide else chunk_scan,
                                (batch * nheads,
                                 (Q // cfg.scan_block_q) * p_tiles if per_tile else 1, 1),
                                scan.args[:-3] + (next_pow2(state_programs), chunk_flags,
                                                  9 if per_tile else 8)))
    elif cfg.scan_causal >= 2:
        # a program per FIX_SPAN tiles: those whose sums are not finite, causally. Without the
        # scan's occupancy / warps hints: under the seed problem's tuned occupancy 2 this
        # launch compiled (384 threads) but did not return on the H200 even on clean input
        # (every program loads its sums and exits), and at 128-token query blocks it failed
        # to compile (tileiras return code 5)
        calls.append(KernelCall(chunk_scan_i64 if wide else chunk_scan,
                                (-(-n_tiles // FIX_SPAN), 1, 1),
                                scan.args[:-1] + (2 * cfg.scan_causal,)))
    return calls


def ssd_forward_cuda(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                     initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                     dt_limit=(0.0, float("inf")), state_dtype=None, config=None):
    """Launch the forward kernels. Inputs must already be validated. No host synchronization."""
    calls, out, final, (dt_buf, cum_buf, states), (x, B, init) = forward_launches(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
        dt_limit, state_dtype, config, need_states=cu_seqlens is not None)
    b, l, h, p = x.shape
    state_dtype = state_dtype if state_dtype is not None else C.dtype
    if not calls:                # l = 0 or no heads: nothing to launch
        final = init.clone() if init is not None else final.zero_()
        varlen = None
        if cu_seqlens is not None:
            varlen = empty_varlen_states(cu_seqlens, init, (h, p, B.shape[3]), state_dtype)
        return out, final, varlen
    launch_calls(calls, x.device)
    varlen = None
    if cu_seqlens is not None:
        varlen = varlen_states(x, B, dt_buf, cum_buf, states, init, cu_seqlens).to(state_dtype)
    return out, final, varlen


def varlen_states(x, B, dt_buf, cum_buf, states, init, cu_seqlens):
    """The state after each of `cu_seqlens`' sequences (float32), from the buffers of
    `forward_launches` after its launches ran, at the chunk length they were computed with
    (`ForwardConfig.chunk_size`, which may differ from the caller's)."""
    return varlen_states_from_chunks(x, B, dt_buf, cum_buf, states, init, cu_seqlens,
                                     cum_buf.shape[2] // states.shape[2])


def forward_launches(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                     initial_states=None, seq_idx=None, dt_softplus=False,
                     dt_limit=(0.0, float("inf")), state_dtype=None, config=None,
                     need_states=False):
    """The forward's planned launches and the buffers they write, for CUDA inputs:
    (calls, out, final, (dt_buf, cum_buf, states), (x, B, init) as the kernels read them).
    The buffers are at the chunk length the config computes with (`ForwardConfig.chunk_size`,
    which may differ from `chunk_size`).
    `calls` is empty when there is nothing to launch (l = 0 or b * h = 0). `need_states`:
    `states` must hold the chunks' entry states afterwards (varlen states read them), so
    segment_fold, which leaves them local, and the walk, which writes none, are off."""
    b, l, h, p = x.shape
    n = B.shape[3]
    Q = chunk_size
    dev = x.device
    state_dtype = state_dtype if state_dtype is not None else C.dtype
    mm = x.dtype
    x = as_kernel_input(x)
    B, C, z = (as_kernel_input(t, mm) for t in (B, C, z))
    dt = as_kernel_input(dt)
    A = as_kernel_input(A, torch.float32)
    D = as_kernel_input(D, torch.float32)
    dt_bias = as_kernel_input(dt_bias, torch.float32)
    init = as_kernel_input(initial_states, torch.float32)
    if seq_idx is not None:
        seq_idx = seq_ids_int32(seq_idx)

    final = torch.empty((b, h, p, n), dtype=torch.float32, device=dev)
    out = torch.empty((b, l, h, p), dtype=x.dtype, device=dev)
    cfg = None
    if l > 0 and b * h > 0:
        cfg = config or forward_config(b, h, p, n, Q, x.dtype, num_sms(dev), seqlen=l,
                                       device_index=dev.index or 0, has_seq=seq_idx is not None,
                                       ngroups=B.shape[2], walk_ok=not need_states)
        Q = cfg.chunk_size          # the chunk the kernels compute with
        if need_states and (cfg.segment_fold or cfg.scan_walk):
            cfg = replace(cfg, segment_fold=0, scan_walk=0)
    nchunks = -(-l // Q)
    dt_buf = torch.empty((b, h, nchunks * Q), dtype=torch.float32, device=dev)
    cum_buf = torch.empty((b, h, nchunks * Q), dtype=torch.float32, device=dev)
    # the walk writes no chunk state: a stand-in, so the forward holds no (B, H, C, P, N)
    # buffer (its only other reader, varlen states, turned the walk off above)
    walk = cfg is not None and uses_walk(cfg, seq_idx is not None)
    states = torch.empty((1, 1, 1, 1, 1) if walk else (b, h, nchunks, p, n), dtype=state_dtype,
                         device=dev)
    bufs = (dt_buf, cum_buf, states)
    if cfg is None:              # a zero-sized grid is a launch error
        return [], out, final, bufs, (x, B, init)
    lo, hi = dt_clamp_bounds(dt_limit)
    calls = forward_plan(x, dt, A, B, C, z, D, dt_bias, lo, hi, dt_softplus, init, seq_idx,
                         dt_buf, cum_buf, states, final, out, cfg)
    return calls, out, final, bufs, (x, B, init)
