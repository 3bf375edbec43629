"""CPU: the tuning cache (keys, atomic merged writes, concurrency, fallbacks) and the search."""

import json
import multiprocessing
import os
import sys
import warnings
from dataclasses import replace

import pytest
import torch

from mamba2_cutile.bench import tune as search
from mamba2_cutile.tuning import cache as tuning

H200 = dict(gpu="NVIDIA H200", sms=132)


REAL_SHIPPED = tuning.SHIPPED


@pytest.fixture(autouse=True)
def empty_shipped(tmp_path, monkeypatch):
    """Every test here sees an empty shipped table (the real one is checked on its own in
    test_shipped_table)."""
    empty = tmp_path / "shipped-empty.json"
    empty.write_text(json.dumps({"schema": tuning.SCHEMA, "entries": {}}))
    monkeypatch.setattr(tuning, "SHIPPED", empty)
    tuning.reload()
    yield
    tuning.reload()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory, and a fresh in-memory state."""
    d = tmp_path / "cache"
    monkeypatch.setenv(tuning.ENV_DIR, str(d))
    monkeypatch.delenv(tuning.ENV_DISABLE, raising=False)
    tuning.reload()
    tuning._warned.clear()
    yield d
    tuning.reload()


def key(**kw):
    args = dict(batch=4, seqlen=16384, nheads=8, headdim=64, dstate=128, chunk_size=128,
                dtype=torch.bfloat16, cuda_tile="1.7.0", tileiras="13.4.92", **H200)
    args.update(kw)
    return tuning.make_key(tuning.FORWARD, **args)


# --------------------------------------------------------------------------- keys

def test_key_string_and_parse():
    k = key()
    assert str(k) == ("forward|bh=32|T=16384|P=64|N=128|Q=128|bf16|NVIDIA H200|sms=132"
                      "|cuda-tile=1.7.0|tileiras=13.4.92")
    assert tuning.TuningKey.parse(str(k)) == k
    assert k.bucket == str(k).split("|cuda-tile=")[0]
    with pytest.raises(ValueError):
        tuning.TuningKey.parse("forward|bh=32")


def test_key_buckets_not_exact_shapes():
    # batch*heads to powers of two; seqlen to powers of four (>= 1K); dims padded (>= 16)
    assert key(batch=3) == key(batch=4)                     # 24 and 32 heads -> 32
    assert key(batch=5) != key(batch=4)                     # 40 -> 64
    assert key(batch=2, nheads=16) == key()                 # 32 either way
    assert key(seqlen=16000) == key(seqlen=16384) == key(seqlen=4097)
    assert key(seqlen=16385) != key()
    assert key(seqlen=16385).seqlen == 65536
    assert key(seqlen=1).seqlen == 1024 and key(seqlen=1000).seqlen == 1024
    assert key(seqlen=5000).seqlen == 16384
    assert key(headdim=80).headdim == 128 and key(headdim=80) == key(headdim=128)
    assert key(dstate=96).dstate == 128 and key(dstate=8).dstate == 16
    assert key(headdim=64) != key(headdim=32)
    assert key(chunk_size=256) != key()                     # chunk and dtype are exact
    assert key(dtype=torch.float16) != key()
    assert key(dtype=torch.float16).dtype == "fp16" and key(dtype=torch.float32).dtype == "fp32"
    assert key(gpu="NVIDIA B200") != key() and key(sms=114) != key()
    assert key(cuda_tile="1.8.0") != key() and key(tileiras="13.5.0") != key()
    assert key(cuda_tile="1.8.0").bucket == key().bucket


def test_bucket_helpers():
    assert [tuning.bucket_bh(v) for v in (1, 2, 3, 24, 32, 33, 160)] == [1, 2, 4, 32, 32, 64, 256]
    assert [tuning.bucket_seqlen(v) for v in (0, 1024, 1025, 4096, 262144, 300000)] == \
        [1024, 1024, 4096, 4096, 262144, 1048576]
    assert [tuning.pad_dim(v) for v in (1, 16, 17, 80, 256)] == [16, 16, 32, 128, 256]


def test_make_key_without_gpu_and_versions():
    k = tuning.make_key(batch=1, seqlen=10, nheads=2, headdim=8, dstate=8, chunk_size=64,
                        dtype=torch.float32)
    if not torch.cuda.is_available():
        assert (k.gpu, k.sms) == ("none", 0)
    assert k.cuda_tile and k.tileiras


def test_tileiras_version_read_and_fallback(monkeypatch):
    """The version comes from `tileiras --version` (through cuda-tile), then from the
    nvidia-cuda-tileiras package, else "unknown"; a garbage banner never passes as a version."""
    import re
    import types

    import importlib.metadata as md

    from mamba2_cutile import runtime

    def with_banner(text, package_version):
        fake = types.ModuleType("cuda.tile._compile")
        fake._get_compiler_version_string = lambda: text
        monkeypatch.setitem(sys.modules, "cuda.tile._compile", fake)

        def version(name):
            if package_version is None:
                raise md.PackageNotFoundError(name)
            return package_version
        monkeypatch.setattr(md, "version", version)
        runtime.tileiras_version.cache_clear()
        try:
            return runtime.tileiras_version()
        finally:
            runtime.tileiras_version.cache_clear()

    runtime.tileiras_version.cache_clear()
    v = runtime.tileiras_version()          # the installed one
    runtime.tileiras_version.cache_clear()
    try:
        md.version("nvidia-cuda-tileiras")
        assert re.fullmatch(r"\d+\.\d+(\.\d+)?", v), v
    except md.PackageNotFoundError:
        assert v == "unknown" or re.fullmatch(r"\d+\.\d+(\.\d+)?", v), v
    banner = "tileiras: NVIDIA (R) Tile IR compiler\nCuda compilation tools, release 13.4, V13.4.92"
    assert with_banner(banner, None) == "13.4.92"
    assert with_banner("Cuda compilation tools, release 13.2", None) == "13.2"
    assert with_banner("garbage 1.2.3 banner", "13.3.1") == "13.3.1"     # package fallback
    assert with_banner("garbage", None) == "unknown"
    monkeypatch.setitem(sys.modules, "cuda.tile._compile", None)          # import fails
    runtime.tileiras_version.cache_clear()
    monkeypatch.setattr(md, "version", lambda name: (_ for _ in ()).throw(
        md.PackageNotFoundError(name)))
    try:
        assert runtime.tileiras_version() == "unknown"
    finally:
        runtime.tileiras_version.cache_clear()
    assert runtime.version_at_least("13.4.92", 13, 4) and runtime.version_at_least("14.0", 13, 4)
    assert not runtime.version_at_least("13.3.9", 13, 4)
    assert not runtime.version_at_least("unknown", 13, 4)


# --------------------------------------------------------------------------- storage

def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path / "a"))
    assert tuning.cache_dir() == tmp_path / "a"
    monkeypatch.delenv(tuning.ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.cache_dir() == tmp_path / "xdg" / "mamba2-cutile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.cache_dir() == tmp_path / "home" / ".cache" / "mamba2-cutile"


def test_store_lookup_roundtrip(cache):
    assert tuning.lookup(key()) is None
    assert not cache.exists()                      # a lookup creates nothing
    assert tuning.store(key(), {"state_block_n": 32}, {"default_ms": 0.4})
    assert tuning.lookup(key()) == {"state_block_n": 32}
    assert tuning.lookup(str(key())) == {"state_block_n": 32}
    assert tuning.lookup(key(seqlen=5000)) == {"state_block_n": 32}     # same bucket
    assert tuning.lookup(key(chunk_size=256)) is None
    # a fresh process state reads it back from disk
    tuning.reload()
    assert tuning.lookup(key()) == {"state_block_n": 32}
    doc = json.loads((cache / tuning.FILE_NAME).read_text())
    assert doc["schema"] == tuning.SCHEMA
    entry = doc["entries"][str(key())]
    assert entry["overrides"] == {"state_block_n": 32} and entry["default_ms"] == 0.4
    # the returned dict is a copy
    tuning.lookup(key())["state_block_n"] = 64
    assert tuning.lookup(key()) == {"state_block_n": 32}
    # an empty dict ("the default is best") is a stored answer, not a miss
    tuning.store(key(batch=64), {})
    assert tuning.lookup(key(batch=64)) == {}


def test_store_rejects_bad_values(cache):
    with pytest.raises(TypeError):
        tuning.store(key(), {"state_block_n": "32"})
    with pytest.raises(TypeError):
        tuning.store(key(), {"scan_persistent": True})


def test_atomic_write_leaves_no_temp_files(cache):
    for i in range(5):
        tuning.store(key(batch=2 ** i), {"state_block_n": 16})
    names = sorted(os.listdir(cache))
    assert names == [tuning.FILE_NAME, tuning.FILE_NAME + ".lock"]
    assert len(json.loads((cache / tuning.FILE_NAME).read_text())["entries"]) == 5


def test_failed_write_keeps_old_file(cache, monkeypatch):
    tuning.store(key(), {"state_block_n": 32})
    before = (cache / tuning.FILE_NAME).read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tuning.os, "fsync", disk_full)
    with pytest.warns(RuntimeWarning, match="cannot write"):
        assert tuning.store(key(batch=64), {"state_block_n": 16}) is False
    assert (cache / tuning.FILE_NAME).read_bytes() == before          # untouched
    assert sorted(os.listdir(cache)) == [tuning.FILE_NAME, tuning.FILE_NAME + ".lock"]
    assert tuning.lookup(key(batch=64)) == {"state_block_n": 16}       # kept in memory
    assert tuning.lookup(key()) == {"state_block_n": 32}


def test_merge_with_other_writers(cache):
    """A store merges with what another process wrote since this one read the file."""
    tuning.store(key(), {"state_block_n": 32})
    doc = json.loads((cache / tuning.FILE_NAME).read_text())
    doc["entries"]["other|key"] = {"overrides": {"scan_persistent": 2}}
    (cache / tuning.FILE_NAME).write_text(json.dumps(doc))
    tuning.store(key(batch=64), {"state_block_n": 16})
    entries = json.loads((cache / tuning.FILE_NAME).read_text())["entries"]
    assert set(entries) == {str(key()), str(key(batch=64)), "other|key"}
    assert tuning.lookup("other|key") == {"scan_persistent": 2}       # now seen here too


def _writer(cache_dir, worker, n, queue):
    os.environ[tuning.ENV_DIR] = cache_dir
    tuning.reload()
    ok = True
    for i in range(n):
        k = tuning.make_key(batch=1, seqlen=1024 * 4 ** (i % 3), nheads=2 ** (i // 3),
                            headdim=64, dstate=128, chunk_size=128, dtype=torch.bfloat16,
                            gpu=f"GPU{worker}", sms=132, cuda_tile="1.7.0", tileiras="13.4.92")
        ok &= tuning.store(k, {"state_block_n": 16 * (1 + i % 3)})
    queue.put((worker, ok))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_concurrent_writers_all_keys_present(cache):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    workers, n = 6, 12
    procs = [ctx.Process(target=_writer, args=(str(cache), w, n, queue)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    results = dict(queue.get(timeout=10) for _ in range(workers))
    assert all(results.values())
    entries = json.loads((cache / tuning.FILE_NAME).read_text())["entries"]
    assert len(entries) == workers * n
    assert {k.split("|")[7] for k in entries} == {f"GPU{w}" for w in range(workers)}
    assert not [f for f in os.listdir(cache) if f.endswith(".tmp")]
    tuning.reload()
    assert len(tuning.entries()) == workers * n


def test_unusable_directory_falls_back_to_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(tuning.ENV_DIR, str(blocker / "cache"))
    tuning.reload()
    assert tuning.lookup(key()) is None
    with pytest.warns(RuntimeWarning, match="keeping tuned configs in memory"):
        assert tuning.store(key(), {"state_block_n": 32}) is False
    assert tuning.lookup(key()) == {"state_block_n": 32}
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # warned once, not on every store
        assert tuning.store(key(batch=64), {"state_block_n": 16}) is False
    assert tuning.lookup(key(batch=64)) == {"state_block_n": 16}
    tuning.reload()


def test_read_only_filesystem_falls_back_to_memory(cache, monkeypatch):
    tuning.store(key(), {"state_block_n": 32})

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(tuning.tempfile, "mkstemp", read_only)
    with pytest.warns(RuntimeWarning):
        assert tuning.store(key(batch=64), {"state_block_n": 16}) is False
    assert tuning.lookup(key(batch=64)) == {"state_block_n": 16}
    assert tuning.lookup(key()) == {"state_block_n": 32}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root ignores directory permissions")
def test_read_only_directory_permissions(cache):
    cache.mkdir()
    tuning.store(key(), {"state_block_n": 32})
    os.chmod(cache, 0o555)
    try:
        with pytest.warns(RuntimeWarning):
            assert tuning.store(key(batch=64), {"state_block_n": 16}) is False
        assert tuning.lookup(key(batch=64)) == {"state_block_n": 16}
        tuning.reload()
        assert tuning.lookup(key()) == {"state_block_n": 32}           # still readable
    finally:
        os.chmod(cache, 0o755)


@pytest.mark.parametrize("content", ["{not json", "", "[]", '{"entries": 5}',
                                     '{"entries": {"k": 3, "j": {"overrides": 1}}}', "\xff\xfe"])
def test_corrupt_file_tolerated(cache, content):
    cache.mkdir()
    (cache / tuning.FILE_NAME).write_text(content, errors="surrogateescape")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tuning.lookup(key()) is None
        assert tuning.lookup("k") is None
        assert tuning.store(key(), {"state_block_n": 32})
    doc = json.loads((cache / tuning.FILE_NAME).read_text())
    assert doc["entries"][str(key())]["overrides"] == {"state_block_n": 32}


def test_shipped_table(cache, tmp_path, monkeypatch):
    doc = json.loads(REAL_SHIPPED.read_text())
    assert doc["schema"] == tuning.SCHEMA and isinstance(doc["entries"], dict)
    for k, entry in doc["entries"].items():      # every shipped entry parses and is valid
        parsed = tuning.TuningKey.parse(k)
        assert str(parsed) == k and parsed.gpu == "NVIDIA H200"
        assert entry["best_ms"] < entry["default_ms"]
        base = launch_default(parsed)
        assert tuning.valid_overrides(base, entry["overrides"]) == entry["overrides"]
    shipped = tmp_path / "shipped.json"
    old = key(cuda_tile="1.6.0", tileiras="13.3.0")
    shipped.write_text(json.dumps({"schema": 1, "entries": {
        str(old): {"overrides": {"scan_persistent": 2}},
        str(key(batch=64)): {"overrides": {"state_block_n": 64}}}}))
    monkeypatch.setattr(tuning, "SHIPPED", shipped)
    tuning.reload()
    assert tuning.lookup(key(batch=64)) == {"state_block_n": 64}       # exact
    assert tuning.lookup(key()) == {"scan_persistent": 2}               # other toolchain
    assert tuning.lookup(key(gpu="NVIDIA B200")) is None                # other GPU: no
    tuning.store(key(), {"state_block_n": 16})                          # user cache wins
    assert tuning.lookup(key()) == {"state_block_n": 16}


def launch_default(k):
    from mamba2_cutile.ssd import forward
    return forward.forward_config(k.bh, 1, k.headdim, k.dstate, k.chunk,
                                 getattr(torch, {"bf16": "bfloat16", "fp16": "float16",
                                                 "fp32": "float32"}[k.dtype]), k.sms)


# --------------------------------------------------------------------------- dispatcher hook

@pytest.fixture
def launch():
    pytest.importorskip("cuda.tile")
    from mamba2_cutile.ssd import forward
    return forward


def seed_cfg(launch, **kw):
    args = dict(batch=4, nheads=8, headdim=64, dstate=128, chunk_size=128,
                dtype=torch.bfloat16)
    args.update(kw)
    return launch.forward_config(args["batch"], args["nheads"], args["headdim"],
                                 args["dstate"], args["chunk_size"], args["dtype"])


def test_valid_overrides(launch):
    cfg = seed_cfg(launch)
    assert tuning.valid_overrides(cfg, {"state_block_n": 64}) == {"state_block_n": 64}
    assert tuning.valid_overrides(cfg, {"scan_persistent": 2, "state_load_latency": 4})
    for bad in ({"chunk_size": 64}, {"dstate_pad": 256}, {"state_block_n": 48},
                {"state_block_n": 256}, {"scan_block_q": 256}, {"nope": 1},
                {"state_load_latency": 11}, {"scan_persistent": -1}, {"state_block_p": 2.0}):
        assert tuning.valid_overrides(cfg, bad) is None, bad


def test_apply_forward(cache, launch, monkeypatch):
    monkeypatch.setattr(tuning, "device_info", lambda idx=0: ("NVIDIA H200", 132))
    cfg = seed_cfg(launch)
    kw = dict(batch=4, seqlen=16384, nheads=8, headdim=64, dstate=128, dtype=torch.bfloat16,
              device_index=0)
    assert tuning.apply_forward(cfg, **kw) is cfg                       # nothing stored
    k = tuning.make_key(batch=4, seqlen=16384, nheads=8, headdim=64, dstate=128,
                        chunk_size=128, dtype=torch.bfloat16, device_index=0)
    tuning.store(k, {"state_block_n": 64, "scan_persistent": 2})        # invalidates the memo
    out = tuning.apply_forward(cfg, **kw)
    assert out.state_block_n == 64 and out.scan_persistent == 2
    assert out.chunk_size == cfg.chunk_size and out.dstate_pad == cfg.dstate_pad
    assert tuning.apply_forward(cfg, **dict(kw, seqlen=9000)) == out    # same bucket
    monkeypatch.setenv(tuning.ENV_DISABLE, "0")
    assert tuning.apply_forward(cfg, **kw) is cfg
    monkeypatch.delenv(tuning.ENV_DISABLE)
    tuning.store(k, {"chunk_size": 64})                                 # invalid: ignored
    with pytest.warns(RuntimeWarning, match="invalid"):
        assert tuning.apply_forward(cfg, **kw) is cfg


def test_apply_forward_never_raises(cache, launch, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("driver exploded")
    monkeypatch.setattr(tuning, "make_key", boom)
    cfg = seed_cfg(launch)
    with pytest.warns(RuntimeWarning, match="lookup failed"):
        assert tuning.apply_forward(cfg, batch=4, seqlen=100, nheads=8, headdim=64,
                                    dstate=128, dtype=torch.bfloat16) is cfg


def test_seq_idx_clamps_the_scan_block_after_the_table(cache, launch, monkeypatch):
    """With seq_idx, chunk_scan's query block is at most 64 (a 128-token block spills), also
    over a table entry that says otherwise; MAMBA2_CUTILE_CONFIG still has the last word."""
    monkeypatch.setattr(tuning, "device_info", lambda idx=0: ("NVIDIA H200", 132))
    kw = dict(seqlen=16384, device_index=0)
    for chunk, headdim in ((128, 64), (256, 64), (256, 128), (256, 256)):
        cfg = seed_cfg(launch, chunk_size=chunk, headdim=headdim)
        # headdim <= 128: 64-token blocks under the shape rule already (chunk_scan_group, at
        # chunk 128 also for a chunk-256 call); chunk_scan over 128-token blocks at 256
        assert cfg.scan_block_q == (64 if headdim <= 128 else 128)
        seq = launch.forward_config(4, 8, headdim, 128, chunk, torch.bfloat16, has_seq=True)
        assert (seq.scan_block_q, seq.scan_occupancy) == (64, 2)
        assert replace(seq, scan_block_q=cfg.scan_block_q,
                       scan_occupancy=cfg.scan_occupancy) == cfg
    assert launch.forward_config(4, 8, 64, 128, 64, torch.bfloat16, has_seq=True) == \
        seed_cfg(launch, chunk_size=64)
    k = tuning.make_key(batch=4, seqlen=16384, nheads=8, headdim=64, dstate=128,
                        chunk_size=128, dtype=torch.bfloat16, device_index=0)
    tuning.store(k, {"scan_block_q": 128, "state_block_n": 64})
    seq = launch.forward_config(4, 8, 64, 128, 128, torch.bfloat16, has_seq=True, **kw)
    assert (seq.scan_block_q, seq.state_block_n) == (64, 64)
    monkeypatch.setenv("MAMBA2_CUTILE_CONFIG", "scan_block_q=128")
    assert launch.forward_config(4, 8, 64, 128, 128, torch.bfloat16, has_seq=True,
                                 **kw).scan_block_q == 128
    monkeypatch.delenv("MAMBA2_CUTILE_CONFIG")
    # the plan a compile test builds follows the same rule: twice the query blocks
    from mamba2_cutile.bench import plans
    plain = search.launch_of(plans.forward_problem_plan(options=("z",), chunk_size=256,
                                                        headdim=256), "chunk_scan")
    seq = search.launch_of(plans.forward_problem_plan(options=("z", "seq_idx"),
                                                      chunk_size=256, headdim=256), "chunk_scan")
    assert seq.grid[0] == 2 * plain.grid[0] and seq.grid[1:] == plain.grid[1:]


# --------------------------------------------------------------------------- search

def test_parse_space():
    assert search.parse_space(None) == search.DEFAULT_SPACE
    assert search.parse_space("state_block_n=16,32; scan_persistent=0,2") == \
        {"state_block_n": (16, 32), "scan_persistent": (0, 2)}
    with pytest.raises(ValueError):
        search.parse_space("state_block_n=")
    with pytest.raises(ValueError):
        search.parse_space("state_block_n=a,b")


def test_candidates(launch):
    cfg = seed_cfg(launch)                 # seed: state_block_n 32, block_q 64, occupancy 2
    cands = search.candidates(cfg, search.DEFAULT_SPACE)
    assert cands[0] == {}
    assert len(cands) == 12                # 3 x 2 x 2, the default combination once
    assert {"state_block_n": 16} in cands and {"scan_block_q": 128} in cands
    assert tuning.valid_overrides(cfg, {"scan_lowp": 2}) is None
    assert all(k not in ("chunk_size", "dstate_pad") for c in cands for k in c)
    small = seed_cfg(launch, dstate=32)    # dstate_pad 32: state_block_n 64 is invalid
    assert all(c.get("state_block_n", 0) <= 32 for c in search.candidates(small, {
        "state_block_n": (16, 32, 64)}))
    with pytest.raises(ValueError):
        search.candidates(cfg, {"chunk_size": (64,)})


def test_split_space_per_kernel():
    parts = search.split_space(search.DEFAULT_SPACE)
    assert parts == {1: {"state_block_n": (16, 32, 64)},
                     2: {"scan_block_q": (64, 128), "scan_occupancy": (0, 2)}}
    assert [search.kernel_name(k) for k in parts] == ["chunk_state_pass", "chunk_scan"]
    assert search.split_space({"cumsum_block_h": (4, 8)}) == {0: {"cumsum_block_h": (4, 8)}}
    with pytest.raises(ValueError, match="dstate_pad"):
        search.split_space({"dstate_pad": (64,)})
    # each adds a launch that a search of one kernel alone would not time
    for name in ("state_segments", "segment_fold", "scan_cb", "scan_causal"):
        with pytest.raises(ValueError, match=f"cannot tune '{name}': it changes two launches"):
            search.split_space({name: (0, 1)})
    with pytest.raises(ValueError, match="cannot tune 'scan_heads': it replaces chunk_scan"):
        search.split_space({"scan_heads": (1, 8)})
    with pytest.raises(ValueError, match="cannot tune .scan_walk.: it replaces chunk_scan"):
        search.split_space({"scan_walk": (0, 1)})


def test_launch_of_finds_kernels_by_name():
    """The tuner's launch lookup by kernel name: with state_segments, chunk_state_carry sits
    between the state pass and chunk_scan; chunk_scan is the output launch (chunk_scan_group
    at headdims up to 128), not the flagged-tile pass after it (scan_causal 4, the default)."""
    pytest.importorskip("cuda.tile")
    from mamba2_cutile.bench import plans
    for p, over, out in ((256, None, "chunk_scan"), (256, {"state_segments": 4}, "chunk_scan"),
                         (64, None, "chunk_scan_group"), (64, {"state_segments": 4},
                                                          "chunk_scan_group"),
                         (128, None, "chunk_scan_group")):
        calls = plans.forward_problem_plan(overrides=over, chunk_size=256, headdim=p)
        for name in ("decay_cumsum", "chunk_state_pass", "chunk_scan"):
            call = search.launch_of(calls, name)
            want = out if name == "chunk_scan" else name
            assert call.kernel._annotated_function.pyfunc.__name__ == want + "_fn"
        assert search.launch_of(calls, "chunk_scan") is calls[-2]
        assert calls[-1].args[-1] == 8            # CHECK=8: the flagged-tile pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_tune_needs_gpu():
    pytest.importorskip("cuda.tile")
    from mamba2_cutile.bench import problems
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        search.tune([problems.SEED])


@pytest.mark.parametrize("broken_timing", [False, True])
def test_tune_control_flow_with_fakes(cache, monkeypatch, broken_timing):
    """tune()'s whole control flow on the CPU, with the GPU pieces faked: exhaustive_search
    sees one sub-space per kernel built from real forward plans (meta tensors); a scan config
    that "wins" is checked against the default's output, timed whole, and stored. A whole
    forward timed faster than half its kernels (an empty CUDA graph: an H200 run of 2026-11-30
    timed 0.0013 ms that way) is reported for that shape, and nothing is stored."""
    pytest.importorskip("cuda.tile")
    import cuda.tile as ct
    import cuda.tile.tune as ct_tune

    from mamba2_cutile import runtime
    from mamba2_cutile.bench import problems, timing

    shape = problems.parse_custom("1,256,4,1,32,64,64")
    seen = {}

    def fake_search(cands, stream, grid_fn, kernel_fn, args_fn, quiet=False):
        name = kernel_fn(cands[0])._annotated_function.pyfunc.__name__
        seen[name] = list(cands)
        for c in cands:                       # every candidate yields a real plan entry
            assert len(grid_fn(c)) == 3 and isinstance(args_fn(c), tuple)
        meas = [ct_tune.Measurement(config=c, mean_us=10.0 - 4.0 * (c.get("scan_block_q") == 16)
                                    + i * 1e-3, num_samples=5, error_margin_us=0.1)
                for i, c in enumerate(cands)]
        return ct_tune.TuningResult(best=min(meas, key=lambda m: m.mean_us),
                                    successes=tuple(meas), failures=())

    real_inputs = problems.make_inputs

    def fake_inputs(s, device="cuda", seed=0):
        return real_inputs(s, device="cpu")

    times = iter([0.0013] if broken_timing else [1.0, 0.5])   # default, then the combination
    # a CUDA-graph capture runs on its own stream: the whole-forward launches must go there
    stream = {"now": "main"}
    launched_on = []

    def fake_time_graph(fn, reps=30):
        stream["now"] = "capture"
        fn()
        stream["now"] = "main"
        return {"median_ms": next(times)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream["now"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(runtime, "num_sms", lambda i: 132)
    monkeypatch.setattr(tuning, "device_info", lambda i=0: ("FakeGPU", 132))
    monkeypatch.setattr(problems, "make_inputs", fake_inputs)
    monkeypatch.setattr(ct, "launch", lambda s, *a: launched_on.append(s))
    monkeypatch.setattr(ct_tune, "exhaustive_search", fake_search)
    monkeypatch.setattr(timing, "time_graph", fake_time_graph)
    monkeypatch.setattr(torch.Tensor, "double", lambda t: torch.ones(2, dtype=torch.float64))

    space = {"state_block_n": (16, 32), "scan_block_q": (16, 64)}
    if broken_timing:
        (rep,) = search.tune([shape], space)
        assert not rep["stored"] and rep["overrides"] == {} and tuning.entries() == {}
        assert "timing broken" in dict(rep["results"])["forward default"]
        return
    (rep,) = search.tune([shape], space)
    assert "capture" in launched_on and "main" in launched_on
    assert set(seen) == {"chunk_state_pass_fn", "chunk_scan_fn"}
    assert {} in seen["chunk_scan_fn"] and {"scan_block_q": 16} in seen["chunk_scan_fn"]
    assert rep["overrides"] == {"scan_block_q": 16} and rep["stored"]
    assert rep["default_ms"] == 1.0 and rep["best_ms"] == 0.5
    assert tuning.lookup(tuning.TuningKey.parse(rep["key"])) == {"scan_block_q": 16}
