"""The cuTile backward pass of the chunked SSD: plans, configs, the launcher.

Six launches (no host synchronization, CUDA-graph capturable), following the stages of
`reference.chunked_backward` (see each kernel's docstring for its equations, tiles and grid):

  1. decay_cumsum        (forward kernel 1) recompute dt' and G2 = log2(e) cumsum(A dt')
  2. chunk_state_pass    (forward kernel 2) recompute the chunk entry states h_c (fp32)
  3. bwd_state_pass      reverse pass over chunks: exit-state gradients dS_c, dinitial_states
  4. bwd_chunk_dbc       per chunk: dB and dC, summed over each group's heads in-program
                         (short sequences: the heads split over programs, whose fp32 partials
                         one sum_partials launch adds; bc_fused 2: the gradient of each
                         group's C B^T first, bwd_chunk_dcb, then bwd_chunk_dbc_group,
                         whose heads dcb_head_split splits the same way)
  5. bwd_chunk_dx        per chunk: dx, dz, and per-tile partials of dD, ddt_direct, da
                         (after dB/dC: its partials reuse the memory of bc_fused 2's dS;
                         dx_heads > 1, da_mode 3 without z: bwd_chunk_dx_group, several heads
                         of a group a program, B_t C^T formed once)
  6. bwd_dt              da -> ddt' -> ddt (clamp, softplus, dt_bias), partials of dA, ddt_bias

then three small fixed-shape torch sums (dA, ddt_bias, dD partials; deterministic) and dtype
casts. Nothing uses atomics: every cross-program reduction goes through a partial buffer that
a later kernel or a torch sum reduces in a fixed order, so two runs give equal bits.

Plans are built from tensors (real CUDA tensors, or `meta` tensors for the CPU compile check,
or CPU float64 tensors for the tile-program emulation in tests/ssd/test_backward_emulation.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

import torch

from .. import config as _config
from ..kernels.bwd_chunk_dcb import (bwd_chunk_dbc_group, bwd_chunk_dbc_group_i64, bwd_chunk_dcb,
                                      bwd_chunk_dcb_i64)
from ..kernels.bwd_chunk_dbc import (bwd_chunk_dbc, bwd_chunk_dbc_fused, bwd_chunk_dbc_fused_i64,
                                     bwd_chunk_dbc_i64)
from ..kernels.bwd_chunk_dx import bwd_chunk_dx, bwd_chunk_dx_i64
from ..kernels.bwd_chunk_dx_group import bwd_chunk_dx_group, bwd_chunk_dx_group_i64
from ..kernels.bwd_dt import bwd_dt, bwd_dt_i64
from ..kernels.bwd_state_pass import bwd_state_pass, bwd_state_pass_i64
from ..kernels.chunk_state_carry import chunk_state_carry, chunk_state_carry_i64
from ..runtime import (DEFAULT_SMS, KernelCall, as_kernel_input, dt_clamp_bounds,
                       launch_calls, needs_int64, next_pow2, num_sms, sum_partials_call,
                       seq_ids_int32, with_hints)
from .forward import ForwardConfig, forward_plan, forward_shape_config, segment_buffers

INF = float("inf")
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@dataclass(frozen=True)
class BackwardConfig:
    """Tile sizes and hints of the backward launches (all tile sizes powers of two).

    `chunk_size` is the chunk length the backward computes with. It may be shorter than the
    caller's: the chunked algorithm is an exact rewrite of the recurrence for any chunk length,
    and the backward recomputes everything it needs from the inputs, so its gradients differ
    from a backward at the caller's chunk only in rounding."""
    chunk_size: int
    cumsum_block_h: int          # decay_cumsum and bwd_dt: heads per program
    state_block_p: int           # chunk_state_pass (recompute of h_c)
    state_block_n: int
    bstate_block_p: int          # bwd_state_pass
    bstate_block_n: int
    dx_block_q: int              # bwd_chunk_dx: tokens per program (<= chunk_size)
    dx_block_p: int              # bwd_chunk_dx: channels per program
    dstate_pad: int              # padded dstate (whole N in bwd_chunk_dx tiles)
    bc_block_q: int              # bwd_chunk_dbc: tokens per program
    bc_block_p: int              # bwd_chunk_dbc: p-tile of the dY X^T reduction loop
    bc_block_n: int              # bwd_chunk_dbc: dstate columns per program
    lowp: int = 0                # 1: the dB/dC launch's MMAs with computed fp32 operands in
                                 # the input dtype (as mamba_ssm rounds them)
    dx_lowp: int = 0             # 1: the same in bwd_chunk_dx (costs ddt, dA, ddt_bias accuracy)
    bstate_occupancy: int = 0    # 0: the compiler's choice
    dx_occupancy: int = 0
    bc_occupancy: int = 0
    dx_warps: int = 8            # num_worker_warps hints (0: the compiler's choice; with it,
    bc_warps: int = 8            # tileiras 13.4 spills 0.3-1.7 KB per thread in these two)
    da_mode: int = 0             # the decay gradient da (see bwd_chunk_dx): 0 the stable form
                                 # in bwd_chunk_dx; 1 per-token row/column-sum terms there
                                 # (no cumsum per block pair), bwd_dt suffix-sums them; 2 the
                                 # W terms in bwd_chunk_dbc_fused (needs bc_fused=1); 3 in
                                 # bwd_chunk_dcb (needs bc_fused=2)
    bstate_load_latency: int = 0  # load latency hints (1-10; 0: none): bwd_state_pass's
    dx_load_latency: int = 0      # per-chunk loads, bwd_chunk_dx's block loops,
    bc_load_latency: int = 0      # bwd_chunk_dbc_fused's head loop
    bc_fused: int = 0            # 1: one program per whole chunk forms M once for dB and dC
                                 # (bc_block_q is then unused); 2: the gradient of the group's
                                 # C B^T summed over its heads first (bwd_chunk_dcb, in
                                 # bc_block_q blocks), then dB and dC from it per whole chunk
    dcb_occupancy: int = 0       # bwd_chunk_dcb's hints (bc_fused=2; bc_occupancy, bc_warps
    dcb_warps: int = 0           # and bc_load_latency are bwd_chunk_dbc_group's)
    dcb_load_latency: int = 0    # bwd_chunk_dcb's head loop (0: none)
    state_segments: int = 1      # the recompute's state pass in parallel segments and its
    state_occupancy: int = 0     # occupancy hint (ForwardConfig's fields of the same names)
    bstate_segments: int = 1     # bwd_state_pass's reverse loop in parallel segments, then
                                 # chunk_state_carry (REVERSE) adds each one's entering gradient
    bc_head_split: int = 1       # the fused dB/dC launch spreads each group's heads over
                                 # `head_splits` programs (the largest divisor of the heads per
                                 # group <= this) writing fp32 partials that sum_partials adds
    dcb_head_split: int = 1      # the same for bc_fused 2: bwd_chunk_dcb writes one dS per
                                 # split (its heads' sum), bwd_chunk_dbc_group per split dB/dC
                                 # partials from its heads' state terms and its split's dS;
                                 # sum_partials adds them
    dx_heads: int = 1            # > 1 (da_mode 3, no z): dx by bwd_chunk_dx_group, a program
                                 # per token block, group and p-tile walking this many of the
                                 # group's heads (clamped to the largest power-of-two divisor
                                 # of the heads per group at most this) with B_t C^T of its
                                 # chunk formed once
    dx_block_n: int = 0          # bwd_chunk_dx_group's dstate tile (0: all of dstate_pad)
    bstate_fresh_acc: int = 1    # bwd_state_pass: each chunk's MMA into a fresh accumulator
    bstate_scale_dy: int = -1    # bwd_state_pass's weights on dY (1) or C (0); -1: on the
                                 # smaller operand tile (dY where bstate_block_p < _block_n)
    side_streams: int = 0        # 1: the reverse state pass and (bc_fused 2) the dS launch
                                 # each on a side stream beside the recompute of the states
                                 # (three launches with disjoint outputs; within 2% either
                                 # way where timed, each launch filling the GPU's CTA slots
                                 # alone); 2: only the reverse state pass on a side stream,
                                 # beside the recompute (two sequential passes whose grids
                                 # fit on the SMs together at few heads: the rule's choice
                                 # there, backward_shape_config), the dS launch after the
                                 # recompute; 0: one stream

    headdim_pad: int = 0         # the padded headdim the dispatcher saw (0: not recorded); read
                                 # only by paired_overrides

    # set by the problem, never overridden (chunk_size may be: any chunk length is exact)
    FIXED = ("dstate_pad", "headdim_pad")

    def __post_init__(self):
        c = _config
        c.check_pow2(self, "chunk_size")      # the API takes SUPPORTED_CHUNK_SIZES
        c.check_pow2(self, *(f.name for f in fields(self)
                             if f.name.endswith(("_block_q", "_block_p", "_block_n", "_block_h",
                                                 "_pad")) and f.name not in ("dx_block_n",
                                                                             "headdim_pad")))
        if self.chunk_size % self.dx_block_q or self.chunk_size % self.bc_block_q:
            raise ValueError(f"BackwardConfig: dx_block_q={self.dx_block_q} and bc_block_q="
                             f"{self.bc_block_q} must divide chunk_size={self.chunk_size}")
        for name in ("bstate_load_latency", "dx_load_latency", "bc_load_latency",
                     "dcb_load_latency"):
            c.check_range(self, name, 0, 10)
        for name in ("bstate_occupancy", "dx_occupancy", "bc_occupancy", "state_occupancy",
                     "dcb_occupancy"):
            c.check_range(self, name, 0, 32)
        c.check_range(self, "state_segments", 1, 64)
        c.check_range(self, "bstate_segments", 1, 64)
        c.check_range(self, "bc_head_split", 1, 64)
        c.check_range(self, "dcb_head_split", 1, 64)
        c.check_pow2(self, "dx_heads")
        c.check_pow2(self, "dx_block_n", "headdim_pad", allow_zero=True)
        if self.bc_head_split > 1 and self.bc_fused != 1:
            raise ValueError(f"BackwardConfig: bc_head_split={self.bc_head_split} needs "
                             "bc_fused=1 (dcb_head_split splits the bc_fused=2 launches)")
        if self.dcb_head_split > 1 and self.bc_fused != 2:
            raise ValueError(f"BackwardConfig: dcb_head_split={self.dcb_head_split} needs "
                             "bc_fused=2 (bc_head_split splits the bc_fused=1 launch)")
        for name in ("dx_warps", "bc_warps", "dcb_warps"):
            c.check_choice(self, name, (0, 4, 8))
        for name in ("lowp", "dx_lowp", "bstate_fresh_acc"):
            c.check_choice(self, name, (0, 1))
        c.check_choice(self, "side_streams", (0, 1, 2))
        c.check_choice(self, "bstate_scale_dy", (-1, 0, 1))
        c.check_choice(self, "bc_fused", (0, 1, 2))
        if (self.da_mode not in (0, 1, 2, 3) or (self.da_mode == 2 and self.bc_fused != 1)
                or (self.da_mode == 3 and self.bc_fused != 2)):
            raise ValueError(f"BackwardConfig: da_mode={self.da_mode} must be 0, 1, 2 with "
                             f"bc_fused=1, or 3 with bc_fused=2 (bc_fused={self.bc_fused})")

    def paired_overrides(self, overrides: dict) -> dict:
        """`overrides` (field -> value) as applied to this config: one that changes `bc_fused`
        without naming `da_mode`, `bc_head_split` or `dcb_head_split` also resets those of this
        config's choices that need the old dB/dC launch (da_mode 3 and a `dcb_head_split` need
        bc_fused 2, da_mode 2 and a `bc_head_split` need 1) to da_mode 1 (the per-token terms
        in bwd_chunk_dx, which go with any bc_fused) and no split, so that
        MAMBA2_CUTILE_BWD_CONFIG=bc_fused=N works at every sequence length. Leaving da_mode 3
        (by either route) without naming `dx_block_p` or `dx_warps` also takes bwd_chunk_dx
        from the 64-channel programs the dispatcher gives da_mode 3 at headdim 33-64 back to
        the 32-channel ones of the other modes (with the key-block loop the 64-channel, 8-warp
        ones were slower: 0.145 -> 0.196 ms at 1.3B, 1 x 2048). A config not made by the
        dispatcher (`headdim_pad` 0) keeps its tiles. Naming a choice that needs the other
        dB/dC launch without naming `bc_fused` (`bc_head_split` > 1 or da_mode 2: bc_fused 1;
        `dcb_head_split` > 1 or da_mode 3: bc_fused 2) names that launch too, so that such an
        override works whichever launch the rule chose for the sequence length."""
        out = dict(overrides)
        if "bc_fused" not in out:
            need = (1 if out.get("bc_head_split", 1) > 1 or out.get("da_mode") == 2
                    else 2 if out.get("dcb_head_split", 1) > 1 or out.get("da_mode") == 3
                    else self.bc_fused)
            if need != self.bc_fused:
                out["bc_fused"] = need
        if "bc_fused" in out:
            fused = out["bc_fused"]
            if "da_mode" not in out and {2: 1, 3: 2}.get(self.da_mode, fused) != fused:
                out["da_mode"] = 1
            if "bc_head_split" not in out and self.bc_head_split > 1 and fused != 1:
                out["bc_head_split"] = 1
            if "dcb_head_split" not in out and self.dcb_head_split > 1 and fused != 2:
                out["dcb_head_split"] = 1
        if (self.da_mode == 3 and out.get("da_mode", 3) != 3 and self.headdim_pad == 64
                and self.dx_block_p == 64 and "dx_block_p" not in out
                and "dx_warps" not in out):
            # 64 channels at headdim 33-64 come from the da_mode-3 rule only (16-bit inputs)
            out["dx_block_p"], out["dx_warps"] = key_loop_dx_tiles(64, self.dstate_pad,
                                                                   torch.bfloat16)
        return out


