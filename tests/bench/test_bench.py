"""CPU: roofline formulas, the shape registry, the benchmark runner (wall-clock timer, CPU
path), the report writers, the verify matrix and the command line (no GPU needed)."""

import csv
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from mamba2_cutile import cli
from mamba2_cutile.bench import verify
from mamba2_cutile.bench import impls, problems, report, roofline, runner

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


# --------------------------------------------------------------------------- roofline

SEED = (4, 16384, 8, 1, 64, 128)


def test_forward_roofline_seed():
    # x and out: 4*16384*8*64 bf16 each; B, C: 4*16384*128 bf16 each; dt: 4*16384*8 fp32
    assert roofline.forward_bytes(*SEED) == 2 * 67_108_864 + 2 * 16_777_216 + 2_097_152
    assert roofline.forward_bytes(*SEED) == 169_869_312
    # C B^T per group 2*b*l*Q*n; per head 2*b*l*h*(Q*p + 2*p*n)
    assert roofline.forward_flops(*SEED, 128) == 2_147_483_648 + 25_769_803_776
    floor = roofline.floor_ms(roofline.forward_bytes(*SEED), roofline.forward_flops(*SEED, 128))
    assert floor == pytest.approx(169_869_312 / 4.3e12 * 1e3)     # memory-bound
    assert floor == pytest.approx(0.03950449116279069)            # results/2026-11-30 value
    assert roofline.bound(roofline.forward_bytes(*SEED), roofline.forward_flops(*SEED, 128)) \
        == "memory"


def test_forward_roofline_options():
    base = roofline.forward_bytes(*SEED)
    assert roofline.forward_bytes(*SEED, has_z=True) == base + 67_108_864
    assert roofline.forward_bytes(*SEED, states=True) == base + 2 * 4 * 8 * 64 * 128 * 4
    assert roofline.forward_bytes(*SEED, seq_idx=True) == base + 4 * 16384 * 4
    assert roofline.forward_bytes(*SEED, elem=4) == 2 * base - 2_097_152


def test_backward_roofline_seed():
    # x, dout, dx; B, C, dB, dC; dt, ddt
    assert roofline.backward_bytes(*SEED) == 3 * 67_108_864 + 4 * 16_777_216 + 2 * 2_097_152
    assert roofline.backward_bytes(*SEED, has_z=True) == \
        roofline.backward_bytes(*SEED) + 2 * 67_108_864
    assert roofline.backward_bytes(*SEED, states=True) == \
        roofline.backward_bytes(*SEED) + 3 * 4 * 8 * 64 * 128 * 4
    # per group 4*b*l*Q*n, per head b*l*h*(4*Q*p + 8*p*n)
    assert roofline.backward_flops(*SEED, 128) == 4_294_967_296 + 51_539_607_552
    # the gradients cost twice the forward's products (per group and per head alike)
    assert roofline.backward_flops(*SEED, 128) == 2 * roofline.forward_flops(*SEED, 128)


def test_problem_floor_modes():
    b, l, h, g, p, n = 2, 8192, 80, 1, 64, 128
    f_ms, f_by, f_fl, _ = roofline.problem_floor(b, l, h, g, p, n, 256, "fwd", states=False)
    b_ms, b_by, b_fl, _ = roofline.problem_floor(b, l, h, g, p, n, 256, "bwd", states=False)
    t_ms, t_by, t_fl, bound = roofline.problem_floor(b, l, h, g, p, n, 256, "fwdbwd",
                                                     states=False)
    assert (f_by, f_fl) == (roofline.forward_bytes(b, l, h, g, p, n),
                            roofline.forward_flops(b, l, h, g, p, n, 256))
    assert (b_by, b_fl) == (roofline.backward_bytes(b, l, h, g, p, n),
                            roofline.backward_flops(b, l, h, g, p, n, 256))
    assert (t_by, t_fl) == (f_by + b_by, f_fl + b_fl)
    assert t_ms == pytest.approx(roofline.floor_ms(t_by, t_fl))
    assert bound in ("memory", "compute")
    # README: 2.7B-like forward floor 0.110 ms
    assert f_ms == pytest.approx(0.110, abs=5e-4)
    with pytest.raises(ValueError):
        roofline.problem_floor(*SEED, 128, "sideways")
    assert "4.3 TB/s" in roofline.CONSTANTS and "790 TFLOP/s" in roofline.CONSTANTS


# --------------------------------------------------------------------------- registry

