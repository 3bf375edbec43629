"""Tuning: ForwardConfig overrides found per kernel with cuda.tile.tune.exhaustive_search (`tune`),
and the cache that keeps them per shape bucket and toolchain.

Key (`make_key`): kernel family (e.g. "forward"), a shape *bucket* -- batch*heads rounded up
to a power of two, seqlen rounded up to a power of four (at least 1K), headdim and dstate
padded to powers of two (at least 16), the exact chunk size and dtype -- the GPU name, its SM
count, the cuda-tile version and the tileiras version. Its string form is the JSON key:

    forward|bh=32|T=16384|P=64|N=128|Q=128|bf16|NVIDIA H200|sms=132|cuda-tile=1.7.0|tileiras=13.4.92

Value: a dict of ForwardConfig field overrides, e.g. {"state_block_n": 32}. An empty dict means
"tuned: the dispatcher's default is best".

Where: `$MAMBA2_CUTILE_CACHE_DIR/tuning.json`, else `$XDG_CACHE_HOME/mamba2-cutile/`, else
`~/.cache/mamba2-cutile/`. Writes are atomic (temp file + os.replace) and merge with what is
on disk under an fcntl lock, so several processes can store at once. A missing, read-only or
corrupt cache never raises: lookups see nothing from it and stores stay in memory. The shipped
table `tuned_h200.json` (same format) is consulted after the user cache; for it, an entry
tuned with other cuda-tile/tileiras versions still matches (same family, bucket, GPU, SMs).

Set MAMBA2_CUTILE_TUNING=0 to make `apply_forward` ignore the cache (A/B comparisons).

Dispatcher integration (launch.default_config, before `_env_overrides`, so that
MAMBA2_CUTILE_CONFIG still wins): see `apply_forward`.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: atomic replace, no lock
    fcntl = None

SCHEMA = 1
FILE_NAME = "tuning.json"
ENV_DIR = "MAMBA2_CUTILE_CACHE_DIR"
ENV_DISABLE = "MAMBA2_CUTILE_TUNING"
SHIPPED = Path(__file__).with_name("tuned_h200.json")
FORWARD = "forward"

#: the default search space of `tune` (small: every config compiles new kernel variants)
# (the knobs that moved the H200 sweeps of 2026-11-30 or, by the CPU compile's resource counts,
# should: the state pass's n tile; chunk_scan's query block and occupancy 2, which compiles to two
# CTAs per SM without spills at block_q 64; a persistent scan never helped)
DEFAULT_SPACE = {"state_block_n": (16, 32, 64), "scan_block_q": (64, 128),
                 "scan_occupancy": (0, 2)}
#: fields a cached entry may not override (correctness, not speed)
_FIXED = ("chunk_size", "dstate_pad")
_POW2 = ("cumsum_block_h", "state_block_p", "state_block_n", "scan_block_q", "scan_block_p")
_RANGES = {"state_load_latency": (0, 10), "scan_load_latency": (0, 10),
           "state_occupancy": (0, 32), "scan_occupancy": (0, 32), "scan_persistent": (0, 16),
           "state_scale_x": (-1, 1), "state_fresh_acc": (0, 1), "scan_lowp": (0, 1),
           "scan_head_major": (0, 1)}


# --------------------------------------------------------------------------- keys

def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def bucket_bh(batch_heads: int) -> int:
    return next_pow2(max(1, batch_heads))


def bucket_seqlen(seqlen: int) -> int:
    """Smallest power of four >= seqlen, at least 1024: 1K, 4K, 16K, 64K, 256K, 1M, ..."""
    b = 1024
    while b < seqlen:
        b *= 4
    return b


def pad_dim(v: int) -> int:
    return max(16, next_pow2(v))


def dtype_tag(dtype) -> str:
    s = str(dtype).removeprefix("torch.")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
            "float": "fp32"}.get(s, s)


@dataclass(frozen=True)
class TuningKey:
    family: str
    bh: int
    seqlen: int
    headdim: int
    dstate: int
    chunk: int
    dtype: str
    gpu: str
    sms: int
    cuda_tile: str
    tileiras: str

    def __str__(self):
        return (f"{self.family}|bh={self.bh}|T={self.seqlen}|P={self.headdim}|N={self.dstate}"
                f"|Q={self.chunk}|{self.dtype}|{self.gpu}|sms={self.sms}"
                f"|cuda-tile={self.cuda_tile}|tileiras={self.tileiras}")

    @property
    def bucket(self) -> str:
        """The key without the toolchain versions (what the shipped table may match on)."""
        return str(self).rsplit("|cuda-tile=", 1)[0]

    @classmethod
    def parse(cls, s: str) -> "TuningKey":
        parts = s.split("|")
        if len(parts) != 11:
            raise ValueError(f"not a tuning key: {s!r}")
        val = lambda p, name: p.split("=", 1)[1] if p.startswith(name + "=") else None  # noqa: E731
        fam, bh, t, p, n, q, dt, gpu, sms, ctv, tiv = parts
        ints = [val(x, k) for x, k in ((bh, "bh"), (t, "T"), (p, "P"), (n, "N"), (q, "Q"),
                                       (sms, "sms"))]
        vers = val(ctv, "cuda-tile"), val(tiv, "tileiras")
        if None in ints or None in vers:
            raise ValueError(f"not a tuning key: {s!r}")
        bh, t, p, n, q, sms = (int(v) for v in ints)
        return cls(fam, bh, t, p, n, q, dt, gpu, sms, *vers)


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
        import torch
        if not torch.cuda.is_available():
            return "none", 0
        props = torch.cuda.get_device_properties(device_index)
        return props.name, int(props.multi_processor_count)
    except Exception:  # noqa: BLE001
        return "none", 0


def make_key(family=FORWARD, *, batch, seqlen, nheads, headdim, dstate, chunk_size, dtype,
             device_index=0, gpu=None, sms=None, cuda_tile=None, tileiras=None) -> TuningKey:
    """The cache key of a problem. GPU name/SMs come from `device_index` unless given; the
    cuda-tile/tileiras versions from the installed packages unless given."""
    if gpu is None or sms is None:
        g, s = device_info(device_index)
        gpu = g if gpu is None else gpu
        sms = s if sms is None else sms
    return TuningKey(family, bucket_bh(batch * nheads), bucket_seqlen(seqlen), pad_dim(headdim),
                     pad_dim(dstate), int(chunk_size), dtype_tag(dtype), str(gpu).replace("|", "/"),
                     int(sms), cuda_tile or cuda_tile_version(), tileiras or tileiras_version())


# --------------------------------------------------------------------------- storage

def cache_dir() -> Path:
    d = os.environ.get(ENV_DIR)
    if d:
        return Path(d).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "mamba2-cutile"
    return Path.home() / ".cache" / "mamba2-cutile"


def cache_path() -> Path:
    return cache_dir() / FILE_NAME


_lock = threading.Lock()
_state = {"path": None, "entries": None, "shipped": None, "generation": 0}
_warned = set()


def _warn_once(tag, msg):
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(f"mamba2_cutile.tuning: {msg}", RuntimeWarning, stacklevel=3)


def _read_entries(path: Path) -> dict:
    """Entries of a cache file; {} when missing, unreadable or corrupt (never raises)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError, UnicodeDecodeError) as e:
        _warn_once(("read", str(path)), f"ignoring unreadable tuning cache {path}: {e}")
        return {}
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        _warn_once(("format", str(path)), f"ignoring tuning cache {path}: no 'entries' table")
        return {}
    return {k: v for k, v in entries.items()
            if isinstance(v, dict) and isinstance(v.get("overrides"), dict)}


