"""The tuning cache: ForwardConfig overrides per shape bucket and toolchain, found by
`mamba2-cutile tune` (`bench/tune.py`), and their lookup on the forward's hot path.

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

The dispatcher (`ssd.forward.forward_config`) applies an entry before MAMBA2_CUTILE_CONFIG, so
that the environment still wins (`mamba2_cutile.config`). The search that fills the cache is
`mamba2_cutile.bench.tune`.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import apply_overrides
from ..runtime import cuda_tile_version, device_info, dtype_tag, next_pow2, tileiras_version

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



# --------------------------------------------------------------------------- keys

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


def shipped_entries() -> dict:
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
        shipped = shipped_entries()
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
    """`overrides` checked against config `cfg`: int fields of its class, none of its `FIXED`
    ones nor `chunk_size` (the table is keyed by the chunk a call computes with), and a result
    that passes the config's own validation. None when anything is off."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in overrides.values()):
        return None
    if "chunk_size" in overrides:
        return None
    try:
        apply_overrides(cfg, overrides, "tuning cache")
    except ValueError:
        return None
    return dict(overrides)


_apply_memo: dict = {}


def apply_forward(cfg, *, batch, seqlen, nheads, headdim, dstate, dtype, device_index=0):
    """`cfg` with the cached overrides of its bucket applied (or `cfg` itself: no entry,
    invalid entry, MAMBA2_CUTILE_TUNING=0, no CUDA). Never raises; memoized, so the cost on
    the hot path after the first call is one dict lookup. `ssd.forward.forward_config` calls
    it (see `mamba2_cutile.config` for where it sits in the precedence).
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