def test_registry_contents():
    R = problems.REGISTRY
    assert set(R) >= {"default", "seed", "sweep", "models", "options", "all"}
    assert R["seed"] == [problems.SEED]
    assert problems.SEED.dims() == SEED and problems.SEED.chunk == 128
    sweep = R["sweep"]
    assert len(sweep) == 15
    assert {s.seqlen for s in sweep} == {1024, 4096, 16384, 65536, 262144}
    assert {s.dstate for s in sweep} == {64, 128, 256}
    assert all((s.batch, s.nheads, s.headdim, s.ngroups, s.chunk, s.dtype)
               == (4, 8, 64, 1, 128, torch.bfloat16) for s in sweep)
    models = R["models"]
    layers = models[:6]                     # every model at B=2 T=8K
    assert [s.nheads for s in layers] == [24, 32, 48, 64, 80, 128]
    assert all((s.headdim, s.dstate, s.chunk) == (64, 128, 256) for s in layers)
    assert [s.ngroups for s in layers] == [1, 1, 1, 1, 1, 8]
    assert 10 <= len(models) <= 16
    tokens = [s.batch * s.seqlen for s in models]
    assert len({(s.batch, s.seqlen) for s in models if 8192 <= s.batch * s.seqlen <= 65536}) >= 3
    assert any(s.nheads == 128 and s.ngroups == 8 and s.chunk == 128 for s in models)
    assert any(s.dstate == 256 for s in models) and any(s.headdim == 128 for s in models)
    assert any(t <= 2048 for t in tokens) and any(t <= 512 for t in tokens)
    assert any(s.batch == 1 and s.seqlen >= 65536 for s in models)
    assert sum(s.chunk == 256 for s in models) >= len(models) - 1
    opts = R["options"]
    assert {o for s in opts for o in s.options} == {"z", "dt_bias", "seq_idx"}
    assert any(s.seqlen % s.chunk for s in opts)                    # a partial last chunk
    names = [s.name for s in problems.all_shapes()]
    assert len(names) == len(set(names))
    assert all(s in R["all"] for k in R for s in R[k])
    assert len(R["default"]) <= 8 and problems.SEED in R["default"]


def test_select_filters():
    assert problems.select("seed") == [problems.SEED]
    assert [s.seqlen for s in problems.select("sweep", dstates="128")] == \
        [1024, 4096, 16384, 65536, 262144]
    assert {s.dstate for s in problems.select("sweep", seqlens="4K,16384")} == {64, 128, 256}
    assert len(problems.select("sweep", seqlens="4K", dstates="64,256")) == 2
    assert [s.name for s in problems.select("models", match="2.7b")] == [
        "mamba2-2.7b-T8K", "mamba2-2.7b-B8-T4K"]
    q = problems.select("models", match="^7b", chunk=128)
    # the chunk-128 7B-class row becomes the chunk-256 one's twin: timed once
    assert [(s.name, s.chunk) for s in q] == [("7b-class-T8K-Q128", 128)]
    assert len(problems.select("models", chunk=64)) == len(problems.select("models")) - 1
    with pytest.raises(ValueError, match="--chunk"):
        problems.select("seed", chunk=32)
    assert problems.select("seed,seed") == [problems.SEED]
    assert problems.select("seed-T64K-N128")[0].seqlen == 65536
    c = problems.select("", custom=["2,1000,4,2,80,96,64,fp16"])[0]
    assert (c.dims(), c.chunk, c.dtype) == ((2, 1000, 4, 2, 80, 96), 64, torch.float16)
    f32 = problems.select("seed", dtype=torch.float32)[0]
    assert f32.dtype == torch.float32 and f32.name == "seed-fp32"
    with pytest.raises(ValueError, match="unknown shape"):
        problems.select("nope")
    with pytest.raises(ValueError):
        problems.parse_custom("1,2,3")
    with pytest.raises(ValueError):
        problems.parse_dtype("int8")


def test_make_inputs_cpu():
    s = problems.Shape("t", 2, 100, 4, 2, 8, 16, 64, torch.float16, options=problems.OPTIONS)
    inp = problems.make_inputs(s, device="cpu")
    assert set(inp) == {"x", "dt", "A", "B", "C", "D", "initial_states", "z", "dt_bias",
                        "dt_softplus", "seq_idx"}
    assert inp["x"].shape == (2, 100, 4, 8) and inp["x"].dtype == torch.float16
    assert inp["B"].shape == (2, 100, 2, 16) and inp["seq_idx"].dtype == torch.int32
    assert bool((inp["seq_idx"][:, 1:] >= inp["seq_idx"][:, :-1]).all())
    dt = torch.nn.functional.softplus(inp["dt"] + inp["dt_bias"])
    assert 5e-4 < dt.min() and dt.max() < 0.2
    plain = problems.make_inputs(problems.Shape("p", 1, 10, 2, 1, 4, 4, 64), device="cpu")
    assert "z" not in plain and (plain["dt"] > 0).all()
    assert torch.equal(plain["x"], problems.make_inputs(
        problems.Shape("p", 1, 10, 2, 1, 4, 4, 64), device="cpu")["x"])     # deterministic
    dout, dfinal = problems.make_grad_outputs(s, device="cpu")
    assert dout.shape == inp["x"].shape and dfinal.shape == (2, 4, 8, 16)


# --------------------------------------------------------------------------- implementations

TINY = problems.Shape("tiny", 2, 200, 4, 2, 16, 32, 64, torch.float32)


def test_build_skips():
    inp = problems.make_inputs(TINY, device="cpu")
    big = problems.Shape("big", 4, 65536, 8, 1, 64, 128, 128)
    with pytest.raises(impls.Skip, match="2\\^20"):
        impls.build("reference", inp, big)
    opt = problems.Shape("o", 2, 200, 4, 2, 16, 32, 64, options=("z",))
    with pytest.raises(impls.Skip, match="ours vs mamba_ssm"):
        impls.build("reference", inp, opt)
    for name in ("mamba_ssm", "tilegym"):
        if not impls.available(name):
            with pytest.raises(impls.Skip, match="missing"):
                impls.build(name, inp, TINY)
    with pytest.raises(ValueError, match="unknown implementation"):
        impls.build("nope", inp, TINY)
    with pytest.raises(ValueError, match="grads"):
        impls.build(impls.OURS, inp, TINY, "bwd")