def _entries() -> dict:
    """The user cache, loaded once per cache path (re-read after `reload`)."""
    path = cache_path()
    if _state["entries"] is None or _state["path"] != path:
        with _lock:
            _state["entries"] = _read_entries(path)
            _state["path"] = path
            _state["generation"] += 1
    return _state["entries"]


def _shipped() -> dict:
    if _state["shipped"] is None:
        _state["shipped"] = _read_entries(SHIPPED)
    return _state["shipped"]


def reload():
    """Forget what was read (and stored in memory only); the next lookup reads the disk."""
    with _lock:
        _state["entries"] = None
        _state["shipped"] = None
        _state["generation"] += 1
        _apply_memo.clear()


def lookup(key) -> dict | None:
    """Overrides stored for `key` (a TuningKey or its string), or None. The user cache first,
    then the shipped table (exact key, then same bucket with other toolchain versions)."""
    skey = str(key)
    e = _entries().get(skey)
    if e is None:
        shipped = _shipped()
        e = shipped.get(skey)
        if e is None and shipped:
            try:
                bucket = TuningKey.parse(skey).bucket
            except ValueError:
                bucket = None
            if bucket is not None:
                for k in sorted(shipped):
                    if k.rsplit("|cuda-tile=", 1)[0] == bucket:
                        e = shipped[k]
    return None if e is None else dict(e["overrides"])