def key_loop_dx_tiles(headdim_pad: int, dstate_pad: int, dtype) -> tuple:
    """bwd_chunk_dx's (channels, warps) where it runs its key-block loop (da_mode 0-2, or z):
    32 channels (64 at headdim 128), 4 warps (8 at dstate 256 in 16 bits). The 32-channel
    programs at two per SM: H200, bf16, B=2 T=4096 H=80 G=1 and B=8 T=2048 H=128 G=8, chunk
    256: bwd_chunk_dx 0.832 -> 0.669 and 2.636 -> 2.119 ms
    (benchmarks/results/2026-12-01-h200-backward-sweep-tiles-occupancy.txt); headdim 128 in
    64-channel programs (C B^T formed half as often): 1.135 -> 1.000 ms at B=2 T=8K H=48
    P=128 chunk 256 (H200, 2026-12-05, timed while GPU tests shared the GPU; gradients
    equal; benchmarks/results/2026-12-05-h200-backward-sweep-dstate256-headdim128.jsonl);
    8 warps at dstate 256: 0.962 -> 0.901 ms at B=2 T=8K H=32 N=256 chunk 256 (H200, the
    same run). fp32 inputs keep 32 channels (their tiles are held in fp32)."""
    wide = dstate_pad >= 256 or dtype == torch.float32
    block_p = 64 if headdim_pad == 128 and not wide else min(headdim_pad, 32)
    warps = 8 if dstate_pad >= 256 and dtype != torch.float32 else 4
    return block_p, warps