def test_tilegym_not_applicable(monkeypatch):
    calls = []
    fake_fwd = lambda *a, **k: calls.append("fwd") or (a[0], a[6])      # noqa: E731
    monkeypatch.setattr(impls, "_tilegym_fns", lambda: (fake_fwd, None))
    inp = problems.make_inputs(TINY, device="cpu")
    with pytest.raises(impls.Skip, match="T % chunk"):                 # 200 % 64 != 0
        impls.build("tilegym", inp, TINY)
    even = problems.Shape("even", 2, 256, 4, 2, 16, 32, 64, torch.float32)
    inp = problems.make_inputs(even, device="cpu")
    impls.build("tilegym", inp, even)()
    assert calls == ["fwd"]
    with pytest.raises(impls.Skip, match="no backward"):
        impls.build("tilegym", inp, even, "bwd", problems.make_grad_outputs(even, "cpu"))
    odd = problems.Shape("odd", 2, 256, 4, 2, 80, 32, 64, torch.float32)
    with pytest.raises(impls.Skip, match="powers of two"):
        impls.build("tilegym", problems.make_inputs(odd, device="cpu"), odd)
    opt = problems.Shape("o", 2, 256, 4, 2, 16, 32, 64, options=("seq_idx",))
    with pytest.raises(impls.Skip, match="z/dt_bias/seq_idx"):
        impls.build("tilegym", problems.make_inputs(opt, device="cpu"), opt)