def entries() -> dict:
    """A copy of every entry of the user cache {key: {"overrides": ..., ...}}."""
    return {k: dict(v) for k, v in _entries().items()}


def store(key, overrides: dict, info: dict | None = None) -> bool:
    """Store `overrides` for `key`, merging with the file under a lock; returns True when it
    reached the disk, False when only the in-memory cache holds it (read-only or unusable
    directory: never raises for those)."""
    if not isinstance(overrides, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            for k, v in overrides.items()):
        raise TypeError(f"overrides must be a dict of str -> int, got {overrides!r}")
    entry = {"overrides": dict(overrides), **(info or {}),
             "stored": time.strftime("%Y-%m-%dT%H:%M:%S")}
    skey = str(key)
    mem = _entries()
    with _lock:
        mem[skey] = entry
        _state["generation"] += 1
        _apply_memo.clear()
    path = cache_path()
    try:
        merged = _write_merged(path, {skey: entry})
    except OSError as e:
        _warn_once(("write", str(path)), f"cannot write the tuning cache {path} ({e}); "
                                         "keeping tuned configs in memory for this process")
        return False
    with _lock:
        merged.update({k: v for k, v in mem.items() if k not in merged})  # memory-only ones
        _state["entries"] = merged
        _state["path"] = path
    return True


