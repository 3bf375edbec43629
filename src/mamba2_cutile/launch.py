"""Kernel plans for the forward pass: configs, grids and argument lists.

A plan is built from tensors (real CUDA tensors at run time, or `meta` tensors when compiling on
a CPU for CI), so the CPU compile check exercises exactly the argument lists the GPU path
launches. Nothing here reads tensor values: plans are safe under CUDA-graph capture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .checks import config_from_env
from .kernels.chunk_scan import chunk_scan, chunk_scan_i64
from .kernels.chunk_state_pass import chunk_state_pass, chunk_state_pass_i64
from .kernels.decay_cumsum import decay_cumsum, decay_cumsum_i64

SUPPORTED_CHUNK_SIZES = (64, 128, 256)
MAX_HEADDIM = 256
MAX_DSTATE = 256
INT32_LIMIT = 2**31 - 1


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class ForwardConfig:
    """Tile sizes and hints of the three forward kernels (all powers of two)."""
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


def scale_x(cfg: ForwardConfig) -> bool:
    """Whether chunk_state_pass puts the decay weights on X (else on B): an explicit 0/1, or
    by default on the smaller of the two MMA operand tiles (BLOCK_P vs BLOCK_N)."""
    if cfg.state_scale_x >= 0:
        return bool(cfg.state_scale_x)
    return cfg.state_block_n > cfg.state_block_p


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(batch, nheads, headdim, dstate, chunk_size, dtype, sms=132, seqlen=None,
                   device_index=None, has_seq=False) -> ForwardConfig:
    """The dispatcher: a good config from the shape alone (no search, no sync), then the
    tuning cache's overrides for the shape's bucket on this GPU when `seqlen` and
    `device_index` are given (`mamba2-cutile tune` fills it), then MAMBA2_CUTILE_CONFIG.
    `has_seq`: seq_idx is given (its same-sequence mask changes the best chunk_scan tile)."""
    np_ = max(16, next_pow2(dstate))
    bp = min(64, max(16, next_pow2(headdim)))
    p_tiles = -(-headdim // bp)
    # The chunk loop of chunk_state_pass is sequential, so the grid must fill the GPU by
    # splitting the state: the widest n-tile that still gives most SMs a program (measured on
    # the H200 at the seed problem: 128 programs of 64x32 beat 256 of 64x16 and 64 of 64x64).
    bn = np_
    while bn > 16 and batch * nheads * p_tiles * (-(-dstate // bn)) < (3 * sms) // 4:
        bn //= 2
    big = np_ >= 256 or dtype == torch.float32
    bq = min(chunk_size, 64 if big else 128)
    # Measured on the H200 (2026-11-30 sweep, results/): the (C B^T) X MMA in the input dtype
    # (scan_lowp, as mamba_ssm) cut chunk_scan from 0.280 to 0.210 ms at the seed problem; the
    # state pass's MMA into a fresh accumulator was as fast or faster at both shapes swept; the
    # decay weights belong on the smaller MMA operand (weighting X instead of a 128-wide B cut
    # the state pass from 0.458 to 0.174 ms at B=2 T=8K H=80 chunk 256).
    cfg = ForwardConfig(
        chunk_size=chunk_size,
        cumsum_block_h=min(16, max(2, next_pow2(nheads))),
        state_block_p=bp,
        state_block_n=bn,
        state_load_latency=8,
        scan_block_q=bq,
        scan_block_p=bp,
        dstate_pad=np_,
        scan_lowp=1,
        state_fresh_acc=1,
        # a chunk of several query blocks (the K-loop path): two CTAs per SM cut chunk_scan
        # from 0.662 to 0.374 ms at B=2 T=8K H=80 chunk 256, and 0.207 to 0.122 ms at H=24
        # (H200, 2026-11-30 session-3 sweep)
        scan_occupancy=2 if bq < chunk_size else 0,
    )
    if seqlen is not None and device_index is not None:
        from . import tuning
        cfg = tuning.apply_forward(cfg, batch=batch, seqlen=seqlen, nheads=nheads,
                                   headdim=headdim, dstate=dstate, dtype=dtype,
                                   device_index=device_index)
    if has_seq and cfg.scan_block_q > 64:
        # (after the tuning table, whose entries are measured without seq_idx) with seq_idx,
        # 64-token query blocks at 2 CTAs/SM: with the per-pair sequence-id mask they cut the
        # whole forward 0.360 -> 0.291 ms at the seed problem and 0.389 -> 0.317 ms at B=2
        # T=8K H=24 chunk 256 with z, dt_bias and seq_idx (128-token blocks spilled); with
        # today's run-start mask 128-token blocks no longer spill but are still slower there:
        # 0.335 against 0.306 ms (H200, session-5 sweeps, results/)
        cfg = replace(cfg, scan_block_q=64, scan_occupancy=2)
    return config_from_env(cfg, "MAMBA2_CUTILE_CONFIG", frozen=("chunk_size",))


def _sms_of(t) -> int:
    return num_sms(t.device.index or 0) if t.device.type == "cuda" else 132


def needs_int64(*tensors) -> bool:
    """True when any tensor spans 2**31 elements or more (counting its strided extent)."""
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
        if extent > INT32_LIMIT:
            return True
    return False


@functools.lru_cache(maxsize=None)
def hinted(kernel, occupancy: int = 0, warps: int = 0):
    """`kernel` with occupancy / worker-warp hints (0: the compiler's choice); created once per
    (kernel, hints) and kept, because each new kernel object has its own compile cache."""
    hints = {}
    if occupancy:
        hints["occupancy"] = occupancy
    if warps:
        hints["num_worker_warps"] = warps
    return kernel.replace_hints(**hints) if hints else kernel


@dataclass
class KernelCall:
    kernel: object
    grid: tuple
    args: tuple


def forward_plan(x, dt, A, B, C, z, D, dt_bias, dt_lo, dt_hi, dt_softplus, init, seq_idx,
                 dt_buf, cum_buf, states, final, out, cfg: ForwardConfig):
    """The three launches of the forward pass. Unused optional inputs must be None."""
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
    big = needs_int64(x, dt, B, C, z, seq_idx, seq_start, init, dt_buf, cum_buf, states, out)
    n_q = -(-seqlen // cfg.scan_block_q)       # query blocks holding at least one token
    p_tiles = -(-headdim // cfg.scan_block_p)
    if cfg.scan_persistent:
        n_tiles = n_q * p_tiles * batch * nheads
        scan_grid = (min(n_tiles, cfg.scan_persistent * _sms_of(x)), 1, 1)
    else:
        scan_grid = (n_q * batch * nheads, p_tiles, 1)
    calls = [
        KernelCall(
            decay_cumsum_i64 if big else decay_cumsum,
            (batch * nchunks, -(-nheads // cfg.cumsum_block_h), 1),
            (dt, A, dt_bias if dt_bias is not None else A, float(dt_lo), float(dt_hi),
             dt_buf, cum_buf, seq_arg, seq_start, Q, cfg.cumsum_block_h, dt_bias is not None,
             bool(dt_softplus), seq_idx is not None),
        ),
        KernelCall(
            hinted(chunk_state_pass_i64 if big else chunk_state_pass, cfg.state_occupancy),
            (batch * nheads, -(-headdim // cfg.state_block_p), -(-dstate // cfg.state_block_n)),
            (x, B, dt_buf, cum_buf, init if init is not None else final, seq_arg, states, final,
             Q, cfg.state_block_p, cfg.state_block_n, nheads // ngroups,
             init is not None, seq_idx is not None, cfg.state_load_latency,
             scale_x(cfg), bool(cfg.state_fresh_acc)),
        ),
        KernelCall(
            hinted(chunk_scan_i64 if big else chunk_scan, cfg.scan_occupancy, cfg.scan_warps),
            scan_grid,
            (x, B, C, z if z is not None else x, D if D is not None else A, dt_buf, cum_buf,
             seq_start, states, out, Q, cfg.scan_block_q, cfg.scan_block_p, cfg.dstate_pad,
             nheads // ngroups, 0 if D is None else D.dim(), z is not None, seq_idx is not None,
             cfg.scan_load_latency, cfg.scan_persistent > 0,
             bool(cfg.scan_lowp) and x.dtype != torch.float32,
             bool(cfg.scan_head_major),
             min(cfg.scan_block_n or cfg.dstate_pad, cfg.dstate_pad)),
        ),
    ]
    return calls


def compile_variants():
    """Problems whose plans cover the kernel variants the dispatcher picks, for the CPU
    compile check: every dtype x chunk size with all options on, then the tile sizes
    (headdim/dstate buckets), option subsets and 64-bit indexing at one dtype.

    Each item: (name, dict of problem parameters for `plan_for_problem`).
    """
    items = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for Q in SUPPORTED_CHUNK_SIZES:
            items.append((f"{str(dtype)[6:]}-Q{Q}-all", dict(dtype=dtype, chunk_size=Q)))
    bf = torch.bfloat16
    for (h, p, n) in ((8, 16, 16), (8, 32, 32), (64, 80, 64), (2, 256, 256), (128, 64, 96)):
        items.append((f"bf16-h{h}-p{p}-n{n}", dict(dtype=bf, nheads=h, headdim=p, dstate=n)))
    items.append(("bf16-no-options", dict(dtype=bf, options=())))
    items.append(("bf16-D-head", dict(dtype=bf, options=("D_head",))))
    items.append(("bf16-int64", dict(dtype=bf, int64=True)))
    items.append(("bf16-fp32-states-fp16-dt",
                  dict(dtype=bf, state_dtype=torch.float32, dt_dtype=torch.float16)))
    # tuning options a config may select
    items.append(("bf16-persistent", dict(dtype=bf, overrides=dict(scan_persistent=2))))
    items.append(("bf16-persistent-head-major", dict(dtype=bf, overrides=dict(
        scan_persistent=1, scan_head_major=1, scan_block_n=32))))
    items.append(("bf16-lowp-head-major", dict(dtype=bf, overrides=dict(scan_lowp=1,
                                                                       scan_head_major=1))))
    items.append(("fp16-lowp-Q256", dict(dtype=torch.float16, chunk_size=256,
                                         overrides=dict(scan_lowp=1))))
    items.append(("bf16-8-warps-occupancy-2", dict(dtype=bf, overrides=dict(
        scan_warps=8, scan_occupancy=2, state_occupancy=2))))
    items.append(("fp32-scale-x-Q256", dict(dtype=torch.float32, chunk_size=256,
                                            overrides=dict(state_scale_x=1))))
    items.append(("bf16-state-fresh-acc-p32", dict(dtype=bf, overrides=dict(
        state_fresh_acc=1, state_block_p=32))))
    items.append(("bf16-scan-occupancy-2-p32", dict(dtype=bf, overrides=dict(
        scan_occupancy=2, scan_block_p=32))))
    items.append(("bf16-Q256-scan-occupancy-2", dict(dtype=bf, chunk_size=256, overrides=dict(
        scan_occupancy=2))))
    for bn in (32, 64):
        items.append((f"bf16-scan-block-n{bn}", dict(dtype=bf, overrides=dict(scan_block_n=bn))))
    items.append(("fp16-Q256-scan-block-n32-n96", dict(dtype=torch.float16, chunk_size=256,
                                                       dstate=96,
                                                       overrides=dict(scan_block_n=32))))
    return items


ALL_OPTIONS = ("D_chan", "z", "dt_bias", "softplus", "init", "seq_idx")


def plan_for_problem(dtype=torch.bfloat16, chunk_size=128, batch=4, seqlen=16384, nheads=8,
                     ngroups=1, headdim=64, dstate=128, options=ALL_OPTIONS, int64=False,
                     state_dtype=None, dt_dtype=torch.float32, device="meta", overrides=None):
    """The forward plan for a problem, on `meta` tensors by default (for compiling)."""
    b, l, h, g, p, n, Q = batch, seqlen, nheads, ngroups, headdim, dstate, chunk_size
    if int64:
        l = max(l, -(-(2**31) // (b * h * p)) + 1)
    e = lambda *s, dt=dtype: torch.empty(s, dtype=dt, device=device)  # noqa: E731
    nc = -(-l // Q)
    x = e(b, l, h, p)
    f32 = torch.float32
    D = e(h, p, dt=f32) if "D_chan" in options else e(h, dt=f32) if "D_head" in options else None
    cfg = replace(default_config(b, h, p, n, Q, dtype, has_seq="seq_idx" in options),
                  **(overrides or {}))
    return forward_plan(
        x, e(b, l, h, dt=dt_dtype), e(h, dt=f32), e(b, l, g, n), e(b, l, g, n),
        e(b, l, h, p) if "z" in options else None, D,
        e(h, dt=f32) if "dt_bias" in options else None, 0.0, float("inf"), "softplus" in options,
        e(b, h, p, n, dt=f32) if "init" in options else None,
        e(b, l, dt=torch.int32) if "seq_idx" in options else None,
        e(b, h, nc * Q, dt=f32), e(b, h, nc * Q, dt=f32),
        e(b, h, nc, p, n, dt=state_dtype or dtype), e(b, h, p, n, dt=f32), x, cfg)