def test_tilegym_tuning_report(monkeypatch):
    for var in ("DISABLE_AUTOTUNE", "TILEGYM_DISABLE_AUTOTUNE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    assert impls.tilegym_tuning().startswith("untuned (DISABLE_AUTOTUNE=1")
    monkeypatch.delenv("DISABLE_AUTOTUNE")
    monkeypatch.setenv("TILEGYM_DISABLE_AUTOTUNE", "true")
    assert impls.tilegym_tuning().startswith("untuned (TILEGYM_DISABLE_AUTOTUNE")
    monkeypatch.delenv("TILEGYM_DISABLE_AUTOTUNE")
    if not impls.available("tilegym"):
        assert impls.tilegym_tuning().startswith("tuned")


# --------------------------------------------------------------------------- runner (CPU)

EVEN = problems.Shape("even", 2, 256, 4, 2, 16, 32, 64, torch.float32)


def run_cpu(shapes, names, mode="fwd"):
    return runner.run(shapes, names, mode, timer=runner.WallTimer(reps=2), device="cpu")


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwdbwd"])
def test_runner_cpu_modes(mode):
    rows = run_cpu([TINY], list(impls.ORDER), mode)
    by = {r["impl"]: r for r in rows}
    assert list(by) == list(impls.ORDER)
    ours, ref = by[impls.OURS], by["reference"]
    assert ours["status"] == "ok" and ref["status"] == "ok"        # the CPU path has autograd
    assert ref["checked_against"] == impls.OURS
    expect = {"fwd": {"out", "final"}, "bwd": {"dx", "ddt", "dA", "dB", "dC", "dD", "dinit"}}
    expect["fwdbwd"] = expect["fwd"] | expect["bwd"]
    assert set(ref["diff_detail"]) == expect[mode]
    assert ref["max_diff_vs_first"] < 1e-4
    for name in ("mamba_ssm", "tilegym"):
        if not impls.available(name):
            assert by[name]["status"] == "missing"
    assert ours["graph"]["n"] == 2 and ours["eager"]["median_ms"] > 0
    assert ours["first_call_s"] > 0 and ours["pct_of_floor"] > 0
    assert ours["speedup_vs"]["reference"] == pytest.approx(
        ref["graph"]["median_ms"] / ours["graph"]["median_ms"])
    assert ref["ours_speedup"] == ours["speedup_vs"]["reference"]
    floor = runner.case_floor(TINY, mode)
    assert ours["floor_ms"] == floor[0] and ours["mode"] == mode
    assert ours["dims"] == [2, 200, 4, 2, 16, 32, 64] and ours["dtype"] == "fp32"


def test_compile_in_processes_cpu(monkeypatch):
    """--compile-jobs: every (shape, implementation) but the reference called in spawned
    workers, each reporting its status; the autotune-cache switch the workers inherit is the
    caller's again afterwards."""
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    out = runner.compile_in_processes([TINY, EVEN], [impls.OURS, "reference", "mamba_ssm"],
                                      ("fwd", "bwd"), jobs=2, device="cpu")
    by = {(s, n): st for s, n, st in out}
    assert set(by) == {(s.name, n) for s in (TINY, EVEN) for n in (impls.OURS, "mamba_ssm")}
    for s in (TINY, EVEN):
        assert by[(s.name, impls.OURS)].startswith("ok "), by
        if not impls.available("mamba_ssm"):
            assert by[(s.name, "mamba_ssm")] == "missing", by
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    assert runner.compile_in_processes([TINY], ["reference"], ("fwd",), jobs=2) == []


def _fake_tilegym(monkeypatch):
    """A stand-in for tilegym.ops.cutile.mamba2: two search spaces, one built on a base space
    looked up by name at call time, as TileGym's are."""
    import types
    module = types.ModuleType("tilegym.ops.cutile.mamba2")

    def _a_configs(n):
        yield from range(n)

    def _b_base_configs():
        yield from "pqrs"

    def _b_configs():
        for base in module._b_base_configs():
            yield from (base + "1", base + "2")

    module._a_configs, module._b_base_configs, module._b_configs = (
        _a_configs, _b_base_configs, _b_configs)
    module.not_a_space = 7
    module._a_tune_cache = {}
    for name in ("tilegym", "tilegym.ops", "tilegym.ops.cutile"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "tilegym.ops.cutile.mamba2", module)
    return module


def test_tilegym_search_slice(monkeypatch):
    """Slices of TileGym's search spaces: together every candidate once, each slice never
    empty, the base spaces uncut, the module as it was afterwards."""
    m = _fake_tilegym(monkeypatch)
    originals = (m._a_configs, m._b_configs, m._b_base_configs)
    got_a, got_b = [], []
    for k in range(3):
        with impls.tilegym_search_slice(k, 3) as cut:
            assert cut == ["_a_configs", "_b_configs"]
            got_a += list(m._a_configs(7))
            got_b += list(m._b_configs())
            assert list(m._b_base_configs()) == list("pqrs")
            assert list(m._a_configs(1)) == [0]                   # slice 1, 2 of one: kept
    assert sorted(got_a) == list(range(7))
    assert sorted(got_b) == sorted(b + i for b in "pqrs" for i in "12")
    assert (m._a_configs, m._b_configs, m._b_base_configs) == originals
    with pytest.raises(RuntimeError), impls.tilegym_search_slice(0, 2):
        raise RuntimeError("restored on the way out too")
    assert m._a_configs is originals[0]


def test_tilegym_search_slice_forgets_choices(monkeypatch):
    """A worker process handed a second slice of a shape searches it: TileGym's in-memory
    choices (its `*_tune_cache` dicts) are emptied on the way in and out, else its second
    call would reuse the first slice's choice and compile nothing."""
    m = _fake_tilegym(monkeypatch)
    searched = []

    def tuned_call(key):                  # TileGym's pattern: search once per key
        if key not in m._a_tune_cache:
            candidates = list(m._a_configs(4))
            searched.extend(candidates)
            m._a_tune_cache[key] = candidates[0]
        return m._a_tune_cache[key]

    for k in range(2):
        with impls.tilegym_search_slice(k, 2):
            tuned_call("shape")
    assert sorted(searched) == [0, 1, 2, 3]
    assert m._a_tune_cache == {}


def test_compile_cases_split_a_tuning_tilegym(monkeypatch):
    monkeypatch.setattr(impls, "tilegym_tuning", lambda: "tuned (exhaustive search)")
    monkeypatch.setattr(impls, "available", lambda name: False)        # not installed: one
    assert [p for _, _, p in runner.compile_cases([TINY], ["tilegym"], jobs=3)] == [None]
    monkeypatch.setattr(impls, "available", lambda name: True)
    cases = runner.compile_cases([TINY, EVEN], [impls.OURS, "tilegym", "reference"], jobs=3)
    assert [(s.name, n, p) for s, n, p in cases] == [
        (s.name, n, p) for s in (TINY, EVEN)
        for n, p in [(impls.OURS, None)] + [("tilegym", (k, 3)) for k in range(3)]]
    assert all(p is None for _, _, p in runner.compile_cases([TINY], ["tilegym"], jobs=1))
    monkeypatch.setattr(impls, "tilegym_tuning", lambda: "untuned (DISABLE_AUTOTUNE=1)")
    assert [p for _, _, p in runner.compile_cases([TINY], ["tilegym"], jobs=3)] == [None]


def test_compile_case_tilegym_slice_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "tilegym.ops.cutile.mamba2", None)     # import fails
    assert runner._compile_case(TINY, "tilegym", ("fwd",), "cpu", (0, 2)) == (
        TINY.name, "tilegym", "missing")


@pytest.fixture
def extra(monkeypatch):
    monkeypatch.setattr(impls, "EXTRA", {})
    return impls.EXTRA


def test_runner_flags_mismatch_and_errors(extra):
    def broken(inp, shape, mode, grads, stream):
        def run():
            out, final, _ = __import__("mamba2_cutile").reference.ssd_chunked(
                inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], shape.chunk,
                D=inp["D"], initial_states=inp["initial_states"])
            return {"out": out * 1.5, "final": final}
        return run

    def crashing(inp, shape, mode, grads, stream):
        def run():
            raise RuntimeError("CUDA error: an illegal\nmemory access")
        return run

    def na(inp, shape, mode, grads, stream):
        raise impls.Skip("n/a (test)")
    extra.update(broken=broken, crashing=crashing, na=na)
    rows = run_cpu([EVEN], [impls.OURS, "broken", "crashing", "na"])
    by = {r["impl"]: r for r in rows}
    assert by["broken"]["status"].startswith("MISMATCH (out")
    assert by["broken"]["diff_detail"]["final"] < 1e-5
    assert "graph" in by["broken"]                                  # flagged, still timed
    assert by["crashing"]["status"] == "error: RuntimeError: CUDA error: an illegal memory access"
    assert by["na"]["status"] == "n/a (test)"
    assert set(by[impls.OURS]["speedup_vs"]) == {"broken"}
    cols, data = report.table_data(rows)
    assert any("MISMATCH" in cells[2] for cells, _ in data)