def scale_dy(cfg: BackwardConfig) -> bool:
    """Whether bwd_state_pass puts the decay weights on dY (else on C): an explicit 0/1, or
    by default on the smaller of the two MMA operand tiles (as forward.scale_x)."""
    if cfg.bstate_scale_dy >= 0:
        return bool(cfg.bstate_scale_dy)
    return cfg.bstate_block_p < cfg.bstate_block_n


def dx_group_heads(cfg: BackwardConfig, heads_per_group: int, has_z: bool) -> int:
    """The heads one bwd_chunk_dx_group program walks (`BackwardConfig.dx_heads`), or 1 where
    it does not apply (da_mode other than 3, or z given)."""
    if cfg.dx_heads <= 1 or cfg.da_mode != 3 or has_z:
        return 1
    heads = 1
    while heads * 2 <= cfg.dx_heads and heads_per_group % (heads * 2) == 0:
        heads *= 2
    return heads


def head_splits(cfg: BackwardConfig, nheads: int, ngroups: int) -> int:
    """How many programs share each group's heads in the dB/dC launches: the largest divisor
    of the heads per group that is at most `cfg.bc_head_split` (bc_fused 1: the fused launch)
    or `cfg.dcb_head_split` (bc_fused 2: the dS and dB/dC launches); every program then walks
    the same number of heads, a compile-time trip count."""
    hpg = max(1, nheads // max(1, ngroups))
    cap = {1: cfg.bc_head_split, 2: cfg.dcb_head_split}.get(cfg.bc_fused, 1)
    return max(d for d in range(1, min(cap, hpg) + 1) if hpg % d == 0)


def backward_config(batch, nheads, ngroups, headdim, dstate, chunk_size, dtype,
                    sms=DEFAULT_SMS, seqlen=None, has_z=False) -> BackwardConfig:
    """The dispatcher: a config from the shape alone (no search, no sync), then
    MAMBA2_CUTILE_BWD_CONFIG overrides ("dx_block_q=32,lowp=1"). The recompute's tiles come
    from the forward's shape rule, never from MAMBA2_CUTILE_CONFIG or the tuning table.

    A chunk-256 call computes its backward at chunk 128. The whole-chunk dB/dC program
    (`bwd_chunk_dbc_fused`) holds a (Q, Q) decay matrix per chunk, which at Q = 256 is 9.1 ms
    against 0.46 ms at Q = 128 for B=2 T=4096 H=80 (whole backward 10.44 -> 1.64 ms; 2.34 ->
    0.23 ms at B=1 T=1000 H=24, 25.5 -> 4.70 ms at B=8 T=2048 H=128 G=8); chunk 64 was no
    better at the larger shapes (H200, 2026-12-01,
    benchmarks/results/2026-12-01-h200-backward-sweep-internal-chunk.jsonl).

    With `seqlen`, a fused dB/dC grid of at most 8 programs (one chunk x n-tile x group per
    program: up to 512 tokens at batch 1, one group and dstate 128) splits each group's heads
    over up to sms / programs programs (`bc_head_split`); otherwise dB and dC go through the
    gradient of each group's C B^T (`bc_fused=2`), as without `seqlen`, and that launch
    forms the decay gradient's W terms too (`da_mode=3`); there, without z (`has_z`), a
    headdim of 33 to 64 in 16 bits takes `bwd_chunk_dx` programs over all 64 (padded)
    channels, and a fused grid of 9 to 32 programs splits the heads of the dS and dB/dC
    launches (`dcb_head_split`). A reverse state pass whose grid is at most half of `sms`
    runs on a side stream beside the recompute of the states (`side_streams=2`)."""
    return _config.with_env(backward_shape_config(batch, nheads, ngroups, headdim, dstate,
                                                  chunk_size, dtype, sms, seqlen, has_z),
                            _config.ENV_BACKWARD)


@functools.lru_cache(maxsize=1024)
def backward_shape_config(batch, nheads, ngroups, headdim, dstate, chunk_size, dtype,
                          sms=DEFAULT_SMS, seqlen=None, has_z=False) -> BackwardConfig:
    """`backward_config`'s rule, before the environment's overrides. Memoized: a pure
    function of its arguments, on every backward call's hot path (the configs are frozen)."""
    chunk_size = min(chunk_size, 128)
    fwd = forward_shape_config(batch, nheads, headdim, dstate, chunk_size, dtype, sms)
    np_ = max(16, next_pow2(dstate))
    pp = max(16, next_pow2(headdim))
    # bwd_chunk_dx holds (BQ, NP) B/C tiles and (BP, NP) h_c / dS_c tiles at once: a wide
    # state or fp32 inputs keep the compiler's occupancy (and narrower state-pass tiles)
    wide = np_ >= 256 or dtype == torch.float32
    wide_state16 = np_ == 256 and dtype != torch.float32
    # (the long-sequence rule below gives da_mode 3 without z other dx tiles)
    dx_block_p, dx_warps = key_loop_dx_tiles(pp, np_, dtype)
    cfg = BackwardConfig(
        chunk_size=chunk_size,
        cumsum_block_h=fwd.cumsum_block_h,
        state_block_p=fwd.state_block_p,
        state_block_n=fwd.state_block_n,
        # the recompute of the states takes the forward rule's tiles and occupancy hint (the
        # hint is timed in the forward only)
        state_occupancy=fwd.state_occupancy,
        # bwd_state_pass over the whole state (64 channels x all of dstate) at two programs
        # per SM, its weights on dY: one such program does a chunk in less time than the four
        # of 32 x 64 tiles at four per SM of the same kernel, even where its grid leaves most
        # SMs idle (H100, bf16, chunk 256 computed at 128 unless named; 32 x 64 / whole, ms):
        #   seed (4, 16384, 8, chunk 128; 32 programs)  0.199 / 0.172
        #   130M (2, 8192, 24)    0.121 / 0.090         370M (2, 8192, 32)     0.127 / 0.096
        #   1.3B (2, 8192, 64)    0.260 / 0.132         2.7B (2, 8192, 80)     0.411 / 0.154
        #   headdim 128 (48)      0.461 / 0.175         7B-class (128, G=8)    0.604 / 0.215
        # (the narrow tiles of the kernel before the weights moved to dY, on another H100:
        # 0.158 seed, 0.097 130M, 0.278 2.7B, 0.417 7B-class: the whole state is slower at
        # the seed problem than that; benchmarks/results/2026-12-06-h100-backward-sweep-*).
        # Wide problems (dstate 256, fp32) keep the forward's state tiles and the compiler's
        # occupancy.
        # A 256-wide state in 16 bits takes 32 x 256 tiles: bwd_state_pass 0.154 -> 0.137 ms
        # against the forward's 64 x 128 (H100, bf16, B=2 T=8192 H=32, chunk 256 computed at
        # 128; benchmarks/results/2026-12-06-h100-backward-sweep-wide-tiles.jsonl).
        bstate_block_p=(min(pp, 32) if wide_state16
                        else fwd.state_block_p if wide else min(pp, 64)),
        bstate_block_n=256 if wide_state16 else fwd.state_block_n if wide else min(np_, 128),
        bstate_occupancy=0 if wide else 2,
        dx_block_q=min(chunk_size, 64),
        dx_block_p=dx_block_p,
        dx_occupancy=0 if wide else 2,
        dstate_pad=np_,
        headdim_pad=pp,
        bc_block_q=min(chunk_size, 64),
        bc_block_p=min(pp, 64),
        bc_block_n=min(np_, 64),
        # measured on the H200 at the seed problem (benchmarks/results/2026-11-30-h200-
        # backward-sweep-fused-dbc-da-mode.jsonl): one whole-chunk
        # dB/dC program took bwd_chunk_dbc from 1.02 to 0.54 ms; the per-token da terms
        # (da_mode 1) took bwd_chunk_dx from 0.88 to 0.70 ms; whole backward 2.24 -> 1.57 ms.
        # (da_mode 2 cut bwd_chunk_dx to 0.53 ms but cost bwd_chunk_dbc_fused 0.82 ms more.)
        bc_fused=1,
        da_mode=1,
        # benchmarks/results/2026-11-30-h200-backward-decode-sweep-lowp-hints.jsonl: each
        # alone, whole backward 1.55 ms ->
        #   lowp=1 (MMA operands in the input dtype, as mamba_ssm): 1.47
        #   + dx_warps=4 (bwd_chunk_dx 0.70 -> 0.57 ms): 1.36
        #   + bc_load_latency=4 (bwd_chunk_dbc_fused 0.49 -> 0.39 ms), measured with lowp: 1.37
        #   + bstate_load_latency=4 (bwd_state_pass 0.143 -> 0.127 ms), measured with lowp: 1.45
        # all four: 1.245 ms; then bstate_load_latency 8: 1.229 (bwd_state_pass 0.110 ms;
        # gradients bit-identical), 2: 1.252; bc_load_latency 2/6/8 and dx_load_latency 2/6
        # slower. lowp for bwd_chunk_dx too saves only 0.022 ms (0.587 -> 0.565) but made the
        # GPU tests' ddt_bias error 7x larger (1.7e-3 -> 1.3e-2 at (1, 200, 4, 2, 40, 24)), so
        # it is off (dx_lowp=0): ddt, dA and ddt_bias keep fp32-operand accuracy (da_mode 1,
        # and da_mode 3 without z, whose dY X^T takes the inputs themselves; with z da_mode 3
        # rounds the gated dY to the input dtype for it, and da_mode 2 forms dA terms under
        # lowp).
        lowp=1,
        dx_warps=dx_warps,
        bc_load_latency=4,
        dcb_load_latency=4,          # bwd_chunk_dcb's own since 2026-12-06 (2 and 8 no better)
        bstate_load_latency=8,
    )
    programs = 0
    if seqlen is not None:
        programs = -(-seqlen // chunk_size) * batch * ngroups * -(-dstate // cfg.bc_block_n)
    # The head-split fused dB/dC launch against the dS launch below with bwd_chunk_dx free of
    # its key-block loop (before that launch's heads were split): from 32 programs up the dS
    # launch was faster, at 16 and below slower. H100,
    # bf16, batch 1, 1 group, dstate 128, chunk 256 computed at 128, backward kernels ms,
    # head split -> dS launch (programs):
    #   64 heads  512 tokens (8)  0.131 -> 0.233    1024 (16) 0.209 -> 0.259
    #             2048 (32)       0.352 -> 0.318    4096 (64) 0.637 -> 0.457
    #   24 heads  512 (8)         0.092 -> 0.123    1024 (16) 0.123 -> 0.141
    #             2048 (32)       0.194 -> 0.174    4096 (64) 0.332 -> 0.254
    #   80 heads  1024 (16)       0.240 -> 0.305    48 heads 2048 (32) 0.290 -> 0.262
    # (benchmarks/results/2026-12-06-h100-backward-sweep-short-sequences.jsonl; without z:
    # with z bwd_chunk_dx keeps its key-block loop on either side, untimed there)
    # At 16 programs the dS launch with its heads split (below) beat the head-split fused
    # launch too, so that launch keeps 8 programs or fewer (9-15 untimed).
    if 0 < programs <= 8 and 6 * programs <= sms:
        cfg = replace(cfg, bc_head_split=max(1, min(64, sms // programs)))
    else:
        # dB/dC through the groups' C B^T gradient: dS summed over the heads in 32-token
        # blocks at four programs per SM, then per whole chunk two programs per SM of 4 warps
        # (H200, bf16, B=2 T=8192 H=80 G=1 and H=128 G=8, chunk 256: the fused launch 0.999
        # and 1.627 ms -> 0.256 + 0.384 and 0.439 + 0.690 ms, whole backward 2.79 -> 2.43 and
        # 4.40 -> 3.90 ms; benchmarks/results/2026-12-04-h200-backward-sweep-group-dcb.jsonl).
        # The decay gradient's W terms from that dS launch (da_mode 3), so that bwd_chunk_dx
        # drops its key-block loop without z (H100, bf16, B=2 T=8192, chunk 256: 80 heads
        # 2.48 -> 2.22 ms, headdim 128 2.79 -> 2.43, dstate 256 2.12 -> 1.81; dB/dC move by
        # bf16 rounding, 1-3e-3 of their largest element;
        # benchmarks/results/2026-12-05-h100-backward-sweep-da-mode-3.jsonl)
        cfg = replace(cfg, bc_fused=2, da_mode=3, bc_block_q=min(chunk_size, 32),
                      dcb_occupancy=4, bc_occupancy=2, bc_warps=4)
        if pp >= 128 or np_ >= 256:
            # a wide program (headdim 128 or dstate 256): the dS launch in 64-token blocks at
            # two programs per SM. H100, bf16, B=2 T=8192, chunk 256 computed at 128,
            # bwd_chunk_dcb / whole backward, ms: headdim 128 (48 heads) 0.311 -> 0.291 /
            # 1.787 -> 1.770, dstate 256 (32 heads) 0.165 -> 0.141 / 1.134 -> 1.105; two per
            # SM in 32-token blocks was slower (0.362 and 0.206 ms), 64-token blocks at four
            # per SM untimed (benchmarks/results/2026-12-06-h100-backward-sweep-wide-tiles.jsonl);
            # timed in bf16 without z only (fp32 and z compile to 2 CTAs/SM without spills)
            cfg = replace(cfg, bc_block_q=min(chunk_size, 64), dcb_occupancy=2)
        # bwd_chunk_dx without its key-block loop (da_mode 3, no z): at headdim 33-64 (timed
        # at 64) one program over all 64 channels (then with 8 warps) formed B_t C_q^T half as
        # often as two of 32. H100, bf16, chunk 256 computed at 128 unless named, bwd_chunk_dx /
        # whole backward, ms:
        #   seed (4, 16384, 8, chunk 128)   0.401 -> 0.338 / 1.129 -> 1.052
        #   130M (2, 8192, 24)              0.293 -> 0.256 / 0.715 -> 0.676
        #   1.3B (2, 8192, 64)              0.753 -> 0.651 / 1.562 -> 1.463
        #   2.7B (2, 8192, 80)              0.935 -> 0.810 / 1.950 -> 1.814
        #   7B-class (2, 8192, 128, G=8)    1.494 -> 1.288 / 3.387 -> 3.186
        #   1.3B (1, 65536, 64)             3.406 -> 2.600 / 7.393 -> 6.569
        #   dstate 256 (2, 8192, 32)        0.864 -> 0.546 / 1.528 -> 1.212
        # (benchmarks/results/2026-12-06-h100-backward-sweep-dx-64-channels.jsonl). Headdim 128
        # keeps 4 warps (8: 0.800 -> 0.971 ms); with z, and short sequences (da_mode 1, the
        # key-block loop: 1.3B at 1 x 2048 0.145 -> 0.196 ms), 32 channels stay.
        # Then with the diagonal query block from the tiles a program already holds, 4 warps
        # at dstate 128 (sm_90 compile at 2.7B: 128 threads, 246 registers, no stack; 8 warps
        # at two per SM: 384 threads, 80 registers, 64 B of stack). H100, bwd_chunk_dx 8 -> 4
        # warps / whole backward:
        #   2.7B  0.717 -> 0.626 / 1.712 -> 1.623     130M  0.224 -> 0.199 / 0.642 -> 0.618
        #   dstate 256  0.478 -> 0.470 / 1.110 -> 1.101 (within a run's noise: 8 warps stay)
        # (benchmarks/results/2026-12-06-h100-backward-sweep-dx-diagonal-warps.jsonl); 4 warps
        # was timed at those two headdim-64 shapes only (not at 7B-class, 65536 tokens, the
        # seed problem or in fp16)
        if pp == 64 and dtype != torch.float32 and not has_z:
            cfg = replace(cfg, dx_block_p=64, dx_warps=8 if np_ >= 256 else 4)
        if 8 < programs <= 32:
            # a short sequence: each group's heads split over the programs of the dS and dB/dC
            # launches (fp32 partials summed by sum_partials): the largest power of two <= 8
            # and <= sms / programs (`programs` counting the fused launch's chunk x n-tile x
            # group grid; the plan then takes the largest divisor of the heads per group at
            # most that, `head_splits`). H100, bf16, B=1, 64 heads, 1 group,
            # chunk 256 computed at 128, whole backward, ms:
            #   2048 tokens (32 programs): none 0.302, 2 splits 0.258, 4 0.251, 8 0.257
            #   1024 tokens (16 programs): head-split fused launch 0.193, 4 splits 0.153,
            #                              8 0.151
            # (benchmarks/results/2026-12-06-h100-backward-sweep-dcb-head-split.jsonl; 24
            # heads, z, dstate 256 and 9-15 or 17-31 programs untimed; these shapes also take
            # the side stream below, untimed with the split)
            splits = max(1, min(8, sms // programs))
            cfg = replace(cfg, dcb_head_split=1 << (splits.bit_length() - 1))
    if seqlen is not None:
        bstate_programs = (batch * nheads * -(-headdim // cfg.bstate_block_p)
                           * -(-dstate // cfg.bstate_block_n))
        if 2 * bstate_programs <= sms:
            # the reverse state pass on a side stream beside the recompute of the states where
            # its grid fills at most half the SMs, so that its programs find free slots while
            # the recompute's pass runs (both walk the chunks one after another; the
            # recompute's grid is not sized here: 192 programs at 130M, two per SM).
            # H100, bf16, B=2 T=8192, chunk 256 computed at 128, whole backward one stream /
            # side_streams=2, ms: 130M (48 programs) 0.615 / 0.555, 370M (64) 0.760 / 0.711,
            # 2.7B (160) 1.624 / 1.646 (benchmarks/results/2026-12-06-h100-backward-sweep-
            # side-streams-2.jsonl; the seed problem, short sequences and reverse grids of
            # 1-47 programs untimed)
            cfg = replace(cfg, side_streams=2)
    return cfg


def check_config(cfg: BackwardConfig, headdim: int, dstate: int):
    """What a problem asks of a (self-validated) config: the padded dstate holds dstate."""
    if cfg.dstate_pad < dstate:
        raise ValueError(f"BackwardConfig: dstate_pad={cfg.dstate_pad} is smaller than "
                         f"dstate={dstate}")


@dataclass
class BackwardBuffers:
    """Everything the backward launches write (the outputs and the scratch they share)."""
    dt_buf: torch.Tensor       # (B, H, Lp) dt' (fp32)
    cum_buf: torch.Tensor      # (B, H, Lp) G2 (fp32)
    states: torch.Tensor       # (B, H, nc, P, N) entry states (state dtype, default fp32)
    hbuf: torch.Tensor         # (B, H, P, N) fp32: the recompute's final state, then dh_0
    dstates: torch.Tensor      # (B, H, nc, P, N) exit-state gradients dS_c
    da_part: torch.Tensor      # (n_pt * Q / dx_block_q, B, H, Lp) fp32; da_mode 2:
                               # (n_pt + cdiv(N, bc_block_n), B, H, Lp); da_mode 3:
                               # (max(Q / bc_block_q, n_pt), B, H, Lp)
    v_part: torch.Tensor | None    # (n_pt, B, H, Lp) fp32 (da_mode 2); da_mode 3:
                                   # (n_pt, B, H, nc * Q / dx_block_q)
    ddt_part: torch.Tensor     # (n_pt, B, H, Lp) fp32
    dD_part: torch.Tensor | None   # (cdiv(L, dx_block_q), B, H, P) fp32; D of shape (H,):
                                   # (cdiv(L, dx_block_q), B, H, n_pt), summed in the p-tile
    dA_part: torch.Tensor      # (B * nc, H) fp32
    dbias_part: torch.Tensor | None  # (B * nc, H) fp32
    db_part: torch.Tensor | None     # (splits, B, L, G, N) fp32 per-split dB (head_splits > 1)
    dc_part: torch.Tensor | None     # the same for dC
    dcb: torch.Tensor | None   # (splits * B, G, Lp, Q) fp32: the gradient of the groups' C B^T
                               # (bc_fused 2; with a head split, each split's heads' part),
                               # in the memory of v_part, ddt_part, dD_part (and da_part but
                               # in da_mode 3)
    dx: torch.Tensor
    dz: torch.Tensor | None
    dB: torch.Tensor
    dC: torch.Tensor
    ddt: torch.Tensor


def allocate_buffers(x, dt, B, C, z, D, dt_bias, cfg: BackwardConfig, state_dtype=None,
                     buf_dtype=torch.float32, out_dtypes=None) -> BackwardBuffers:
    """Allocate on x's device (also `meta`). out_dtypes: dtype per gradient name (default: the
    tensor's own dtype)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Q = cfg.chunk_size
    nc = -(-l // Q)
    lp = nc * Q
    n_pt = -(-p // cfg.dx_block_p)
    n_q = -(-l // cfg.dx_block_q)
    dev = x.device
    od = dict(x=x.dtype, z=None if z is None else z.dtype, B=B.dtype, C=C.dtype, dt=dt.dtype)
    od.update(out_dtypes or {})
    e = lambda *s, dt=buf_dtype: torch.empty(s, dtype=dt, device=dev)  # noqa: E731
    sdt = state_dtype or buf_dtype
    splits = head_splits(cfg, h, g)
    # bwd_chunk_dx's partials, and (bc_fused 2) the dS that the dB/dC launches before it
    # write and read, in one fp32 block: dS lives until bwd_chunk_dx starts, the partials
    # from then on, so the block is the larger of the two, not their sum (da_mode 3: da_part,
    # which bwd_chunk_dcb writes beside dS, has its own)
    shapes = dict(
        da_part=((n_pt + -(-n // cfg.bc_block_n), b, h, lp) if cfg.da_mode == 2
                 else (max(Q // cfg.bc_block_q, n_pt), b, h, lp) if cfg.da_mode == 3
                 else (n_pt * (Q // cfg.dx_block_q), b, h, lp)),
        v_part=((n_pt, b, h, lp) if cfg.da_mode == 2
                else (n_pt, b, h, nc * (Q // cfg.dx_block_q)) if cfg.da_mode == 3 else None),
        ddt_part=(n_pt, b, h, lp),
        dD_part=None if D is None else (n_q, b, h, n_pt if D.dim() == 1 else p))
    own = {}
    if cfg.da_mode == 3:
        own["da_part"] = e(*shapes.pop("da_part"))
    # each part starts 256-byte aligned (a kernel's array alignment is part of its compile key)
    sizes = {k: 0 if s is None else -(-math.prod(s) // 64) * 64 for k, s in shapes.items()}
    dcb_shape = (splits * b, g, lp, Q)
    block = e(max(sum(sizes.values()), math.prod(dcb_shape) if cfg.bc_fused == 2 else 0))
    parts, at = {}, 0
    for k, s in shapes.items():
        parts[k] = None if s is None else block[at:at + math.prod(s)].view(s)
        at += sizes[k]
    return BackwardBuffers(
        dt_buf=e(b, h, lp), cum_buf=e(b, h, lp), states=e(b, h, nc, p, n, dt=sdt),
        hbuf=e(b, h, p, n), dstates=e(b, h, nc, p, n, dt=sdt), **parts, **own,
        dA_part=e(b * nc, h), dbias_part=None if dt_bias is None else e(b * nc, h),
        db_part=e(splits, b, l, g, n) if splits > 1 else None,
        dc_part=e(splits, b, l, g, n) if splits > 1 else None,
        dcb=block[:math.prod(dcb_shape)].view(dcb_shape) if cfg.bc_fused == 2 else None,
        dx=e(b, l, h, p, dt=od["x"]), dz=None if z is None else e(b, l, h, p, dt=od["z"]),
        dB=e(b, l, g, n, dt=od["B"]), dC=e(b, l, g, n, dt=od["C"]), ddt=e(b, l, h, dt=od["dt"]),
    )


def recompute_config(cfg: BackwardConfig, x, B) -> ForwardConfig:
    """The forward config of the recompute launches: the forward's shape rule with the
    backward config's tiles for them (no tuning table, no MAMBA2_CUTILE_CONFIG)."""
    b, _, h, p = x.shape
    return _recompute_config(cfg, b, h, p, B.shape[3], x.dtype)


@functools.lru_cache(maxsize=1024)
def _recompute_config(cfg: BackwardConfig, b, h, p, n, dtype) -> ForwardConfig:
    fwd = forward_shape_config(b, h, p, n, cfg.chunk_size, dtype)
    # at the backward's chunk, whatever chunk the forward's rule would compute a call of that
    # length with (the buffers are the backward's)
    return replace(fwd, chunk_size=cfg.chunk_size,
                   scan_block_q=min(fwd.scan_block_q, cfg.chunk_size),
                   cumsum_block_h=cfg.cumsum_block_h, state_block_p=cfg.state_block_p,
                   state_block_n=cfg.state_block_n, state_segments=cfg.state_segments,
                   state_occupancy=cfg.state_occupancy,
                   # the backward's kernels read the entry states (never left local, never
                   # skipped by the walk) and no output launch runs here (no C B^T scratch,
                   # no flagged-tile pass to feed, no chunk_scan_group: the plan's output
                   # launches are dropped below)
                   segment_fold=0, scan_cb=0, scan_causal=0, scan_heads=1, scan_walk=0)


def backward_plan(x, dt, A, B, C, z, D, dt_bias, dt_lo, dt_hi, dt_softplus, init, seq_idx,
                  dout, dfinal, bufs: BackwardBuffers, cfg: BackwardConfig):
    """The six launches of the backward (one more for each of state_segments,
    bstate_segments, bc_fused 2 and a head split of the dB/dC launch). Inputs as the
    kernels take them (B, C, z, dout in x's dtype with unit innermost stride; A, D, dt_bias,
    init, dfinal fp32; seq_idx int32); unused optional inputs None. Reads no tensor values."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    Q = cfg.chunk_size
    hpg = nheads // ngroups
    nchunks = bufs.cum_buf.shape[2] // Q
    dev = x.device
    seq_arg = seq_idx if seq_idx is not None else torch.empty((1, 1), dtype=torch.int32,
                                                               device=dev)
    has_z, has_seq = z is not None, seq_idx is not None
    lowp = bool(cfg.lowp) and x.dtype != torch.float32
    dx_lowp = bool(cfg.dx_lowp) and x.dtype != torch.float32

    # 1, 2: the forward's kernels before chunk_scan recompute dt', G2 and the entry states
    # (with state_segments, chunk_state_carry too). Its final state is never used: it goes to
    # hbuf, which holds dh_0 later, or (side streams, where bwd_state_pass writes dh_0 at the
    # same time) to scratch of its own
    side = bool(cfg.side_streams)
    final = torch.empty_like(bufs.hbuf) if side and init is not None else bufs.hbuf
    calls = forward_plan(x, dt, A, B, C, z, D, dt_bias, dt_lo, dt_hi, dt_softplus, init,
                         seq_idx, bufs.dt_buf, bufs.cum_buf, bufs.states, final, x,
                         recompute_config(cfg, x, B))
    calls = [c for c in calls if c.kernel._annotated_function.pyfunc.__name__
             not in ("chunk_scan_fn", "chunk_scan_group_fn")]
    recompute, calls = calls[1:], calls[:1]       # decay_cumsum first: every launch reads G2

    # 3: reverse pass over chunks (with bstate_segments, in parallel runs, then the carry)
    segs, (seg_final, seg_factor, chunk_factor) = segment_buffers(
        cfg.bstate_segments, nchunks, bufs.hbuf, bufs.cum_buf)
    int64 = needs_int64(dout, z, C, bufs.cum_buf, seq_idx, dfinal, bufs.dstates, bufs.hbuf,
                        seg_final)
    bstate_grid = (batch * nheads, -(-headdim // cfg.bstate_block_p),
                   -(-dstate // cfg.bstate_block_n) * segs)
    s1, s2 = (1 if side else 0), (2 if cfg.side_streams == 1 else 0)
    calls.append(KernelCall(
        with_hints(bwd_state_pass_i64 if int64 else bwd_state_pass, cfg.bstate_occupancy),
        bstate_grid,
        (dout, z if has_z else dout, C, bufs.cum_buf, seq_arg,
         dfinal if dfinal is not None else bufs.hbuf, bufs.dstates, bufs.hbuf,
         Q, cfg.bstate_block_p, cfg.bstate_block_n, hpg, has_z, has_seq, dfinal is not None,
         init is not None, cfg.bstate_load_latency, segs, scale_dy(cfg),
         bool(cfg.bstate_fresh_acc), seg_final, seg_factor, chunk_factor), stream=s1))
    if segs > 1:
        calls.append(KernelCall(
            chunk_state_carry_i64 if int64 else chunk_state_carry, bstate_grid,
            (seg_final, seg_factor, chunk_factor, bufs.dstates, bufs.hbuf, seg_final,
             cfg.bstate_block_p, cfg.bstate_block_n, segs, cfg.bstate_load_latency, True,
             init is not None, False), stream=s1))
    if not side:
        calls = calls[:1] + recompute + calls[1:]
    elif cfg.side_streams == 2:
        # the recompute on the caller's stream beside the reverse pass, the dS launch after it
        calls += recompute

    # 4: dB, dC (with a head split: per-split fp32 partials, then their sum in one launch),
    # before dx: bc_fused 2's dS shares its memory with the partials bwd_chunk_dx writes
    split = bufs.db_part is not None
    db_out, dc_out = (bufs.db_part, bufs.dc_part) if split else (bufs.dB, bufs.dC)
    int64 = needs_int64(x, B, C, z, dout, bufs.dt_buf, bufs.cum_buf, seq_idx, bufs.states,
                      bufs.dstates, db_out, dc_out, bufs.da_part if cfg.bc_fused else None,
                      bufs.dcb)
    splits = db_out.shape[0] if split else 1
    if cfg.bc_fused == 2:
        # dS in bc_block_q blocks; bwd_chunk_dbc_group reads it in (Q, <= 64) slices (a
        # (128, 128) fp32 slice staged with the chunk's rows needs more than an SM's 227 KB)
        nbpc = Q // cfg.bc_block_q
        calls.append(KernelCall(
            with_hints(bwd_chunk_dcb_i64 if int64 else bwd_chunk_dcb, cfg.dcb_occupancy,
                       cfg.dcb_warps),
            (nbpc * nbpc * splits * nchunks * batch * ngroups, 1, 1),
            (x, B, C, z if has_z else x, dout, bufs.dt_buf, bufs.cum_buf, seq_arg, bufs.dcb,
             bufs.da_part, Q, cfg.bc_block_q, cfg.bc_block_p, cfg.dstate_pad, hpg, has_z,
             has_seq, lowp, cfg.dcb_load_latency, cfg.da_mode == 3, splits), stream=s2))
    if cfg.side_streams == 1:
        # the recompute on the caller's stream, the side launches above already under way;
        # the next launch reads the states, dS_c and the dS blocks: it joins them
        calls += recompute
    join_at = len(calls)
    if cfg.bc_fused == 2:
        # with a head split: dB and dC as (splits * B, L, G, N) fp32 partials, a split's
        # rows at split * B + batch
        part = (lambda t: t.view(splits * batch, *t.shape[2:])) if split else (lambda t: t)
        calls.append(KernelCall(
            with_hints(bwd_chunk_dbc_group_i64 if int64 else bwd_chunk_dbc_group,
                       cfg.bc_occupancy, cfg.bc_warps),
            (-(-dstate // cfg.bc_block_n) * 2 * splits * nchunks * batch * ngroups, 1, 1),
            (x, B, C, z if has_z else x, dout, bufs.dt_buf, bufs.cum_buf, seq_arg, bufs.states,
             bufs.dstates, bufs.dcb, part(db_out), part(dc_out), Q, min(cfg.bc_block_q, 64),
             cfg.bc_block_p, cfg.bc_block_n, hpg, has_z, has_seq, lowp, cfg.bc_load_latency,
             splits)))
    elif cfg.bc_fused:
        calls.append(KernelCall(
            with_hints(bwd_chunk_dbc_fused_i64 if int64 else bwd_chunk_dbc_fused, cfg.bc_occupancy,
                   cfg.bc_warps),
            (nchunks * batch * ngroups, -(-dstate // cfg.bc_block_n), splits),
            (x, B, C, z if has_z else x, dout, bufs.dt_buf, bufs.cum_buf, seq_arg, bufs.states,
             bufs.dstates, db_out, dc_out, bufs.da_part, Q, cfg.bc_block_p, cfg.bc_block_n,
             hpg, has_z, has_seq, lowp, cfg.da_mode == 2, cfg.bc_load_latency, splits)))
    else:
        n_qb = -(-seqlen // cfg.bc_block_q)
        calls.append(KernelCall(
            with_hints(bwd_chunk_dbc_i64 if int64 else bwd_chunk_dbc, cfg.bc_occupancy, cfg.bc_warps),
            (n_qb * batch * ngroups, -(-dstate // cfg.bc_block_n), 2),
            (x, B, C, z if has_z else x, dout, bufs.dt_buf, bufs.cum_buf, seq_arg, bufs.states,
             bufs.dstates, bufs.dB, bufs.dC, Q, cfg.bc_block_q, cfg.bc_block_p, cfg.bc_block_n,
             hpg, has_z, has_seq, lowp)))
    if split:
        rows, cols = batch * seqlen, ngroups * dstate
        calls.append(sum_partials_call(
            bufs.db_part.view(splits, rows, cols), bufs.dB.view(rows, cols),
            bufs.dc_part.view(splits, rows, cols), bufs.dC.view(rows, cols)))

    # 5: dx, dz, partials of dD, ddt, da
    v_part = bufs.v_part if bufs.v_part is not None else bufs.ddt_part
    n_q = -(-seqlen // cfg.dx_block_q)
    d_mode = 0 if D is None else D.dim()
    int64 = needs_int64(x, B, C, z, dout, D, bufs.dt_buf, bufs.cum_buf, seq_idx, bufs.states,
                      bufs.dstates, bufs.dx, bufs.dz, bufs.da_part, bufs.ddt_part, bufs.dD_part)
    dx_heads = dx_group_heads(cfg, hpg, has_z)
    if dx_heads > 1:
        calls.append(KernelCall(
            with_hints(bwd_chunk_dx_group_i64 if int64 else bwd_chunk_dx_group, cfg.dx_occupancy,
                       cfg.dx_warps),
            (n_q * batch * ngroups * (hpg // dx_heads), -(-headdim // cfg.dx_block_p), 1),
            (x, B, C, dout, D if D is not None else A, bufs.dt_buf, bufs.cum_buf, seq_arg,
             bufs.states, bufs.dstates, bufs.dx, bufs.da_part, bufs.ddt_part,
             bufs.dD_part if D is not None else bufs.ddt_part, v_part, Q, cfg.dx_block_q,
             cfg.dx_block_p, cfg.dstate_pad, hpg, dx_heads, d_mode, has_seq, dx_lowp,
             Q // cfg.bc_block_q, cfg.dx_load_latency,
             min(cfg.dx_block_n or cfg.dstate_pad, cfg.dstate_pad))))
    else:
        calls.append(KernelCall(
            with_hints(bwd_chunk_dx_i64 if int64 else bwd_chunk_dx, cfg.dx_occupancy,
                       cfg.dx_warps),
            (n_q * batch * nheads, -(-headdim // cfg.dx_block_p), 1),
            (x, B, C, z if has_z else x, dout, D if D is not None else A, bufs.dt_buf,
             bufs.cum_buf, seq_arg, bufs.states, bufs.dstates, bufs.dx, bufs.dz if has_z else bufs.dx,
             bufs.da_part, bufs.ddt_part, bufs.dD_part if D is not None else bufs.ddt_part,
             v_part, Q, cfg.dx_block_q, cfg.dx_block_p, cfg.dstate_pad, hpg, d_mode, has_z,
             has_seq, dx_lowp, cfg.da_mode, Q // cfg.bc_block_q if cfg.da_mode == 3 else 0,
             cfg.dx_load_latency)))

    # 6: dt chain, dA and ddt_bias partials
    int64 = needs_int64(dt, bufs.dt_buf, bufs.da_part, bufs.ddt_part, bufs.ddt, bufs.dA_part)
    calls.append(KernelCall(
        bwd_dt_i64 if int64 else bwd_dt,
        (batch * nchunks, -(-nheads // cfg.cumsum_block_h), 1),
        (dt, A, dt_bias if dt_bias is not None else A, float(dt_lo), float(dt_hi), bufs.dt_buf,
         bufs.da_part, bufs.ddt_part, v_part, bufs.ddt, bufs.dA_part,
         bufs.dbias_part if dt_bias is not None else bufs.dA_part,
         Q, cfg.dx_block_q, cfg.cumsum_block_h, dt_bias is not None, bool(dt_softplus),
         cfg.da_mode)))
    if side:
        calls[join_at].join = True
    return calls


def default_state_dtype(input_dtype, buf_dtype=torch.float32):
    """The dtype of the backward's per-chunk state buffers (entry states and exit-state
    gradients, 2 x B*H*nchunks*P*N elements: the backward's largest scratch) when the caller
    names none: bfloat16 for bfloat16 inputs, as the forward stores its chunk states in the
    input dtype, halving that memory and its traffic (the kernels accumulate in fp32 and round
    once per chunk; measured on an H200 the gradients' errors stay those of fp32 states,
    tests/ssd/test_backward_gpu.py::test_state_dtype_bf16); `buf_dtype` otherwise (fp16's
    range is too narrow for states of slowly decaying heads)."""
    if input_dtype == torch.bfloat16 and buf_dtype == torch.float32:
        return torch.bfloat16
    return buf_dtype


def run_backward(x, dt, A, B, C, chunk_size, dout, dfinal_states=None, D=None, z=None,
                 dt_bias=None, initial_states=None, seq_idx=None, dt_softplus=False,
                 dt_limit=(0.0, INF), state_dtype=None, config=None, *, launch_fn,
                 buf_dtype=torch.float32, sms=DEFAULT_SMS, on_buffers=None):
    """The backward on any device, launching the plan through `launch_fn(calls)`.
    `buf_dtype` is the dtype of the fp32 scratch and fp32 kernel inputs (float64 for the CPU
    emulation; `on_buffers(bufs)` runs before the launches, e.g. to poison them with NaN).
    Returns the gradient dict."""
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                  initial_states=initial_states)
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    f32 = buf_dtype
    mm = x.dtype
    out_dtypes = {k: t.dtype for k, t in inputs.items() if t is not None}

    if l == 0 or b * h == 0:
        grads = {k: None if t is None else torch.zeros_like(t) for k, t in inputs.items()}
        if initial_states is not None and dfinal_states is not None:
            grads["initial_states"] = dfinal_states.to(initial_states.dtype).clone()
        return grads

    xk = as_kernel_input(x)
    Bk, Ck, zk = (as_kernel_input(t, mm) for t in (B, C, z))
    dtk = as_kernel_input(dt)
    Ak = as_kernel_input(A, f32)
    Dk = as_kernel_input(D, f32)
    biask = as_kernel_input(dt_bias, f32)
    init = as_kernel_input(initial_states, f32)
    dfin = as_kernel_input(dfinal_states, f32)
    dout = torch.zeros_like(xk) if dout is None else as_kernel_input(dout, mm)
    seq = seq_ids_int32(seq_idx)

    cfg = config or backward_config(b, h, g, p, n, chunk_size, mm, sms, seqlen=l,
                                    has_z=z is not None)
    check_config(cfg, p, n)
    state_dtype = state_dtype or default_state_dtype(mm, f32)
    lo, hi = dt_clamp_bounds(dt_limit)
    bufs = allocate_buffers(xk, dtk, Bk, Ck, zk, Dk, biask, cfg, state_dtype, f32, out_dtypes)
    calls = backward_plan(xk, dtk, Ak, Bk, Ck, zk, Dk, biask, lo, hi, dt_softplus, init, seq,
                          dout, dfin, bufs, cfg)
    if on_buffers is not None:
        on_buffers(bufs)
    launch_fn(calls)

    grads = dict(x=bufs.dx, dt=bufs.ddt, B=bufs.dB, C=bufs.dC, z=bufs.dz)
    grads["A"] = bufs.dA_part.sum(dim=0)
    grads["dt_bias"] = None if dt_bias is None else bufs.dbias_part.sum(dim=0)
    if D is not None:
        grads["D"] = bufs.dD_part.sum(dim=(0, 1, 3) if D.dim() == 1 else (0, 1))
    else:
        grads["D"] = None
    grads["initial_states"] = None if initial_states is None else bufs.hbuf
    grads = {k: None if inputs[k] is None else grads[k].to(inputs[k].dtype) for k in NAMES}
    return grads


def ssd_backward_cuda(x, dt, A, B, C, chunk_size, dout, dfinal_states=None, D=None, z=None,
                      dt_bias=None, initial_states=None, seq_idx=None, dt_softplus=False,
                      dt_limit=(0.0, INF), state_dtype=None, config=None):
    """Gradients of `ssd_forward_cuda`'s (out, final_states) for the cotangents dout (None: 0)
    and dfinal_states (None: 0). Inputs must already be validated (as for the forward).
    Returns a dict x, dt, A, B, C, D, z, dt_bias, initial_states -> gradient in the input's
    dtype (None for absent inputs); the same values as `reference.chunked_backward.ssd_chunked_backward`.
    `state_dtype`: dtype of the recomputed entry states and of the exit-state gradients
    (default: `default_state_dtype`). No host synchronization: capturable in a CUDA graph."""
    dev = x.device
    return run_backward(x, dt, A, B, C, chunk_size, dout, dfinal_states, D, z, dt_bias,
                        initial_states, seq_idx, dt_softplus, dt_limit, state_dtype, config,
                        launch_fn=lambda calls: launch_calls(calls, dev), sms=num_sms(dev))