def _write_merged(path: Path, new: dict) -> dict:
    """Under an exclusive lock on `<path>.lock`: read the file, add `new`, write a temp file
    in the same directory, fsync, os.replace. Returns the merged entries."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a+") as lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            merged = _read_entries(path)
            merged.update(new)
            doc = {"schema": SCHEMA, "entries": dict(sorted(merged.items()))}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, indent=1)
                    f.write("\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        finally:
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return merged


# --------------------------------------------------------------------------- dispatcher hook

def valid_overrides(cfg, overrides: dict) -> dict | None:
    """`overrides` checked against ForwardConfig `cfg`: known int fields, never chunk_size or
    dstate_pad, powers of two for tile sizes (scan_block_q <= chunk, state_block_n <=
    dstate_pad, <= 256), hints within their ranges. None when anything is off."""
    names = {f.name for f in fields(cfg)}
    out = {}
    for k, v in overrides.items():
        if k not in names or k in _FIXED or not isinstance(v, int) or isinstance(v, bool):
            return None
        if k in _POW2 and (v < 1 or v & (v - 1) or v > 256):
            return None
        if k in _RANGES and not _RANGES[k][0] <= v <= _RANGES[k][1]:
            return None
        out[k] = v
    if out.get("scan_block_q", cfg.scan_block_q) > cfg.chunk_size:
        return None
    if out.get("state_block_n", cfg.state_block_n) > cfg.dstate_pad:
        return None
    return out


_apply_memo: dict = {}


def apply_forward(cfg, *, batch, seqlen, nheads, headdim, dstate, dtype, device_index=0):
    """`cfg` with the cached overrides of its bucket applied (or `cfg` itself: no entry,
    invalid entry, MAMBA2_CUTILE_TUNING=0, no CUDA). Never raises; memoized, so the cost on
    the hot path after the first call is one dict lookup.

    Integration in launch.default_config (add `seqlen=None, device_index=None` parameters),
    just before `return _env_overrides(cfg)`:

        if seqlen is not None and device_index is not None:
            from . import tuning
            cfg = tuning.apply_forward(cfg, batch=batch, seqlen=seqlen, nheads=nheads,
                                       headdim=headdim, dstate=dstate, dtype=dtype,
                                       device_index=device_index)

    and in interface.ssd_forward_cuda:

        cfg = config or launch.default_config(b, h, p, n, Q, x.dtype,
                                              launch.num_sms(dev.index or 0),
                                              seqlen=l, device_index=dev.index or 0)
    """
    if os.environ.get(ENV_DISABLE, "").strip().lower() in ("0", "off", "false", "no"):
        return cfg
    memo_key = (cfg, batch * nheads, bucket_seqlen(seqlen), headdim, dstate, str(dtype),
                device_index, _state["generation"], os.environ.get(ENV_DIR))
    hit = _apply_memo.get(memo_key)
    if hit is not None:
        return hit
    result = cfg
    try:
        key = make_key(FORWARD, batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim,
                       dstate=dstate, chunk_size=cfg.chunk_size, dtype=dtype,
                       device_index=device_index)
        over = lookup(key)
        if over:
            clean = valid_overrides(cfg, over)
            if clean is None:
                _warn_once(("invalid", str(key)), f"ignoring invalid cached overrides {over} "
                                                  f"for {key}")
            else:
                result = replace(cfg, **clean)
    except Exception as e:  # noqa: BLE001 - the cache must never break a forward call
        _warn_once(("apply", type(e).__name__), f"tuning lookup failed ({e}); using defaults")
    if len(_apply_memo) > 4096:
        _apply_memo.clear()
    _apply_memo[memo_key] = result
    return result


# --------------------------------------------------------------------------- search

def parse_space(spec: str | None) -> dict:
    """'state_block_n=16,32,64;scan_persistent=0,2' -> {field: (values...)}; '' -> default."""
    if not spec:
        return dict(DEFAULT_SPACE)
    space = {}
    for part in spec.split(";"):
        if not part.strip():
            continue
        name, _, values = part.partition("=")
        name = name.strip()
        if not values.strip():
            raise ValueError(f"--space: no values for {name!r} (want name=v1,v2;...)")
        space[name] = tuple(int(v) for v in values.split(","))
    return space


def candidates(base_cfg, space: dict) -> list:
    """Every combination of `space` as override dicts valid for `base_cfg`, without
    duplicates (combinations equal to the default collapse to {}), default first."""
    names = list(space)
    bad = [n for n in names if n not in {f.name for f in fields(base_cfg)} or n in _FIXED]
    if bad:
        raise ValueError(f"cannot tune {bad}: not ForwardConfig fields, or fixed")
    out, seen = [{}], {base_cfg}
    for combo in itertools.product(*(space[n] for n in names)):
        over = dict(zip(names, combo))
        clean = valid_overrides(base_cfg, over)
        if clean is None:
            continue
        cfg = replace(base_cfg, **clean)
        if cfg in seen:
            continue
        seen.add(cfg)
        out.append({k: v for k, v in clean.items() if getattr(base_cfg, k) != v})
    return out


#: the forward launch each ForwardConfig field belongs to, by prefix (index into forward_plan)
KERNELS = (("cumsum_", 0, "decay_cumsum"), ("state_", 1, "chunk_state_pass"),
           ("scan_", 2, "chunk_scan"))


def split_space(space: dict) -> dict:
    """{launch index: sub-space} of a search space: each kernel is searched on its own fields
    (their effects are independent), so the cost is the sum of the sub-spaces, not their
    product."""
    parts = {}
    for name, values in space.items():
        k = next((k for prefix, k, _ in KERNELS if name.startswith(prefix)), None)
        if k is None:
            raise ValueError(f"cannot tune {name!r}: not a field of one forward kernel")
        parts.setdefault(k, {})[name] = tuple(values)
    return dict(sorted(parts.items()))


def kernel_name(k: int) -> str:
    return next(name for _, i, name in KERNELS if i == k)


def tune(shapes, space=None, reps=30, min_gain=0.01, store_results=True, progress=None,
         check_tol=2e-2):
    """For each shape: search each forward kernel's fields of `space` (default DEFAULT_SPACE)
    with `cuda.tile.tune.exhaustive_search` (the kernel alone, L2 flushed, timed until its
    confidence interval converges), keep a kernel's winner when it beats that kernel's default
    by more than `min_gain`, then check the combination against the default config's output
    (relative difference <= `check_tol`) and time the whole forward both ways (CUDA graph).
    The combination is stored for the shape's bucket only if the whole forward gains too.
    Needs a CUDA GPU.

    `progress(shape, text)` is called before each kernel's search. Returns one dict per shape:
    shape, key, default_ms, best_ms, best, overrides (stored), results, stored."""
    import math

    import torch
    import cuda.tile as ct
    from cuda.tile.tune import exhaustive_search

    from . import launch
    from .bench import problems, timing

    if not torch.cuda.is_available():
        raise RuntimeError("tuning needs a CUDA GPU")
    space = dict(DEFAULT_SPACE if space is None else space)
    parts = split_space(space)
    dev = torch.cuda.current_device()
    report = []
    for shape in shapes:
        b, l, h, g, p, n = shape.dims()
        Q = shape.chunk
        inp = problems.make_inputs(shape)
        base = launch.default_config(b, h, p, n, Q, shape.dtype, launch.num_sms(dev))
        nc = -(-l // Q)
        f32 = torch.float32
        x, C = inp["x"], inp["C"]
        dt_buf = torch.empty((b, h, nc * Q), dtype=f32, device=x.device)
        cum_buf = torch.empty_like(dt_buf)
        states = torch.empty((b, h, nc, p, n), dtype=C.dtype, device=x.device)
        final = torch.empty((b, h, p, n), dtype=f32, device=x.device)
        out = torch.empty_like(x)
        plans = {}

        def plan_of(over, inp=inp, base=base, bufs=(dt_buf, cum_buf, states, final, out),
                    plans=plans):
            key = tuple(sorted(over.items()))
            if key not in plans:
                plans[key] = launch.forward_plan(
                    inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], None, inp["D"], None,
                    -math.inf, math.inf, False, inp["initial_states"], None, *bufs,
                    replace(base, **over))
            return plans[key]

        stream = torch.cuda.current_stream()

        def run(over, plan_of=plan_of):
            # the stream current at call time: a CUDA-graph capture runs on its own stream,
            # and launches on any other one are not captured (an empty graph times as ~1 us)
            s = torch.cuda.current_stream()
            for call in plan_of(over):
                ct.launch(s, call.grid, call.kernel, call.args)

        run({})                      # the later kernels' inputs, and the reference output
        ref = out.double()
        chosen, results = {}, []
        for k, sub in parts.items():
            name = kernel_name(k)
            cands = candidates(base, sub)
            if progress:
                progress(shape, f"{name} ({len(cands)} configs)")
            try:
                res = exhaustive_search(
                    cands, stream, lambda o, k=k: plan_of(o)[k].grid,
                    lambda o, k=k: plan_of(o)[k].kernel, lambda o, k=k: plan_of(o)[k].args,
                    quiet=True)
            except ValueError as e:   # every config failed
                results.append((f"{name}: all", f"{' '.join(str(e).split())[:160]}"))
                continue
            timed = {tuple(sorted(m.config.items())): m.mean_us for m in res.successes}
            for m in sorted(res.successes, key=lambda m: m.mean_us):
                results.append((f"{name} {m.config or 'default'}", m.mean_us / 1e3))
            for cfg, exc, msg in res.failures:
                results.append((f"{name} {cfg}", f"{exc.__name__}: {' '.join(msg.split())[:160]}"))
            default_us = timed.get(())
            if (res.best.config and default_us is not None
                    and res.best.mean_us < default_us * (1 - min_gain)):
                chosen.update(res.best.config)
        run({})
        default_ms = timing.time_graph(lambda: run({}), reps=reps)["median_ms"]
        kernels_ms = sum(ms for label, ms in results
                         if label.endswith(" default") and isinstance(ms, float))
        if default_ms < 0.5 * kernels_ms:
            # an empty CUDA graph (launches on a stream the capture does not see) times ~1 us
            results.append(("forward default", f"timing broken: {default_ms:.4f} ms, under half "
                            f"its kernels' {kernels_ms:.4f} ms; nothing stored"))
            report.append({"shape": shape.name, "key": None, "default_ms": None,
                           "best_ms": None, "best": {}, "overrides": {}, "results": results,
                           "stored": False})
            continue
        best_ms = default_ms
        if chosen:
            run(chosen)
            err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            if not err <= check_tol:
                results.append((f"combined {chosen}", f"rejected: output differs {err:.1e}"))
                chosen = {}
            else:
                ms = timing.time_graph(lambda: run(chosen), reps=reps)["median_ms"]
                results.append((f"forward {chosen}", ms))
                if ms < default_ms * (1 - min_gain):
                    best_ms = ms
                else:
                    chosen = {}
        results.append(("forward default", default_ms))
        key = make_key(FORWARD, batch=b, seqlen=l, nheads=h, headdim=p, dstate=n,
                       chunk_size=Q, dtype=shape.dtype, device_index=dev)
        stored = False
        if store_results:
            stored = store(key, chosen, {"shape": shape.describe(), "default_ms": default_ms,
                                         "best_ms": best_ms,
                                         "space": {k: list(v) for k, v in space.items()}})
        report.append({"shape": shape.name, "key": str(key), "default_ms": default_ms,
                       "best_ms": best_ms, "best": chosen, "overrides": chosen,
                       "results": results, "stored": stored})
        del inp, plans, ref, dt_buf, cum_buf, states, final, out
        torch.cuda.empty_cache()
    return report