def test_ours_without_backward_is_na(monkeypatch):
    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise NotImplementedError("no backward through CUDA tensors yet")

    real = impls._ours_forward

    def fake(chunk):
        f = real(chunk)
        return lambda inp: tuple(NoBackward.apply(t) for t in f(inp))
    monkeypatch.setattr(impls, "_ours_forward", fake)
    for mode in ("bwd", "fwdbwd"):
        rows = run_cpu([TINY], [impls.OURS, "reference"], mode)
        assert rows[0]["status"] == impls.NO_BACKWARD == "n/a (no backward yet)"
        assert rows[1]["status"] == "ok" and "checked_against" not in rows[1]
        assert "speedup_vs" not in rows[0]


def test_compare_tolerances():
    a = torch.ones(10)
    assert runner.compare({"out": a}, {"out": a}, torch.bfloat16, "fwd")[2] == "ok"
    worst, detail, status = runner.compare({"out": a * 1.03}, {"out": a}, torch.bfloat16, "fwd")
    assert status == "MISMATCH (out 3.0e-02)" and worst == pytest.approx(0.03)
    # gradients get a looser tolerance than outputs
    assert runner.compare({"dx": a * 1.03}, {"dx": a}, torch.bfloat16, "bwd")[2] == "ok"
    assert runner.compare({"out": a * float("nan")}, {"out": a}, torch.float32,
                          "fwd")[2].startswith("MISMATCH")
    assert runner.compare({"out": a[:5]}, {"out": a}, torch.float32, "fwd")[2].startswith(
        "MISMATCH")
    assert runner.compare({"dz": a}, {"dx": a}, torch.float32, "bwd") == (None, {}, "ok")


# --------------------------------------------------------------------------- report writers

def synthetic_rows():
    rows = []
    for t in (1024, 4096, 16384):
        s = problems.Shape(f"s-T{t}", 4, t, 8, 1, 64, 128, 128)
        case = []
        for impl, factor in ((impls.OURS, 1.0), ("mamba_ssm", 1.2), ("tilegym", 3.0),
                             ("reference", None)):
            r = runner.base_row(s, impl, "fwd")
            if factor is None:
                r["status"] = "skipped (> 2^20 token-heads)"
            else:
                ms = t / 40000 * factor
                r.update(status="ok", first_call_s=1.5, peak_mem_mib=64.0,
                         graph={"median_ms": ms, "min_ms": ms * 0.99, "max_ms": ms * 1.01,
                                "n": 50},
                         eager={"median_ms": ms * 1.5, "min_ms": ms, "max_ms": 2 * ms, "n": 25},
                         pct_of_floor=100 * r["floor_ms"] / ms)
                if impl != impls.OURS:
                    r.update(checked_against=impls.OURS, max_diff_vs_first=3e-3,
                             diff_detail={"out": 3e-3, "final": float("nan")})
            case.append(r)
        rows += runner.add_speedups(case)
    rows[-3]["status"] = "MISMATCH (out 5.0e-01)"
    return rows


META = {"mode": "fwd", "versions": {"gpu": "NVIDIA H200", "torch": "x"},
        "roofline": roofline.CONSTANTS, "tilegym": "untuned (DISABLE_AUTOTUNE=1)"}


def test_write_json(tmp_path):
    rows = synthetic_rows()
    path = report.write_json(tmp_path / "sub" / "b.json", rows, META,
                             breakdown=[{"shape": "s", "kernels": {"a": 0.1}}])
    doc = json.loads(open(path).read())            # strict JSON: NaN became null
    assert doc["meta"]["mode"] == "fwd" and doc["versions"]["gpu"] == "NVIDIA H200"
    assert len(doc["rows"]) == 12 and doc["breakdown"][0]["kernels"] == {"a": 0.1}
    assert doc["rows"][1]["diff_detail"]["final"] is None
    ours = doc["rows"][0]
    assert ours["speedup_vs"]["mamba_ssm"] == pytest.approx(1.2)
    assert ours["graph"]["median_ms"] == pytest.approx(1024 / 40000)


def test_write_csv(tmp_path):
    rows = synthetic_rows()
    path = report.write_csv(tmp_path / "b.csv", rows)
    with open(path) as f:
        got = list(csv.DictReader(f))
    assert len(got) == 12
    head = list(got[0])
    assert head[:4] == ["shape", "mode", "impl", "status"]
    for col in ("graph_median_ms", "graph_min_ms", "graph_max_ms", "eager_median_ms",
                "first_call_s", "peak_mem_mib", "floor_ms", "pct_of_floor", "seqlen",
                "speedup_vs_mamba_ssm", "speedup_vs_tilegym", "ours_speedup"):
        assert col in head, col
    assert got[0]["seqlen"] == "1024" and float(got[0]["speedup_vs_tilegym"]) == \
        pytest.approx(3.0)
    assert got[3]["status"].startswith("skipped") and got[3]["graph_median_ms"] == ""


