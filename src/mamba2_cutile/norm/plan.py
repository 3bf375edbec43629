"""Gated RMSNorm on CUDA tensors: its config, the plans of its forward launch and its backward
launch, and the launchers.

| pass | kernel (padded / chunked) | grid |
| --- | --- | --- |
| forward | `rmsnorm_gated_fwd` / `_fwd_chunked` | (cdiv(M, block_m), G): block_m rows x 1 group |
| forward (fwd_ctas_per_sm) | `rmsnorm_gated_fwd_chunked` | (P, G): P programs walk the rows |
| backward | `rmsnorm_gated_bwd` / `_bwd_chunked` | (P, G): the same walk, partial dw / db |

A group width S that is not a power of two but S = m * 2^k with 2^k >= MIN_CHUNK (1536 =
3 * 512, 2560 = 5 * 512, 5120 = 5 * 1024, 7680 = 15 * 512), up to MAX_CHUNKED_GROUP, takes
the chunked kernels: the group is read as S / chunk column chunks of `NormConfig.chunk`
channels, so no lane is padding. Other widths (powers of two, 1000 = 125 * 8, 37) keep the
padded kernels, whose tile is the power of two >= S.

The backward's (P, G, S) partial sums of dweight and dbias are then summed over P in a fixed
order (the result does not depend on scheduling) by a second launch, `sum_partials`, which
writes them in the parameters' dtype (`NormConfig.bwd_reduce=0`: `torch.sum` and a cast).

Rows are (M, hidden) views with a unit channel stride (any row stride: slices of a wider
projection are read in place), seen by the kernels as (M, G, S) with S = group_size. Plans are
built from tensors (real CUDA tensors at run time, `meta` tensors for the CPU compile check)
and read no tensor values, so they are safe under CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import config as _config
from ..kernels.rmsnorm_gated_bwd import rmsnorm_gated_bwd, rmsnorm_gated_bwd_i64
from ..kernels.rmsnorm_gated_bwd_chunked import (rmsnorm_gated_bwd_chunked,
                                                 rmsnorm_gated_bwd_chunked_i64)
from ..kernels.rmsnorm_gated_fwd import rmsnorm_gated_fwd, rmsnorm_gated_fwd_i64
from ..kernels.rmsnorm_gated_fwd_chunked import (rmsnorm_gated_fwd_chunked,
                                                 rmsnorm_gated_fwd_chunked_i64)
from ..runtime import (DEFAULT_SMS, KernelCall, as_kernel_input, launch_calls,
                       narrow_unit_strides, needs_int64, next_pow2, num_sms, sum_partials_call,
                       with_hints)

#: the largest group the kernels take: a group is one register tile, and past this size the
#: backward's tiles no longer fit in registers
MAX_GROUP_SIZE = 16384
#: the grid's second dimension (one program column per group) is limited to 65535 by CUDA
MAX_GROUPS = 65535
ENV_NORM = "MAMBA2_CUTILE_NORM_CONFIG"
#: the chunked kernels' chunk widths: narrower chunks make short row segments (under 128 bytes
#: of bf16), wider ones are no longer needed to cover a group in few chunks
MIN_CHUNK, MAX_CHUNK = 64, 4096
#: at most this many chunks per group (each is unrolled in the kernels)
MAX_CHUNKS = 32
#: the shape rule's largest group for the chunked kernels (`group_chunk`)
MAX_CHUNKED_GROUP = 10240


@dataclass(frozen=True)
class NormConfig:
    """Tile sizes and hints of the two gated-RMSNorm kernels.

    block_g: the channel tile, the power of two >= group_size (set by the problem).
    block_m / bwd_block_m: rows per tile of the forward / backward kernel.
    bwd_ctas_per_sm: the backward's grid holds about this many programs per SM over all groups
    (each walks its share of the row blocks and writes one row of partial sums).
    occupancy, warps (forward) and bwd_occupancy, bwd_warps: kernel hints, 0 = the compiler's.
    tma / bwd_tma: 1 lets the row tiles load and store through TMA (staged in shared memory),
    0 makes them plain loads and stores; bwd_tma=2 loads through TMA and stores plainly from
    registers in the chunked kernels (the padded ones take it as 1).
    chunk: 0 runs the padded kernels (one (rows, block_g) tile per group); a power of two
    dividing the group size runs the chunked kernels, which read the group as
    group_size / chunk column chunks (at most MAX_CHUNKS) and pad nothing.
    fwd_ctas_per_sm: 0 gives the forward one program per row block; n > 0 (chunked kernels
    only) a persistent grid of about n programs per SM over all groups, each walking its share
    of the row blocks.
    approx: 1 computes the gate's sigmoid through the approximate exp2 and reciprocal when x
    and z are both 16-bit (relative error ~2^-21, under their rounding); 0, and any float32 x
    or z, the IEEE division and expf.
    bwd_regate: 1 (chunked kernels, gate first) makes the backward's second pass reload x and
    z and recompute the gate instead of holding it per chunk (fewer registers; timed slower,
    see `norm_shape_config`).
    bwd_latency: the latency hint of the backward's first-pass row loads (1-10; 0: none, the
    compiler's choice; pass 2's reloads under bwd_regate take none).
    bwd_reduce: 1 sums the backward's partial dweight / dbias and casts them in one launch of
    `kernels.sum_partials`; 0 through `torch.sum` and a cast (two launches per tensor).
    """
    block_g: int
    block_m: int
    bwd_block_m: int
    bwd_ctas_per_sm: int = 4
    occupancy: int = 0
    warps: int = 0
    bwd_occupancy: int = 0
    bwd_warps: int = 0
    tma: int = 1
    bwd_tma: int = 1
    chunk: int = 0
    fwd_ctas_per_sm: int = 0
    approx: int = 1
    bwd_regate: int = 0
    bwd_latency: int = 0
    bwd_reduce: int = 1

    FIXED = ("block_g",)

    def __post_init__(self):
        c = _config
        v = self.block_g
        if not isinstance(v, int) or v < 1 or v & (v - 1) or v > MAX_GROUP_SIZE:
            raise ValueError(f"NormConfig: block_g={v!r} is not a power of two in "
                             f"1..{MAX_GROUP_SIZE}")
        c.check_pow2(self, "block_m", "bwd_block_m")
        c.check_range(self, "bwd_ctas_per_sm", 1, 32)
        c.check_range(self, "occupancy", 0, 32)
        c.check_range(self, "bwd_occupancy", 0, 32)
        c.check_choice(self, "warps", (0, 4, 8))
        c.check_choice(self, "bwd_warps", (0, 4, 8))
        c.check_choice(self, "tma", (0, 1))
        c.check_choice(self, "bwd_tma", (0, 1, 2))
        c.check_choice(self, "approx", (0, 1))
        c.check_choice(self, "bwd_regate", (0, 1))
        c.check_range(self, "bwd_latency", 0, 10)
        c.check_choice(self, "bwd_reduce", (0, 1))
        if self.bwd_regate and not self.chunk:
            raise ValueError(f"NormConfig: bwd_regate={self.bwd_regate} needs the chunked "
                             f"kernels (chunk > 0)")
        v = self.chunk
        if not isinstance(v, int) or v < 0 or v & (v - 1) or 0 < v < MIN_CHUNK \
                or v > MAX_CHUNK:
            raise ValueError(f"NormConfig: chunk={v!r} is not 0 or a power of two in "
                             f"{MIN_CHUNK}..{MAX_CHUNK}")
        c.check_range(self, "fwd_ctas_per_sm", 0, 32)
        if self.fwd_ctas_per_sm and not self.chunk:
            raise ValueError(f"NormConfig: fwd_ctas_per_sm={self.fwd_ctas_per_sm} needs the "
                             f"chunked kernels (chunk > 0; chunk=0 is the padded forward, one "
                             f"program per row block)")


def norm_shape_config(group_size: int, gate_first: bool = False) -> NormConfig:
    """The dispatcher's rule, from the group size and the gate order alone (no search, no
    synchronization); `gate_first`: z given with norm_before_gate=False.

    Timed on the H200 (bf16, z gate, 16384 rows of 4096, one group and eight groups; every
    override of `bench.norm.sweep_space`, CUDA graph, L2 flushed;
    benchmarks/results/2026-12-01-h200-norm-sweep.json):
    - forward: a tile of about 4096 channels (block_m rows of the padded group) at occupancy 4,
      and two rows for a 4096-channel group: 131.7 us = 3059 GB/s (71% of 4.3 TB/s) against
      227 us for one row at occupancy 2; at groups of 512 eight rows at occupancy 4 were the
      best (2621 GB/s; sixteen rows fell to 1144 GB/s).
    - backward: about 4096 channels per tile up to 1024-channel groups, one row from 2048
      (two rows of 2048 spill 64 bytes), two programs per SM, occupancy 2: 228 us = 2943 GB/s
      at one 4096-channel group (248 us with four programs per SM), 239.5 us = 2805 GB/s at
      groups of 512 (eight rows; four rows 293 us).
    Only groups of 512 and 4096 were timed; the other sizes take the same tile sizes in
    channels untimed. The occupancy hints cap the registers per thread where the tiles fit
    (CPU compiles for sm_90, `bench.resources`: forward 64 registers at occupancy 4 up to
    4096-channel groups (8 bytes of stack at 4096), backward 128 at occupancy 2); a group of
    8192 needs 8 warps at occupancy 1 in the backward (168 registers).
    `MAMBA2_CUTILE_NORM_CONFIG` overrides any field.

    Group widths S = m * 2^k that are not powers of two (`group_chunk`) take the chunked
    kernels with chunks of 2^k channels (at most 1024): forward rows per tile the power of
    two <= 8192 / S (at least 1), 8 warps from 1024 to 2048 channels, occupancy 4 up to 5120
    channels, 2 above (8 warps from 8192); the backward one row per tile from 1024 channels
    (below: the power of two <= 4096 / S), from 1024 to 2560 channels at four programs per SM,
    occupancy 4, 4 warps, else two per SM at occupancy 2 up to 5120 channels, 1 above, with 8
    warps above 4096. Timed on the H200 (16384 rows, bf16, z gate, one group;
    benchmarks/results/2026-12-02-h200-norm-sweep-chunked.txt and ...-norm-sweep-combinations
    .txt), against the chunked rule before these hints: 1536 channels forward 66.3 -> 56.3
    us with 8 warps (62% of 4.3 TB/s; 69% at 65536 rows), backward 127.8 -> 103.1 us (57%;
    64% at 65536 rows); 2560: forward 105.3 us (56%; 99.0 under the later hints below),
    backward 187.6 -> 161.5 us (60%); 5120:
    occupancy 4 forward 295.7 -> 191.2 us (61%), backward occupancy 2 420.6 -> 312.7 us (62%).
    The padded kernels at these widths: 106.6, 138.9, 184.7, 215.6, 405.9, 510.5 us. Above
    5120 channels only 7680 (padded since: see `group_chunk`) and 10240 are timed. sm_90
    compiles (bf16, `bench.resources`): with the norm before the gate the forward has 64
    registers and no stack up to 5120 channels but at 1536 (8 warps: 40 registers, 56 bytes)
    and, under the later hints, 2560 (88 bytes), the backward no stack but at 2560 (four per
    SM: 64 registers, 16 bytes) and 7680 (168, 24); with the gate first (mamba_ssm's Mamba2 default;
    these hints were timed with the norm first only) the forward spills 56 bytes at 1536 and
    16 at 3072, the backward 8 at 1536 with a bias, 160 at 2560, 24 at 3072, 128 at 5120 and
    176 at 7680. So the gate-first order keeps the chunked kernels' first hints
    (`_chunked_base_config`, no stack in the backward at these widths) but where timed in
    that order (2026-12-02, `bench.norm --sweep --gate-first`, 16384 rows, bf16,
    benchmarks/results/2026-12-02-h200-conv1d-bwd-ctas-norm-sweeps.txt): from 1024 to 2560
    channels forward two rows, 4 warps, occupancy 6 (1536: 64.6 -> 62.5 us, 2560: 109.6 ->
    100.4), backward one row, three programs per SM, occupancy 3, 4 warps (127.6 -> 103.4
    us, 200.7 -> 185.0); at 5120 the forward one row, 4 warps, occupancy 6 (299.1 -> 190.6
    us; its backward keeps the base tiles, nothing timed was faster, and since takes the
    load latency hint below). These spill (sm_90 compile)
    24 / 80 bytes in the forward at 1536 / 2560, 32 in the backward at 2560, 72 in the forward
    at 5120, and were timed faster all the same. With the norm first, the same forward hints
    at 2560 (105.1 -> 99.0 us; 88 bytes of stack). Groups of 1024 (padded) take one row per
    tile at occupancy 8, 4 warps (8 x 1024: 312.1 -> 292.3 us norm first, 311.0 -> 299.8 gate
    first; 32 registers, no stack). Fully plain kernels (tma=0, no TMA producer warps since
    that date) were behind these hints at every width; against the older rule they were
    ahead only at the gate-first backward at 1536 (107.4 us), the gate-first forward at 5120
    (247.6) and, within 2%, the norm-first backward at 1536 (100.5 against 102.5).
    Twice the forward's rows no longer fit its staging buffers at occupancy 4 (1536 x 8 rows:
    81 KB of shared memory, and the compiler drops the occupancy hint: 255 registers, one
    program per SM).

    The gate's sigmoid (`NormConfig.approx`, 16-bit x and z) through the approximate exp2 and
    reciprocal in place of the IEEE division and expf, timed on the H200 (16384 rows, bf16,
    same run, benchmarks/results/2026-12-02-h200-norm-approx-sigmoid-sweeps.txt), IEEE ->
    approximate under the same hints: gate first, forward 65.1 -> 50.5 us (1536), 105.8 ->
    79.1 (2560), 135.0 -> 103.9 (3072), 200.0 -> 161.0 (5120), 314.1 -> 265.2 (8 x 1024);
    backward 103.9 -> 89.3, 185.0 -> 156.0, 181.8 -> 142.3, 438.3 -> 344.7, 429.3 -> 385.7;
    norm first, forward 59.0 -> 45.5, 103.8 -> 74.5, 136.4 -> 110.6, 195.1 -> 147.0, 308.1 ->
    260.1, backward 103.1 -> 90.4, 161.4 -> 137.1, 174.8 -> 138.0, 313.3 -> 261.0, 421.2 ->
    383.8. The kernels had been issue-bound as much as memory-bound (ncu of the 1536
    backward: 45% of DRAM bandwidth, 56% of SM throughput). With it, in the gate-first order
    (...-norm-approx-backward-sweep.txt): 1536 channels forward at occupancy 8 (49.9 -> 48.0
    us, 73%; 173.6 us = 81% at 65536 rows), 3072 one row at occupancy 8 (103.9 -> 96.7 us),
    groups of 1024 two rows at occupancy 8 (265.3 -> 232.3 us, 81%; with the norm first
    the one-row rule stays: the sweep of two rows there was cut). No backward hint beat the rule by more than noise at 1536,
    2560 or 5120 (two or four programs per SM, two rows, plain loads at 8 per SM, occupancy 2:
    5-300% slower; 8 warps level at 5120, 342.5 against 344.2 us, slower elsewhere). The
    backward's load latency hint (`bwd_latency`, 2026-12-02 night,
    benchmarks/results/2026-12-02-h200-norm-bwd-latency-regate-sweep.txt, gate first): 4 at
    5120 (342.3 -> 324.4 us, 60%; 2: 330.4, 8: 377.1). At 1536 hint 2 compiles to the rule's
    own code and 4 / 8 were 11-14% slower (98.9 / 101.6 against 89.0 us); at 2560 every hint
    compiles to the rule's code. The second pass's reloads (`bwd_regate`) were slower at
    1536 (109-132 us against 88.9) and 2560 (170-210 against 155); at 5120, 331 us at
    occupancy 2 beat the unhinted 342 but not the hinted 324 (418-678 at 3-4 per SM).
    Plain stores in the chunked backward (`bwd_tma=2`: no shared-memory staging, fence and
    bulk copy per tile; benchmarks/results/2026-12-02-h200-norm-bwd-plain-stores-sweep.txt),
    gate first: 89.9 -> 84.6 us (65 -> 69%) at 1536, 155.6 -> 144.4 (63 -> 68%) at 2560,
    325.2 -> 283.9 (60 -> 69%) at 5120, 316.7 -> 304.9 (74 -> 77%) at 65536 x 1536; norm
    first 90.1 -> 87.2 at 1536, 260.1 -> 254.8 at 5120.
    """
    chunk = group_chunk(group_size)
    if not chunk:
        cfg = padded_shape_config(group_size)
        if group_size == 1024:              # occupancy 8: timed at 8 x 1024; two rows gate
            # first (265.3 -> 232.3 us), one row with the norm first (two untimed there)
            cfg = replace(cfg, block_m=2 if gate_first else 1, warps=4, occupancy=8)
        return cfg
    # the backward's stores from registers, its loads through TMA (bwd_tma=2): timed at
    # 1536, 2560 and 5120 in both orders, 3-14% faster
    cfg = replace(_chunked_base_config(group_size, chunk), bwd_tma=2)
    if gate_first:
        if 1024 < group_size <= 2560:       # timed at 1536, 2560
            cfg = replace(cfg, block_m=2, warps=4, occupancy=6, bwd_block_m=1,
                          bwd_ctas_per_sm=3, bwd_occupancy=3, bwd_warps=4)
        if 1024 < group_size < 2048:        # occupancy 8: timed at 1536
            cfg = replace(cfg, occupancy=8)
        if 2560 < group_size <= 3072:       # timed at 3072 (forward only)
            cfg = replace(cfg, block_m=1, warps=4, occupancy=8)
        if 4096 < group_size <= 5120:       # timed at 5120; the backward's latency hint
            # 342.3 -> 324.4 us (2 -> 330.4, 8 -> 377.1; slower at 1536, the same code at 2560)
            cfg = replace(cfg, block_m=1, warps=4, occupancy=6, bwd_latency=4)
        return cfg
    if 4096 < group_size <= 5120:           # timed at 5120
        cfg = replace(cfg, occupancy=4, bwd_occupancy=2)
    if 1024 < group_size < 2048:            # the forward's 8 warps: timed at 1536
        cfg = replace(cfg, warps=8)
    if 2048 < group_size <= 2560:           # timed at 2560
        cfg = replace(cfg, block_m=2, warps=4, occupancy=6)
    if 1024 < group_size <= 2560:           # the backward's 4 per SM: timed at 1536, 2560
        cfg = replace(cfg, bwd_block_m=1, bwd_ctas_per_sm=4, bwd_occupancy=4, bwd_warps=4)
    return cfg


def _chunked_base_config(group_size: int, chunk: int) -> NormConfig:
    """The chunked kernels' config before the 2026-12-02 sweeps (the padded rule's tiles, in
    channels): what the gate-first order takes, and what the timed hints start from."""
    rows = prev_pow2(max(1, 4096 // group_size))
    return NormConfig(block_g=next_pow2(group_size),
                      block_m=prev_pow2(max(1, 8192 // group_size)),
                      bwd_block_m=min(32, rows) if group_size < 2048 else 1,
                      bwd_ctas_per_sm=2, occupancy=4 if group_size <= 4096 else 2,
                      warps=8 if group_size >= 8192 else 0,
                      bwd_occupancy=2 if group_size <= 4096 else 1,
                      bwd_warps=8 if group_size > 4096 else 0, chunk=chunk)


def padded_shape_config(group_size: int) -> NormConfig:
    """The rule's padded-kernel config (chunk=0): what every group size took before the
    chunked kernels, and what powers of two and widths without a chunking still take."""
    bg = next_pow2(group_size)
    bm = max(1, min(64, 4096 // bg)) if bg < 4096 else max(1, 8192 // bg)
    bbm = max(1, min(32, 4096 // bg)) if bg <= 1024 else 1
    return NormConfig(block_g=bg, block_m=bm, bwd_block_m=bbm, bwd_ctas_per_sm=2,
                      occupancy=4 if bg <= 4096 else 2,
                      warps=8 if bg >= 8192 else 0,
                      bwd_occupancy=2 if bg <= 4096 else 1,
                      bwd_warps=8 if bg >= 8192 else 0)


def prev_pow2(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (int(n).bit_length() - 1)


def group_chunk(group_size: int, max_chunk: int = 1024) -> int:
    """The chunk width of the chunked kernels for this group size: its largest power-of-two
    divisor, at most `max_chunk`; 0 (the padded kernels) for a power of two, for a size
    whose chunks would be narrower than MIN_CHUNK or more than MAX_CHUNKS (1000 = 125 * 8),
    and above MAX_CHUNKED_GROUP, where the chunks held in registers spill (15360 = 15 * 1024:
    536 bytes per thread in the backward, sm_90 compile) and padding to 16384 wastes at most
    3/8 of a tile; and above 5120 channels where padding wastes at most 1/16 of the tile
    (7680 = 15 * 512 in 8192): the chunked kernels hold the row at one or two programs per SM
    there, 168 registers in the backward, and ran at 42-43% / 35-36% of 4.3 TB/s (forward /
    backward, 16384 rows, bf16, both gate orders) against 69-73% / 74-78% for the padded
    kernels at 8 warps (benchmarks/results/2026-12-03-h200-norm-sweep-wide-groups.jsonl; the
    nearest chunked variant was 1.49x slower: occupancy 3-6, 8 warps, plain loads, a
    persistent grid, and a backward reloading every row tile in its second pass, 1.2-2.2 ms,
    were timed)."""
    if group_size & (group_size - 1) == 0 or group_size > MAX_CHUNKED_GROUP:
        return 0
    if group_size > 5120 and 16 * (next_pow2(group_size) - group_size) <= next_pow2(group_size):
        return 0
    chunk = min(group_size & -group_size, max_chunk)
    if chunk < MIN_CHUNK or group_size // chunk > MAX_CHUNKS:
        return 0
    return chunk


def norm_config(group_size: int, gate_first: bool = False) -> NormConfig:
    """The config a launch uses: the shape rule, then `MAMBA2_CUTILE_NORM_CONFIG`
    ("field=value,..."), in the precedence of `mamba2_cutile.config`."""
    return _config.with_env(norm_shape_config(group_size, gate_first), ENV_NORM)


def fwd_programs(rows: int, ngroups: int, cfg: NormConfig, sms: int = DEFAULT_SMS) -> int:
    """The forward grid's first size: one program per row block, or with fwd_ctas_per_sm
    about that many programs per SM over all groups, never more than there are row blocks."""
    row_blocks = -(-rows // cfg.block_m)
    if not cfg.fwd_ctas_per_sm:
        return row_blocks
    return max(1, min(row_blocks, -(-cfg.fwd_ctas_per_sm * sms // ngroups)))


def bwd_programs(rows: int, ngroups: int, cfg: NormConfig, sms: int = DEFAULT_SMS) -> int:
    """P, the backward's programs per group: about cfg.bwd_ctas_per_sm per SM over all groups,
    never more than there are row blocks (at least 1)."""
    row_blocks = -(-rows // cfg.bwd_block_m)
    want = -(-cfg.bwd_ctas_per_sm * sms // ngroups)
    return max(1, min(row_blocks, want))


def rows_view(t, group_size):
    """(M, hidden) rows with a unit channel stride -> the kernels' (M, G, S) view (no copy;
    size-1 dimensions get strides that fit int32, `runtime.narrow_unit_strides`)."""
    m, hidden = t.shape
    return narrow_unit_strides(t.view(m, hidden // group_size, group_size))


def check_chunk(cfg: NormConfig, group_size: int):
    """A chunked config must cut the group into whole chunks, at most MAX_CHUNKS of them."""
    if cfg.chunk and (group_size % cfg.chunk or group_size // cfg.chunk > MAX_CHUNKS):
        raise ValueError(f"NormConfig: chunk={cfg.chunk} must divide group_size "
                         f"({group_size}) into at most {MAX_CHUNKS} chunks (chunk=0: the "
                         f"padded kernels)")


def _tiling(cfg: NormConfig, group_size: int):
    """The kernels' channel constants: (BLOCK_G,) padded, (CHUNK, NCHUNK) chunked."""
    check_chunk(cfg, group_size)
    return (cfg.chunk, group_size // cfg.chunk) if cfg.chunk else (cfg.block_g,)


def _approx(cfg: NormConfig, x3, z3) -> bool:
    """The kernels' APPROX: the approximate sigmoid where the config allows it and x and z
    are both 16-bit (a float32 x or z keeps the IEEE form)."""
    half = (torch.float16, torch.bfloat16)
    return bool(cfg.approx) and x3.dtype in half and (z3 is None or z3.dtype in half)


def forward_plan(x3, z3, w2, b2, out3, rstd, eps, norm_before_gate, cfg: NormConfig,
                 sms: int = DEFAULT_SMS):
    """The forward launch. x3, z3, out3 (M, G, S); w2, b2 (G, S); rstd (G, M) float32; absent
    z3 / b2 are None; `sms` sizes a persistent grid (fwd_ctas_per_sm)."""
    m, g, s = x3.shape
    int64 = needs_int64(x3, z3, out3, rstd)
    if cfg.chunk:
        kernel = rmsnorm_gated_fwd_chunked_i64 if int64 else rmsnorm_gated_fwd_chunked
    else:
        kernel = rmsnorm_gated_fwd_i64 if int64 else rmsnorm_gated_fwd
    persistent = (bool(cfg.fwd_ctas_per_sm),) if cfg.chunk else ()
    return [KernelCall(
        with_hints(kernel, cfg.occupancy, cfg.warps), (fwd_programs(m, g, cfg, sms), g, 1),
        (x3, z3 if z3 is not None else x3, w2, b2 if b2 is not None else w2, out3, rstd,
         float(eps), cfg.block_m, *_tiling(cfg, s), z3 is not None, b2 is not None,
         bool(norm_before_gate), bool(cfg.tma), *persistent, _approx(cfg, x3, z3)))]


def backward_plan(x3, z3, w2, b2, rstd, dout3, dx3, dz3, dw_part, db_part, norm_before_gate,
                  cfg: NormConfig, dw2=None, db2=None, sms: int = DEFAULT_SMS):
    """The backward launch; dw_part (and db_part with a bias) (P, G, S) float32, P their first
    size. Absent z3 / dz3 / b2 / db_part are None. With dw2 (G, S) (and db2 with a bias) and
    cfg.bwd_reduce, then the launch that sums the partials into them."""
    _, g, s = x3.shape
    int64 = needs_int64(x3, z3, dout3, dx3, dz3, rstd)
    if cfg.chunk:
        kernel = rmsnorm_gated_bwd_chunked_i64 if int64 else rmsnorm_gated_bwd_chunked
    else:
        kernel = rmsnorm_gated_bwd_i64 if int64 else rmsnorm_gated_bwd
    calls = [KernelCall(
        with_hints(kernel, cfg.bwd_occupancy, cfg.bwd_warps), (dw_part.shape[0], g, 1),
        (x3, z3 if z3 is not None else x3, w2, b2 if b2 is not None else w2, rstd, dout3, dx3,
         dz3 if dz3 is not None else dx3, dw_part, db_part if db_part is not None else dw_part,
         cfg.bwd_block_m, *_tiling(cfg, s), z3 is not None, b2 is not None,
         bool(norm_before_gate), _bwd_tma(cfg), _approx(cfg, x3, z3),
         *((bool(cfg.bwd_regate),) if cfg.chunk else ()), int(cfg.bwd_latency)))]
    if cfg.bwd_reduce and dw2 is not None:
        calls.append(sum_partials_call(dw_part, dw2, db_part if db2 is not None else None,
                                       db2, sms))
    return calls


def _bwd_tma(cfg: NormConfig):
    """The backward kernel's TMA constant: the chunked kernel's 0 / 1 / 2, the padded one's
    bool (2 there is 1: TMA loads and stores)."""
    return int(cfg.bwd_tma) if cfg.chunk else bool(cfg.bwd_tma)


def _params(weight, bias, ngroups, group_size):
    w2 = as_kernel_input(weight).view(ngroups, group_size)
    b2 = None if bias is None else as_kernel_input(bias).view(ngroups, group_size)
    return w2, b2


def rmsnorm_forward_cuda(x, weight, bias, z, eps, group_size, norm_before_gate, config=None):
    """out (M, hidden) in x's dtype, rstd (G, M) float32 for rows x, z (M, hidden) on a GPU."""
    m, hidden = x.shape
    g = hidden // group_size
    cfg = config if config is not None else norm_config(
        group_size, z is not None and not norm_before_gate)
    check_chunk(cfg, group_size)
    x = as_kernel_input(x)
    z = as_kernel_input(z)
    out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    rstd = torch.empty((g, m), dtype=torch.float32, device=x.device)
    if m == 0:
        return out, rstd
    w2, b2 = _params(weight, bias, g, group_size)
    calls = forward_plan(rows_view(x, group_size),
                         None if z is None else rows_view(z, group_size), w2, b2,
                         rows_view(out, group_size), rstd, eps, norm_before_gate, cfg,
                         num_sms(x))
    launch_calls(calls, x.device)
    return out, rstd


def rmsnorm_backward_cuda(dout, x, weight, bias, z, rstd, group_size, norm_before_gate,
                          config=None):
    """(dx, dweight, dbias or None, dz or None) on a GPU; dx in x's dtype, dz in z's, dweight
    and dbias in the parameters' dtypes."""
    m, hidden = x.shape
    g = hidden // group_size
    cfg = config if config is not None else norm_config(
        group_size, z is not None and not norm_before_gate)
    check_chunk(cfg, group_size)
    x, z, dout = as_kernel_input(x), as_kernel_input(z), as_kernel_input(dout)
    dx = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    dz = None if z is None else torch.empty((m, hidden), dtype=z.dtype, device=x.device)
    if m == 0:
        dw = torch.zeros_like(weight)
        db = None if bias is None else torch.zeros_like(bias)
        return dx, dw, db, dz
    p = bwd_programs(m, g, cfg, num_sms(x))
    f32 = torch.float32
    dw_part = torch.empty((p, g, group_size), dtype=f32, device=x.device)
    db_part = None if bias is None else torch.empty((p, g, group_size), dtype=f32,
                                                    device=x.device)
    w2, b2 = _params(weight, bias, g, group_size)
    dw = torch.empty(hidden, dtype=weight.dtype, device=x.device)
    db = None if bias is None else torch.empty(hidden, dtype=bias.dtype, device=x.device)
    calls = backward_plan(
        rows_view(x, group_size), None if z is None else rows_view(z, group_size), w2, b2,
        rstd, rows_view(dout, group_size), rows_view(dx, group_size),
        None if dz is None else rows_view(dz, group_size), dw_part, db_part,
        norm_before_gate, cfg, dw.view(g, group_size),
        None if db is None else db.view(g, group_size), num_sms(x))
    launch_calls(calls, x.device)
    if not cfg.bwd_reduce:
        dw = dw_part.sum(0).reshape(hidden).to(weight.dtype)
        db = None if db_part is None else db_part.sum(0).reshape(hidden).to(bias.dtype)
    return dx, dw, db, dz


def problem_plans(rows=16384, hidden=1536, group_size=None, dtype=torch.bfloat16,
                  z_dtype=None, param_dtype=torch.float32, has_z=True, has_bias=False,
                  norm_before_gate=True, row_stride=None, int64=False, device="meta",
                  config=None):
    """(forward plan, backward plan) of a problem, on `meta` tensors by default (for compiling
    on a CPU: the same launches the GPU path makes). `row_stride`: x and z as slices of wider
    rows; `int64`: enough rows for 2**31 elements."""
    gs = hidden if group_size is None else group_size
    g = hidden // gs
    if int64:
        rows = max(rows, -(-(2**31) // hidden) + 1)
    cfg = config if config is not None else norm_shape_config(
        gs, has_z and not norm_before_gate)
    stride = row_stride or hidden

    def rows_of(dt):
        return torch.empty((rows, stride), dtype=dt, device=device)[:, :hidden]
    x = rows_of(dtype)
    z = rows_of(z_dtype or dtype) if has_z else None
    w = torch.empty((hidden,), dtype=param_dtype, device=device)
    b = torch.empty((hidden,), dtype=param_dtype, device=device) if has_bias else None
    out = torch.empty((rows, hidden), dtype=dtype, device=device)
    rstd = torch.empty((g, rows), dtype=torch.float32, device=device)
    w2, b2 = _params(w, b, g, gs)
    x3, z3 = rows_view(x, gs), None if z is None else rows_view(z, gs)
    fwd = forward_plan(x3, z3, w2, b2, rows_view(out, gs), rstd, 1e-6, norm_before_gate, cfg)
    p = bwd_programs(rows, g, cfg)
    part = lambda: torch.empty((p, g, gs), dtype=torch.float32, device=device)  # noqa: E731
    dz = None if z is None else rows_view(torch.empty_like(out, dtype=z.dtype), gs)
    bwd = backward_plan(x3, z3, w2, b2, rstd, rows_view(torch.empty_like(out), gs),
                        rows_view(torch.empty_like(out), gs), dz, part(),
                        part() if has_bias else None, norm_before_gate, cfg,
                        torch.empty_like(w2), None if b2 is None else torch.empty_like(b2))
    return fwd, bwd
