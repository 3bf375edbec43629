"""What every launcher shares: the planned launch (`KernelCall`), launching a plan, the GPU's SM
count, 64-bit indexing, kernel hints, kernel-ready inputs and the toolchain versions.

Nothing here reads tensor values, so plans stay safe under CUDA-graph capture, and everything
works on `meta` tensors (the CPU compile check builds the same plans the GPU path launches).
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass

import torch

INT32_LIMIT = 2**31 - 1
#: the SM count assumed for a tensor that is not on a CUDA device (meta tensors, CPU emulation):
#: the H200's, so CPU-built plans match the GPU's
DEFAULT_SMS = 132


@dataclass
class KernelCall:
    """One planned launch: a cuTile kernel, its grid and its argument tuple; where it may run
    beside its neighbours, a side stream (see `launch_calls`)."""
    kernel: object
    grid: tuple
    args: tuple
    stream: int = 0          # 0: the caller's stream; k > 0: side stream k
    join: bool = False       # wait for every side stream before this launch


def narrow_unit_strides(t):
    """`t` (a view, never a copy) with the stride of every size-1 dimension that exceeds int32
    replaced by the largest stride of `t` that fits (or 1).

    Why: the 32-bit kernel variants take arrays whose strides fit int32 (cuTile refuses others
    with "stride is too big"), and `needs_int64` rightly picks them for a view that spans fewer
    than 2**31 elements, but a batch-1 slice of a larger tensor (x[:, :cut], a slice of one
    projection) keeps the batch stride of the whole. The index along a size-1 dimension is
    always 0, so its stride is never used; copying another stride keeps its TMA alignment.
    Anything that is not such a tensor comes back unchanged (the same object)."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    shape, stride = t.shape, t.stride()
    if max(stride) <= INT32_LIMIT or all(n != 1 or abs(s) <= INT32_LIMIT
                                         for n, s in zip(shape, stride)):
        return t
    fits = [abs(s) for s in stride if abs(s) <= INT32_LIMIT]
    fill = max(fits) if fits else 1
    new = tuple(fill if n == 1 and abs(s) > INT32_LIMIT else s for n, s in zip(shape, stride))
    return t.as_strided(shape, new, t.storage_offset())


_SIDE_STREAMS: dict = {}


def _side_stream(device, k: int):
    """Side stream `k` of `device` for the calling thread, created once and kept (never on a
    hot path after that). Per thread: two threads' plans (one of them maybe under capture)
    never share a side stream object."""
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    key = (threading.get_ident(), index, k)
    s = _SIDE_STREAMS.get(key)
    if s is None:
        s = _SIDE_STREAMS[key] = torch.cuda.Stream(device=index)
    return s


def launch_calls(calls, device) -> None:
    """Launch `calls` in order on the current stream of `device` (the stream current at call
    time: a CUDA-graph capture runs on its own stream and sees only launches there).

    A call with `stream=k > 0` goes on side stream k after everything launched before it on
    the current stream and on stream k; later calls on the current stream do not wait for it
    until one with `join=True`, or the end of the plan: when this returns, the current stream
    has waited for every side stream (so a caller, and a capture, sees one ordered plan, and
    the caching allocator may reuse a buffer of the plan once the current stream is done).
    Side streams let two launches that underfill the GPU share it (a sequential pass beside
    another launch); a plan marks only launches that touch disjoint outputs."""
    if not calls:
        return
    import cuda.tile as ct

    main = torch.cuda.current_stream(device)
    pending = {}
    try:
        for call in calls:
            stream = main
            if call.join:
                for side in pending.values():
                    main.wait_stream(side)
                pending.clear()
            if call.stream:
                stream = _side_stream(device, call.stream)
                stream.wait_stream(main)
                pending[call.stream] = stream
            ct.launch(stream, call.grid, call.kernel, call.args)
    finally:
        # also when a launch raises: the plan's buffers go back to the allocator on the
        # caller's stream, which must not reuse them while a side launch still runs
        for side in pending.values():
            main.wait_stream(side)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _device_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(where=None) -> int:
    """SM count of a CUDA device (an index, a torch.device or a tensor on it); DEFAULT_SMS for
    anything not on a CUDA device."""
    if isinstance(where, torch.Tensor):
        where = where.device
    if isinstance(where, torch.device):
        if where.type != "cuda":
            return DEFAULT_SMS
        where = where.index if where.index is not None else torch.cuda.current_device()
    if where is None:
        if not torch.cuda.is_available():
            return DEFAULT_SMS
        where = torch.cuda.current_device()
    return _device_sms(int(where))