def test_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = synthetic_rows()
    path = report.write_png(tmp_path / "b.png", rows, META)
    assert path and os.path.getsize(path) > 10_000
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert report.write_png(tmp_path / "none.png", [rows[3]], META) is None   # nothing timed


def test_write_png_per_shape_bars(tmp_path, monkeypatch):
    """Rows whose shapes mostly have one sequence length each (the `models` set) get per-shape
    bars: one bar per shape and implementation in the time panel, one per shape and baseline
    in the speedup panel, of the baseline's time over ours."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    rows = []
    for i, (ours, theirs) in enumerate([(0.2, 0.4), (0.3, 0.45), (0.05, 0.04)]):
        for impl, ms in ((impls.OURS, ours), ("mamba_ssm", theirs)):
            rows.append({"shape": f"s{i}", "dims": [2, 1024 * (i + 1), 8, 1, 64, 128, 128],
                         "impl": impl, "series": f"series {i}", "floor_ms": 0.01,
                         "graph": {"median_ms": ms}})
    bars = []
    real = matplotlib.axes.Axes.barh
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", lambda ax, y, w, **kw: (
        bars.append((ax.get_title(), list(w))), real(ax, y, w, **kw))[1])
    path = report.write_png(tmp_path / "m.png", rows, META)
    assert path and os.path.getsize(path) > 10_000
    assert bars[0][1] == [0.2, 0.3, 0.05] and bars[1][1] == [0.4, 0.45, 0.04]
    assert bars[2][1] == pytest.approx([2.0, 1.5, 0.8])


def test_write_all_and_png_optional(tmp_path, monkeypatch):
    paths = report.write_all(tmp_path / "out", synthetic_rows(), META)
    assert os.path.exists(paths["json"]) and os.path.exists(paths["csv"])
    assert paths["json"].endswith("bench-fwd.json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)             # as if not installed
    assert report.write_png(tmp_path / "x.png", synthetic_rows(), META) is None


def test_tables():
    rows = synthetic_rows()
    cols, data = report.table_data(rows)
    assert cols[-3:] == ["x vs mamba_ssm", "x vs TileGym", "x vs PyTorch ref"]
    assert data[0][0][-3:] == ["1.20x", "3.00x", ""]
    from rich.console import Console
    console = Console(record=True, width=250)
    report.render_table(rows, META, console)
    out = console.export_text()
    assert "MISMATCH" in out and "mamba2-cutile" in out and "790 TFLOP/s" in out
    assert "3.00x" in out and "4.3 TB/s" in out and "untuned (DISABLE_AUTOTUNE=1)" in out


def test_progress(capsys):
    from rich.console import Console
    console = Console(record=True, width=120, force_terminal=False)
    with report.Progress(2, "bench", console) as bar:
        bar.step("a")
        bar.step("b")
    assert "bench" in console.export_text()
    with report.Progress(2, "x", enabled=False) as bar:
        bar.step("quiet")
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- verify

def test_verify_case_matrix():
    names = [c.name for c in verify.CASES]
    assert len(names) == len(set(names))
    opts_alone = {c.opts[0] for c in verify.CASES if c.name.startswith("opt-") and c.opts}
    assert opts_alone >= {"D_head", "D_chan", "z", "dt_bias", "dt_limit", "init", "seq_idx"}
    assert {c.dtype for c in verify.CASES if set(verify.ALL) <= set(c.opts)} == \
        {torch.bfloat16, torch.float16, torch.float32}
    assert any(c.seqlen % c.chunk for c in verify.CASES)
    assert any(c.seqlen == 1 for c in verify.CASES)
    assert any(c.headdim & (c.headdim - 1) for c in verify.CASES)
    assert any(c.dstate & (c.dstate - 1) for c in verify.CASES)
    assert {c.chunk for c in verify.CASES} == {64, 128, 256}
    assert any("varlen" in c.opts for c in verify.CASES)
    from mamba2_cutile.bench.accuracy import FORWARD_TOL
    assert verify.TOL is FORWARD_TOL        # one home for the forward's tolerances
    assert [c.name for c in verify.select("^all-")] == ["all-bf16", "all-fp16", "all-fp32"]


def test_verify_runs_on_cpu():
    cases = verify.select("^(all-fp32|partial-T17-Q256|varlen-states)$")
    assert len(cases) == 3
    results = verify.run(cases, "cpu")
    assert all(r["passed"] for r in results), results
    assert set(results[2]["errors"]) == {"out", "final", "varlen"}
    assert verify.exit_code(results) == 0
    lines = verify.format_results(results)
    assert lines[-1] == "3/3 passed" and lines[0].startswith("PASS")


def test_verify_reports_failures(monkeypatch):
    monkeypatch.setitem(verify.TOL, torch.float32, 1e-12)
    res = verify.run(verify.select("^all-fp32$"), "cpu")
    assert not res[0]["passed"] and verify.exit_code(res) == 1
    assert "1 FAILED" in verify.format_results(res)[-1]
    bad = verify.Case("bad", 2, 10, 3, 2, 8, 8, 64)          # 3 heads, 2 groups: invalid
    r = verify.run_case(bad, "cpu")
    assert not r["passed"] and r["error"].startswith("ValueError")
    assert verify.exit_code([]) == 1


# --------------------------------------------------------------------------- command line

def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.abspath(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_cli_bench_help_subprocess():
    p = subprocess.run([sys.executable, "-m", "mamba2_cutile", "bench", "--help"],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    for flag in ("--mode", "--shapes", "--impls", "--out", "--breakdown", "--reps", "--list"):
        assert flag in p.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cli_bench_without_cuda(capsys):
    rc = cli.main(["bench"])
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "no CUDA GPU" in err
    for cmd in (["verify"], ["tune"], ["bench", "--mode", "bwd", "--shapes", "sweep"]):
        assert cli.main(cmd) != 0
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "no CUDA GPU" in err


def test_cli_parsing():
    p = cli.build_parser()
    a = p.parse_args(["bench", "--mode", "fwdbwd", "--shapes", "sweep,models", "--seqlen",
                      "4K", "--out", "d", "--custom", "1,2,3,1,4,5,64", "--custom",
                      "2,2,2,1,4,4,64,fp32"])
    assert (a.mode, a.shapes, a.out, a.seqlen) == ("fwdbwd", "sweep,models", "d", "4K")
    assert a.custom == ["1,2,3,1,4,5,64", "2,2,2,1,4,4,64,fp32"]
    assert a.impls == "mamba2-cutile,mamba_ssm,tilegym,reference" and a.reps == 50
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--mode", "sideways"])
    t = p.parse_args(["tune", "--space", "state_block_n=16,32", "--dry-run"])
    assert t.space == "state_block_n=16,32" and t.dry_run and t.shapes == "seed"
    assert p.parse_args([]).cmd is None                 # the demo


def test_cli_list_and_errors(capsys):
    assert cli.main(["bench", "--list", "--shapes", "models", "--match", "^7b"]) == 0
    out = capsys.readouterr().out
    assert "selected (2):" in out and "7b-class-T8K" in out and "G=8" in out
    assert cli.main(["bench", "--list", "--shapes", "models", "--match", "^7b-class-T8K",
                     "--chunk", "64"]) == 0
    assert "7b-class-T8K-Q64" in capsys.readouterr().out
    assert cli.main(["tune", "--list", "--shapes", "seed"]) == 0
    assert "selected (1):" in capsys.readouterr().out
    assert cli.main(["bench", "--shapes", "nope"]) == 2
    assert "unknown shape set" in capsys.readouterr().err
    assert cli.main(["bench", "--shapes", "seed", "--seqlen", "3"]) == 2
    assert cli.main(["verify", "--list", "--match", "varlen"]) == 0
    assert "varlen-states-init" in capsys.readouterr().out


def test_cli_verify_cpu(capsys, tmp_path):
    rc = cli.main(["verify", "--cpu", "--match", "^opt-(none|z)$", "--json",
                   str(tmp_path / "v.json")])
    assert rc == 0
    assert "2/2 passed" in capsys.readouterr().out
    doc = json.loads((tmp_path / "v.json").read_text())
    assert [r["case"] for r in doc["results"]] == ["opt-none", "opt-z"]


def test_cli_tune_show(capsys, tmp_path, monkeypatch):
    from mamba2_cutile import tuning
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    tuning.reload()
    try:
        tuning.store("forward|x", {"state_block_n": 32}, {"default_ms": 0.4})
        assert cli.main(["tune", "--show"]) == 0
        out = capsys.readouterr().out
        assert str(tmp_path) in out and "forward|x" in out and "'state_block_n': 32" in out
        assert cli.main(["tune", "--space", "state_block_n="]) == 2
    finally:
        tuning.reload()


def test_floor_matches_runner_rows():
    for mode in ("fwd", "bwd", "fwdbwd"):
        ms, by, fl, bound = runner.case_floor(problems.SEED, mode)
        assert ms == pytest.approx(roofline.floor_ms(by, fl)) and math.isfinite(ms)
        r = runner.base_row(problems.SEED, impls.OURS, mode)
        assert r["floor_bytes"] == by and r["floor_bound"] == bound


def test_backward_breakdown_with_fakes(monkeypatch):
    """runner.backward_breakdown's control flow on the CPU: the cuTile backward's real plan
    (CPU tensors), each launch 'timed' by a fake."""
    pytest.importorskip("cuda.tile")
    import cuda.tile as ct

    from mamba2_cutile import runtime
    from mamba2_cutile.bench import problems, runner, timing

    real_inputs, real_grads = problems.make_inputs, problems.make_grad_outputs
    monkeypatch.setattr(problems, "make_inputs", lambda s, device="cuda", seed=0:
                        real_inputs(s, device="cpu"))
    monkeypatch.setattr(problems, "make_grad_outputs", lambda s, device="cuda", seed=1:
                        real_grads(s, device="cpu"))
    monkeypatch.setattr(runtime, "num_sms", lambda i: 132)
    class FakeStream:             # the plan's side stream (side_streams=2 at 4 heads) too
        def wait_stream(self, other):
            pass
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(runtime, "_side_stream", lambda device, k: FakeStream())
    launched = []
    monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, args: launched.append(kernel))
    monkeypatch.setattr(timing, "time_graph", lambda fn, reps=30: (fn(), {"median_ms": 0.1})[1])
    row = runner.backward_breakdown(problems.parse_custom("1,256,4,1,32,64,64"))
    names = list(row["kernels"])
    assert names[0] == "decay_cumsum" and {"chunk_state_pass", "bwd_state_pass"} <= set(names)
    assert len(names) == len(launched) // 2 and abs(row["total_ms"] - 0.1 * len(names)) < 1e-9


def test_reps_within_budget():
    from mamba2_cutile.bench.timing import _reps_within
    assert _reps_within(None, 60.0, 50) == 50
    assert _reps_within(1000.0, 0.3, 50) == 50          # fast calls: all reps
    assert _reps_within(1000.0, 40.0, 50) == 25         # slow: what fits in the budget
    assert _reps_within(1000.0, 500.0, 50) == 10        # never under 10
    assert _reps_within(1000.0, 500.0, 5) == 5          # nor over what was asked


def test_cli_bench_train_mode_on_cpu(monkeypatch, tmp_path, capsys):
    """`--mode train` runs bwd and fwdbwd per shape in one process and writes one table and one
    set of files per mode (the CUDA run replaced by the CPU runner)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(impls, "versions", lambda: {"gpu": "cpu stand-in"})
    real = runner.run_case
    monkeypatch.setattr(runner, "run_case", lambda shape, names, mode, timer, on_impl=None: real(
        TINY, names, mode, runner.WallTimer(reps=2), device="cpu", on_impl=on_impl))
    rc = cli.main(["bench", "--mode", "train", "--shapes", "seed", "--impls",
                   "mamba2-cutile,reference", "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "benchmark (bwd)" in out and "benchmark (fwdbwd)" in out
    for mode in ("bwd", "fwdbwd"):
        doc = json.loads((tmp_path / f"bench-{mode}.json").read_text())
        assert {r["mode"] for r in doc["rows"]} == {mode}
        assert [r["status"] for r in doc["rows"]] == ["ok", "ok"]


def test_cpu_compile_signature_refuses_what_launch_refuses():
    """`bench.compile.signature_of` checks each 32-bit-indexed array argument against the
    int32 range as ct.launch does (its "stride is too big"), so a CPU compile test of a 64-bit
    plan catches a large tensor passed where the kernel has no ct.IndexedWithInt64 (an unread
    stand-in included), and passes the same tensor where it has."""
    pytest.importorskip("cuda.tile")
    from mamba2_cutile.bench.compile import check_int32_range, signature_of
    from mamba2_cutile.kernels.causal_conv1d_fwd_stream import (causal_conv1d_fwd_stream,
                                                                 causal_conv1d_fwd_stream_i64)
    big = torch.empty(1, 2**21 + 3, 1600, dtype=torch.bfloat16, device="meta")[..., :1536]
    small = torch.empty(1, 8, 1536, dtype=torch.bfloat16, device="meta")
    check_int32_range("k", "small", small)
    with pytest.raises(ValueError, match="'x'.*stride 3355448000 in dimension 0"):
        check_int32_range("k", "x", big)
    with pytest.raises(ValueError, match="size 2147483648"):
        check_int32_range("k", "t", torch.empty(2**31, dtype=torch.int8, device="meta"))
    from mamba2_cutile.conv1d import plan
    wt = torch.empty(4, 1536, dtype=torch.float32, device="meta")
    cfg = plan.Conv1dConfig(form=1, block_d=64)

    def call(final):
        return plan.forward_plan(big.transpose(1, 2), wt, None, None, None,
                                 plan.empty_like_layout(big.transpose(1, 2), True), final,
                                 True, cfg)[0]
    c = call(None)
    assert c.kernel is causal_conv1d_fwd_stream_i64
    signature_of(c.kernel, c.args)                        # x and out are 64-bit parameters
    args = list(c.args)
    args[0] = big
    with pytest.raises(ValueError, match="ct.launch would refuse"):
        signature_of(causal_conv1d_fwd_stream, args)      # the 32-bit variant: x refused


@pytest.mark.parametrize("argv, match", [
    (["bench", "--mode", "layer", "--json", "x.json"], "--mode layer runs its own"),
    (["bench", "--mode", "model", "--shapes", "seed"], "not --shapes"),
    (["bench", "--mode", "decode", "--list"], "not --list"),
    (["bench", "--list", "--match", "("], "--match '\\(' is not a regular expression"),
    (["verify", "--list", "--match", "("], "not a regular expression"),
    (["bench", "--list", "--custom", "1,128,2,1,16,16,100"], "chunk must be 64, 128 or 256"),
    (["bench", "--list", "--custom", "1,128,2,3,16,16,64"], "G dividing H"),
    (["resources", "forward", '{"nosuch": 3}'], "unknown forward problem key"),
    (["resources", "backward", "[1, 2]"], "must be a JSON object"),
    (["resources", "decode", '{"nheads": "x"}'], "positive integer"),
])
def test_cli_refuses_bad_arguments_by_name(argv, match, capsys):
    """Arguments the command cannot take end in one line naming them (exit 2), no traceback."""
    assert cli.main(argv) == 2
    assert re.search(match, capsys.readouterr().err)