def needs_int64(*tensors) -> bool:
    """True when any tensor spans 2**31 elements or more (counting its strided extent)."""
    for t in tensors:
        if t is None:
            continue
        numel = t.numel()
        # a contiguous tensor spans exactly its elements (the common case, one C call)
        if numel == 0 or (numel <= INT32_LIMIT and t.is_contiguous()):
            continue
        extent = 1
        for s, st in zip(t.shape, t.stride()):
            extent += (s - 1) * abs(st)
        if extent > INT32_LIMIT:
            return True
    return False


@functools.lru_cache(maxsize=None)
def with_hints(kernel, occupancy: int = 0, warps: int = 0):
    """`kernel` with occupancy / worker-warp hints (0: the compiler's choice); created once per
    (kernel, hints) and kept, because each new kernel object has its own compile cache."""
    hints = {}
    if occupancy:
        hints["occupancy"] = occupancy
    if warps:
        hints["num_worker_warps"] = warps
    return kernel.replace_hints(**hints) if hints else kernel


#: the occupancy hint of `kernels.sum_partials` (see sum_partials_call)
SUM_PARTIALS_OCCUPANCY = 4


def sum_partials_call(parts, out, parts2=None, out2=None, sms: int = DEFAULT_SMS):
    """The launch that sums a backward's (P, R, N) float32 partials over P into `out` (R, N)
    in its dtype (and `parts2` (P, R2, N) into `out2`, R2 <= R, in the same launch):
    `kernels.sum_partials`. Column blocks of 16-256 so that about `sms` programs run, row
    tiles of about 4096 floats, under the occupancy-4 hint: unhinted the sm_90 compile takes 255
    registers and 67-224 KB of shared memory (one program per SM: the 512 programs of groups
    of 1024 with a bias take four waves); hinted 64 registers, 51 KB, no stack (untimed)."""
    from .kernels.sum_partials import sum_partials, sum_partials_i64

    p, r, n = parts.shape
    per_sm = max(1, (r * n) // max(1, sms))
    block_n = max(16, min(256, 1 << (per_sm.bit_length() - 1)))
    block_p = max(1, min(next_pow2(p), 4096 // block_n))
    two = parts2 is not None
    kernel = sum_partials_i64 if needs_int64(parts, out, parts2, out2) else sum_partials
    return KernelCall(with_hints(kernel, SUM_PARTIALS_OCCUPANCY),
                      (-(-n // block_n) * r, 1, 2 if two else 1),
                      (parts, out, parts2 if two else parts, out2 if two else out,
                       block_p, block_n, two))


def as_kernel_input(t, dtype=None):
    """A tensor the kernels can load: unit innermost stride (for TMA), no stride-0 (expanded)
    dimension (TMA descriptors want strides that grow with the dimension), size-1 dimensions
    with strides that fit int32 (`narrow_unit_strides`), optional dtype cast. Views that
    already qualify, such as slices of one projection, are not copied."""
    if t is None:
        return None
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if not t.dim():
        return t
    stride = t.stride()
    if stride[-1] != 1 or (0 in stride and any(
            st == 0 and sz > 1 for st, sz in zip(stride, t.shape))):
        t = t.contiguous()
        stride = t.stride()
    return narrow_unit_strides(t) if max(stride) > INT32_LIMIT else t


def seq_ids_int32(seq_idx):
    """Sequence ids (batch, seqlen) as the kernels' contiguous int32 ids, without reading a
    value on the host: a plain cast where every id fits int32; otherwise each row's ids
    replaced by their rank in the row (where the id's first copy lands among the row's ids
    sorted, minus the row's count of negative ids), so ids past int32 neither wrap nor
    saturate onto another sequence's. The ranks keep which tokens share an id at any distance
    (the convolution compares tokens up to width - 1 apart, in any order of ids), the order
    (the scan's rows are non-decreasing) and the sign (a negative id is padding)."""
    if seq_idx is None or seq_idx.dtype == torch.int32:
        return None if seq_idx is None else seq_idx.contiguous()
    s = seq_idx.to(torch.int64)
    if not s.numel():
        return s.to(torch.int32).contiguous()
    fits = (s.min() >= -2**31) & (s.max() <= INT32_LIMIT)          # 0-d, stays on the device
    ordered, where_from = s.sort(dim=-1, stable=True)
    fresh = torch.ones_like(ordered, dtype=torch.bool)
    fresh[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    pos = torch.arange(s.shape[-1], device=s.device).expand_as(ordered)
    first = torch.where(fresh, pos, torch.zeros_like(pos)).cummax(dim=-1).values
    rank = (first - (s < 0).sum(dim=-1, keepdim=True)).to(torch.int32)
    ranked = torch.empty_like(rank).scatter_(-1, where_from, rank)
    return torch.where(fits, s.to(torch.int32), ranked).contiguous()


def dt_clamp_bounds(dt_limit):
    """The kernels' clamp of dt' for mamba_ssm's `dt_limit`, the default (0, inf) included:
    mamba_ssm's Triton scan clamps dt' to the limit on every call, so without softplus a
    negative dt (or dt + dt_bias) is 0 there, not a growing decay (only its PyTorch reference
    `ssd_selective_scan` skips the default clamp)."""
    lo, hi = (float(v) for v in dt_limit)
    return lo, hi


_DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
               torch.float64: "fp64"}


def dtype_tag(dtype) -> str:
    """Short name of a floating dtype ("bf16", "fp16", "fp32", "fp64"); str(dtype) otherwise."""
    return _DTYPE_TAGS.get(dtype, str(dtype).removeprefix("torch."))


@functools.lru_cache(maxsize=None)
def tileiras_version() -> str:
    """Version of the tileiras cuda-tile compiles with, e.g. '13.4.92', else 'unknown'.

    Asks the binary cuda-tile itself would run (`tileiras --version`, through cuda-tile's
    private `_compile._get_compiler_version_string`, which may fall back to a system
    tileiras); failing that, the nvidia-cuda-tileiras package version."""
    try:
        from cuda.tile._compile import _get_compiler_version_string
        text = _get_compiler_version_string() or ""
        m = re.search(r"\bV(\d+\.\d+(?:\.\d+)?)", text) or \
            re.search(r"release (\d+\.\d+)", text)
        if m:
            return m.group(1)
    except Exception:  # noqa: BLE001 - private API, missing binary, ...
        pass
    try:
        from importlib.metadata import version
        return version("nvidia-cuda-tileiras")
    except Exception:  # noqa: BLE001
        return "unknown"


def version_at_least(version: str, major: int, minor: int) -> bool:
    """Whether a 'major.minor[.patch]' version string is at least major.minor ('unknown' and
    other non-versions: False)."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (major, minor)


@functools.lru_cache(maxsize=None)
def cuda_tile_version() -> str:
    try:
        import cuda.tile as ct
        return str(ct.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


@functools.lru_cache(maxsize=None)
def device_info(device_index: int = 0):
    """(GPU name, SM count) of a CUDA device, or ('none', 0) without CUDA."""
    try:
        if not torch.cuda.is_available():
            return "none", 0
        props = torch.cuda.get_device_properties(device_index)
        return props.name, int(props.multi_processor_count)
    except Exception:  # noqa: BLE001
        return "none", 0
