"""GPU: the cuTile forward against the float64 recurrence, and against mamba_ssm's error.

Tolerance (support.tolerances.forward_tol, by input dtype): max|out - ref| / max|ref| <= 2e-2
for bf16 inputs, <= 2e-3 for fp16 and fp32 inputs; final and varlen states use the same bound.
The float64-reference checks never depend on mamba_ssm. The test_against_mamba_ssm_* tests
assert ours is never above 1.5x mamba_ssm's own error on the same inputs (plus tol / 10); they
skip, with the reason, when mamba_ssm is not importable, MAMBA2_TEST_COMPARE_MAMBA=0, or
mamba_ssm refuses an option combination. They share one xdist group ("mamba-fwd", see
tests/conftest.py) so mamba_ssm's Triton autotune is paid once per process; run the suite as
described at the top of tests/ssd/test_backward_gpu.py.
"""


import pytest
import torch

from mamba2_cutile import mamba_chunk_scan_combined, reference
from mamba2_cutile.bench.problems import default_seq_cuts, random_problem
from support.gpu import SHAPES, log_result, mamba_refused, rel_err, require_mamba_ssm_scan
from support.tolerances import (MAMBA_FACTOR, SAME_MATH_TOL, VARLEN_EDGES_TOL,
                                comparison_floor, forward_tol)

pytestmark = pytest.mark.gpu



def make_problem(b, l, h, g, p, n, dtype, opts, seed=0):
    """Realistic random inputs (bench.problems.random_problem) with the options in `opts`."""
    return random_problem(b, l, h, g, p, n, dtype, D=opts.get("D"), z=bool(opts.get("z")),
                          dt_bias=bool(opts.get("dt_bias")), dt_limit=opts.get("dt_limit"),
                          init=bool(opts.get("init")),
                          seq_cuts=default_seq_cuts(l) if opts.get("seq_idx") else None,
                          seed=seed)


def check(inp, kw, chunk_size, dtype, state_dtype=None):
    """Ours against the float64 recurrence (out and final state, forward_tol(dtype))."""
    y_ref, h_ref, _ = reference.ssd_recurrence(**inp, **kw)
    y, h = mamba_chunk_scan_combined(**inp, chunk_size=chunk_size, return_final_states=True,
                                     state_dtype=state_dtype, **kw)
    assert y.dtype == inp["x"].dtype and y.shape == inp["x"].shape
    assert h.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    e_y, e_h = rel_err(y, y_ref), rel_err(h, h_ref)
    tol = forward_tol(dtype)
    msg = f"out err {e_y:.2e}, final-state err {e_h:.2e}, tol {tol:.0e}"
    print(msg)
    log_result(msg)
    assert e_y <= tol, msg
    assert e_h <= tol, msg
    return y, h


def compare_with_mamba(inp, kw, chunk_size, dtype):
    """Ours and mamba_ssm's errors against the float64 recurrence on the same inputs: ours may
    be at most 1.5x mamba_ssm's, plus tol / 10 (skips when mamba_ssm is absent, switched off
    or refuses these inputs)."""
    f = require_mamba_ssm_scan()
    y_ref, h_ref, _ = reference.ssd_recurrence(**inp, **kw)
    y, h = mamba_chunk_scan_combined(**inp, chunk_size=chunk_size, return_final_states=True,
                                     **kw)
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    try:
        ym, hm = f(**inp, chunk_size=chunk_size, return_final_states=True, **kw)
    except Exception as e:  # noqa: BLE001 - an option combination mamba_ssm does not take
        mamba_refused(e)
    e_y, e_h = rel_err(y, y_ref), rel_err(h, h_ref)
    m_y, m_h = rel_err(ym, y_ref), rel_err(hm, h_ref)
    floor = comparison_floor(forward_tol(dtype))
    msg = (f"out err {e_y:.2e}, final-state err {e_h:.2e}; mamba_ssm out err {m_y:.2e}, "
           f"final-state err {m_h:.2e}; floor {floor:.0e}")
    print(msg)
    log_result(msg)
    assert e_y <= MAMBA_FACTOR * m_y + floor, msg
    assert e_h <= MAMBA_FACTOR * m_h + floor, msg


OPTS = {
    "none": {},
    "D_head": {"D": "h"},
    "D_chan": {"D": "hp"},
    "z": {"z": True},
    "bias_softplus": {"dt_bias": True},
    "dt_limit": {"dt_limit": (0.004, 0.05)},
    "init": {"init": True},
    "seq_idx": {"seq_idx": True},
    "all": {"D": "hp", "z": True, "dt_bias": True, "dt_limit": (0.002, 0.08), "init": True,
            "seq_idx": True},
}


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_options(opt, dtype):
    inp, kw = make_problem(2, 300, 4, 2, 64, 64, dtype, OPTS[opt])
    check(inp, kw, 128, dtype)


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_against_mamba_ssm_forward(opt, dtype):
    """test_options' problems: ours vs mamba_ssm's error (fp32 is where they differ)."""
    inp, kw = make_problem(2, 300, 4, 2, 64, 64, dtype, OPTS[opt])
    compare_with_mamba(inp, kw, 128, dtype)


def test_against_mamba_ssm_forward_chunk256():
    """More heads, chunk 256, every option."""
    inp, kw = make_problem(2, 700, 16, 2, 64, 128, torch.bfloat16, OPTS["all"], seed=4)
    compare_with_mamba(inp, kw, 256, torch.bfloat16)


@pytest.mark.parametrize("p", [64, 128], ids=["P64", "P128"])
@pytest.mark.parametrize("opt", ["none", "all"])
def test_chunk256_computed_at_128(opt, p):
    """A long chunk-256 call at headdim 64 or 128 (B=1 T=8229 H=24; 128: two p-tiles): the
    shape rule computes it at chunk 128 with chunk_scan_group. Against the float64 recurrence
    (forward_tol); varlen states of four packed sequences (one of a single token) against the
    recurrence's; last, within 1.5x of mamba_ssm's error at chunk 256 (a skip without
    mamba_ssm)."""
    from mamba2_cutile.ssd import forward
    b, l, h, g, n = 1, 8229, 24, 1, 128
    cfg = forward.forward_config(b, h, p, n, 256, torch.bfloat16, 132, seqlen=l,
                                 device_index=0, ngroups=g, has_seq=opt == "all")
    assert (cfg.chunk_size, cfg.scan_heads) == (128, 16), cfg
    inp, kw = make_problem(b, l, h, g, p, n, torch.bfloat16, OPTS[opt], seed=11)
    check(inp, kw, 256, torch.bfloat16)
    seq = kw.get("seq_idx")
    lens = torch.tensor([3000, 1, 2500, l - 5501])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32).cuda()
    kw["seq_idx"] = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), lens)[None].cuda()
    _, _, v_ref = reference.ssd_recurrence(**inp, cu_seqlens=cu, **kw)
    _, v = mamba_chunk_scan_combined(**inp, chunk_size=256, cu_seqlens=cu,
                                     return_varlen_states=True, **kw)
    e_v, tol = rel_err(v, v_ref), forward_tol(torch.bfloat16)
    log_result(f"varlen err {e_v:.2e}, tol {tol:.0e}")
    assert e_v <= tol, f"varlen err {e_v:.2e} > {tol:.0e}"
    # last: it skips where mamba_ssm is absent
    kw.pop("seq_idx")
    compare_with_mamba(inp, kw if seq is None else dict(kw, seq_idx=seq), 256, torch.bfloat16)


@pytest.mark.parametrize("chunk_size", [64, 128, 256])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(shape, chunk_size):
    inp, kw = make_problem(*shape, torch.bfloat16, OPTS["all"], seed=1)
    check(inp, kw, chunk_size, torch.bfloat16)


@pytest.mark.parametrize("l", [1, 17, 64, 65, 255])
def test_short_and_partial(l):
    inp, kw = make_problem(2, l, 4, 1, 32, 64, torch.bfloat16, {"D": "h", "init": True})
    check(inp, kw, 256, torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
def test_default_limit_clamps_negative_dt(bias):
    """The default dt_limit (0, inf) clamps as mamba_ssm's Triton scan: with about a third of
    dt + dt_bias negative (no softplus) the kernels match the float64 recurrence, which
    counts those tokens' dt' as 0."""
    inp, kw = make_problem(2, 300, 8, 2, 64, 64, torch.bfloat16, {"D": "h", "init": True},
                           seed=9)
    inp["dt"] = inp["dt"] - inp["dt"].float().quantile(0.33)
    if bias:
        kw["dt_bias"] = torch.linspace(-0.01, 0.01, 8, device=inp["dt"].device)
    assert (inp["dt"] < 0).float().mean() > 0.25
    check(inp, kw, 64, torch.bfloat16)


def test_state_dtype_fp32():
    inp, kw = make_problem(2, 700, 4, 1, 64, 128, torch.bfloat16, OPTS["all"])
    check(inp, kw, 256, torch.bfloat16, state_dtype=torch.float32)


def test_empty():
    inp, kw = make_problem(2, 0, 4, 1, 32, 64, torch.bfloat16, {"init": True})
    y, h = mamba_chunk_scan_combined(**inp, chunk_size=128, return_final_states=True, **kw)
    assert y.shape == (2, 0, 4, 32)
    torch.testing.assert_close(h, kw["initial_states"])


def test_strided_views_of_one_projection():
    """x, B, C, z, dt as slices of one in_proj output, as in a Mamba-2 block."""
    b, l, h, g, p, n = 2, 300, 4, 1, 64, 64
    dev = "cuda"
    d_inner = h * p
    width = 2 * d_inner + 2 * g * n + h
    gen = torch.Generator(device=dev).manual_seed(7)
    proj = torch.randn(b, l, width, device=dev, generator=gen).to(torch.bfloat16)
    z, x, Bf, Cf, dt = torch.split(proj, [d_inner, d_inner, g * n, g * n, h], dim=-1)
    x, z = x.view(b, l, h, p), z.view(b, l, h, p)
    Bm, Cm = Bf.view(b, l, g, n), Cf.view(b, l, g, n)
    dt = dt.float() * 0.5 - 4.0
    A = -torch.rand(h, device=dev, generator=gen) * 4 - 1
    inp = dict(x=x, dt=dt, A=A, B=Bm, C=Cm)
    kw = dict(z=z, D=torch.randn(h, device=dev, generator=gen),
              dt_bias=torch.randn(h, device=dev, generator=gen) * 0.1, dt_softplus=True)
    assert not x.is_contiguous()
    y_strided, _ = check(inp, kw, 128, torch.bfloat16)
    contig = {k: v.contiguous() for k, v in inp.items()}
    y_contig = mamba_chunk_scan_combined(**contig, chunk_size=128, **kw)
    torch.testing.assert_close(y_strided, y_contig, rtol=0, atol=0)


def _varlen_problem(dtype, with_init):
    lens = [100, 28, 1, 300, 128, 67]
    l = sum(lens)
    inp, kw = make_problem(1, l, 4, 2, 48, 80, dtype, {"D": "h", "z": True, "init": with_init})
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    seq = torch.repeat_interleave(torch.arange(len(lens), device="cuda", dtype=torch.int32),
                                  torch.tensor(lens, device="cuda"))[None]
    kw["seq_idx"] = seq
    return inp, kw, cu


@pytest.mark.parametrize("with_init", [False, True])
def test_varlen_states(with_init):
    inp, kw, cu = _varlen_problem(torch.bfloat16, with_init)
    y_ref, h_ref, v_ref = reference.ssd_recurrence(**inp, cu_seqlens=cu, **kw)
    y, h, v = mamba_chunk_scan_combined(**inp, chunk_size=128, cu_seqlens=cu,
                                        return_final_states=True, return_varlen_states=True,
                                        **kw)
    assert v.shape == (6, 4, 48, 80) and v.dtype == torch.bfloat16
    assert h.shape == (1, 4, 48, 80) and h.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(h).all() and torch.isfinite(v).all()
    e_v, e_y, e_h = rel_err(v, v_ref), rel_err(y, y_ref), rel_err(h, h_ref)
    tol = forward_tol(torch.bfloat16)
    msg = f"varlen err {e_v:.2e}, out err {e_y:.2e}, final-state err {e_h:.2e}, tol {tol:.0e}"
    print(msg)
    log_result(msg)
    assert e_v <= tol and e_y <= tol and e_h <= tol, msg


def test_against_mamba_ssm_varlen_states():
    """test_varlen_states' problem without initial states (mamba_ssm drops the initial state
    from varlen_states): ours vs mamba_ssm's varlen-state error."""
    f = require_mamba_ssm_scan()
    inp, kw, cu = _varlen_problem(torch.bfloat16, False)
    _, _, v_ref = reference.ssd_recurrence(**inp, cu_seqlens=cu, **kw)
    _, v = mamba_chunk_scan_combined(**inp, chunk_size=128, cu_seqlens=cu,
                                     return_varlen_states=True, **kw)
    try:
        _, vm = f(**inp, chunk_size=128, cu_seqlens=cu, return_varlen_states=True, **kw)
    except Exception as e:  # noqa: BLE001
        mamba_refused(e)
    e_v, m_v = rel_err(v, v_ref), rel_err(vm, v_ref)
    floor = comparison_floor(forward_tol(torch.bfloat16))
    msg = f"varlen err {e_v:.2e}; mamba_ssm varlen err {m_v:.2e}; floor {floor:.0e}"
    print(msg)
    log_result(msg)
    assert e_v <= MAMBA_FACTOR * m_v + floor, msg


def test_cuda_graph_capture():
    inp, kw = make_problem(2, 500, 4, 1, 64, 128, torch.bfloat16, OPTS["all"])
    eager = mamba_chunk_scan_combined(**inp, chunk_size=128, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            mamba_chunk_scan_combined(**inp, chunk_size=128, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mamba_chunk_scan_combined(**inp, chunk_size=128, **kw)
    inp["x"].mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    again = mamba_chunk_scan_combined(**inp, chunk_size=128, **kw)
    torch.testing.assert_close(captured, again, rtol=0, atol=0)
    assert not torch.equal(captured, eager)


def test_deterministic():
    inp, kw = make_problem(2, 700, 8, 2, 64, 128, torch.bfloat16, OPTS["all"])
    a = mamba_chunk_scan_combined(**inp, chunk_size=256, return_final_states=True, **kw)
    b = mamba_chunk_scan_combined(**inp, chunk_size=256, return_final_states=True, **kw)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_int64_indexing():
    """x with 3 * 2**30 elements: batch 2 starts past 2**31 and must match a run on its own."""
    b, l, h, g, p, n = 3, 2**20, 16, 1, 64, 128
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, l, h, p, device="cuda", dtype=torch.bfloat16, generator=gen)
    dt = torch.full((b, l, h), 0.02, device="cuda")
    A = -torch.linspace(1, 8, h, device="cuda")
    Bm = torch.randn(b, l, g, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    Cm = torch.randn(b, l, g, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    y, hf = mamba_chunk_scan_combined(x, dt, A, Bm, Cm, 256, return_final_states=True)
    y2, hf2 = mamba_chunk_scan_combined(x[2:], dt[2:], A, Bm[2:], Cm[2:], 256,
                                        return_final_states=True)
    # same math, 64- vs 32-bit addressing: a wrapped offset would read another batch entirely
    # (equal bits: SAME_MATH_TOL)
    e_y, e_h = rel_err(y[2], y2[0]), rel_err(hf[2], hf2[0])
    tol = min(SAME_MATH_TOL, forward_tol(torch.bfloat16))
    msg = f"batch 2 vs alone: out err {e_y:.2e}, final-state err {e_h:.2e}, tol {tol:.0e}"
    print(msg)
    log_result(msg)
    assert e_y <= tol and e_h <= tol, msg


def test_device_mismatch_error():
    inp, kw = make_problem(1, 64, 2, 1, 16, 16, torch.bfloat16, {})
    inp["A"] = inp["A"].cpu()
    with pytest.raises(ValueError, match="A is on cpu"):
        mamba_chunk_scan_combined(**inp, chunk_size=64)


def test_check_env_reads_values(monkeypatch):
    inp, kw = make_problem(1, 64, 2, 1, 16, 16, torch.bfloat16, {})
    seq = torch.zeros(1, 64, dtype=torch.int32, device="cuda")
    seq[0, :10] = 3
    monkeypatch.setenv("MAMBA2_CUTILE_CHECK", "1")
    with pytest.raises(ValueError, match="seq_idx must be non-decreasing"):
        mamba_chunk_scan_combined(**inp, chunk_size=64, seq_idx=seq)


TUNING_OPTIONS = [
    {"scan_lowp": 1}, {"scan_head_major": 1}, {"scan_persistent": 2}, {"scan_persistent": 1},
    {"state_block_n": 16}, {"state_block_n": 64, "state_block_p": 32}, {"scan_block_q": 64},
    {"scan_load_latency": 4}, {"state_occupancy": 2}, {"scan_lowp": 1, "scan_head_major": 1},
    {"scan_warps": 8}, {"state_scale_x": 1}, {"scan_block_q": 64, "scan_occupancy": 2},
    {"scan_block_n": 32}, {"scan_block_n": 64, "scan_block_q": 64},
    {"scan_lowp": 0}, {"state_scale_x": 0}, {"state_fresh_acc": 0}, {"scan_occupancy": 2},
    {"scan_block_p": 32, "scan_occupancy": 2},
    {"state_segments": 2}, {"state_segments": 3, "state_occupancy": 4},
    {"state_segments": 8, "state_occupancy": 2, "state_block_n": 64},
    {"state_load_latency": 0},
    {"scan_cb": 1}, {"scan_cb": 1, "scan_block_q": 64, "scan_occupancy": 2},
    {"scan_causal": 0}, {"scan_cb": 1, "scan_causal": 0},     # the plain forward (4 the rule's)
    {"scan_causal": 5}, {"scan_causal": 5, "scan_block_q": 64, "scan_block_p": 32},
    {"state_segments": 3, "state_occupancy": 4, "segment_fold": 1},
    {"state_segments": 2, "segment_fold": 1, "scan_causal": 4, "scan_cb": 1},
    {"state_segments": 3, "state_resweep": 1},
    {"state_segments": 2, "state_resweep": 1, "state_block_n": 128, "state_occupancy": 2},
]


@pytest.mark.parametrize("overrides", TUNING_OPTIONS, ids=lambda o: ",".join(
    f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_config_variants(overrides, dtype):
    """Every config option a tuner may pick gives a correct answer (all options on)."""
    from dataclasses import replace

    from mamba2_cutile.ssd import forward
    from mamba2_cutile.ssd.forward import ssd_forward_cuda

    b, l, h, g, p, n, Q = 2, 700, 4, 2, 64, 128, 256
    inp, kw = make_problem(b, l, h, g, p, n, dtype, OPTS["all"], seed=3)
    cfg = replace(forward.forward_config(b, h, p, n, Q, dtype), **overrides)
    y_ref, h_ref, _ = reference.ssd_recurrence(**inp, **kw)
    dt_limit = kw.pop("dt_limit")
    y, hf, _ = ssd_forward_cuda(**inp, chunk_size=Q, dt_limit=dt_limit, config=cfg, **kw)
    assert torch.isfinite(y).all() and torch.isfinite(hf).all()
    e_y, e_h = rel_err(y, y_ref), rel_err(hf, h_ref)
    tol = forward_tol(dtype)
    msg = f"{overrides}: out err {e_y:.2e}, final-state err {e_h:.2e}, tol {tol:.0e}"
    log_result(msg)
    assert e_y <= tol and e_h <= tol, msg


def check_group_launch(dims, dtype, opt, seed, Q, label, **overrides):
    """chunk_scan_group (the config's `overrides`, scan_heads among them) on a caller's chunk
    Q against the float64 recurrence, and against chunk_scan at the same tiles (the same
    products in the same order, equal in the float64 emulation: at most one rounding of the
    output dtype at the largest output apart, 2^-8 in bf16)."""
    from dataclasses import replace

    from mamba2_cutile.ssd import forward
    from mamba2_cutile.ssd.forward import ssd_forward_cuda

    b, l, h, g, p, n = dims
    inp, kw = make_problem(b, l, h, g, p, n, dtype, OPTS[opt], seed=seed)
    cfg = replace(forward.forward_config(b, h, p, n, Q, dtype), **overrides)
    y_ref, h_ref, _ = reference.ssd_recurrence(**inp, **kw)
    dt_limit = kw.pop("dt_limit", (0.0, float("inf")))
    y, hf, _ = ssd_forward_cuda(**inp, chunk_size=Q, dt_limit=dt_limit, config=cfg, **kw)
    y1, _, _ = ssd_forward_cuda(**inp, chunk_size=Q, dt_limit=dt_limit,
                                config=replace(cfg, scan_heads=1), **kw)
    assert torch.isfinite(y).all() and torch.isfinite(hf).all()
    e_y, e_h, e_1 = rel_err(y, y_ref), rel_err(hf, h_ref), rel_err(y, y1)
    tol = forward_tol(dtype)
    msg = (f"{label}: out err {e_y:.2e}, final-state err {e_h:.2e}, tol {tol:.0e}; against "
           f"chunk_scan {e_1:.2e}")
    log_result(msg)
    same = 4e-3 if dtype != torch.float32 else 1e-5
    assert e_y <= tol and e_h <= tol and e_1 <= same, msg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("opt", ["none", "D_head", "all"])
@pytest.mark.parametrize("Q, block_q, heads, g", [(128, 128, 8, 1), (64, 64, 2, 2),
                                                  (128, 64, 4, 2), (256, 64, 8, 1)])
def test_scan_heads(Q, block_q, heads, g, opt, dtype):
    """chunk_scan_group (scan_heads: C B^T once per query block and group, the program walking
    `heads` heads) at the caller's chunk (the shape rule would compute a chunk-256 call at
    128): headdim 80 and dstate 96 (not multiples of the tiles), a partial last chunk, every
    option."""
    check_group_launch((2, 700, 8, g, 80, 96), dtype, opt, 5, Q,
                       f"scan_heads={heads} Q={Q} block_q={block_q} G={g}",
                       chunk_size=Q, scan_block_q=block_q, scan_heads=heads)


@pytest.mark.parametrize("opt", ["D_head", "all"])
@pytest.mark.parametrize("Q", [128, 256])
def test_scan_heads_dstate256(Q, opt):
    """chunk_scan_group at a dstate padded to 256 (200) with 16 heads a program, computed at
    chunk 128, the tiles a dstate-256 shape would take through it (B C^T over all 256 state
    columns, the entering state's p-tile rows over all of them)."""
    check_group_launch((2, 700, 16, 1, 64, 200), torch.bfloat16, opt, 7, Q,
                       f"dstate 200 scan_heads=16 caller Q={Q}",
                       chunk_size=128, scan_block_q=64, scan_heads=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("opt", ["none", "D_head", "all_but_seq"])
@pytest.mark.parametrize("Q, caller_q, over, n", [
    (64, 64, dict(scan_block_p=64, state_segments=4), 96),
    (128, 256, dict(scan_block_p=32), 96),
    (64, 128, dict(scan_block_p=16, state_segments=3, walk_occupancy=2), 96),
    (64, 256, dict(scan_block_p=64, state_segments=2), 96),
    (64, 256, dict(scan_block_p=32), 200),
], ids=["q64-p64-seg4", "q128-of-256-p32", "q64-of-128-p16-seg3-occ2", "q64-of-256-p64-seg2",
        "q64-of-256-p32-n200"])
def test_scan_walk(Q, caller_q, over, n, opt, dtype):
    """chunk_scan_walk (scan_walk: the state carried through the chunks in registers; with
    state_segments, runs from their entering states) against the float64 recurrence and
    against the three-kernel forward at the same computed chunk: headdim 80 and dstate 96 or
    200 (not multiples of the tiles; 200 pads to 256), a partial last chunk, every option but
    seq_idx."""
    from dataclasses import replace

    from mamba2_cutile.ssd import forward
    from mamba2_cutile.ssd.forward import ssd_forward_cuda

    b, l, h, g, p = 2, 700, 8, 2, 80
    opts = {k: v for k, v in OPTS["all"].items() if k != "seq_idx"} if opt == "all_but_seq" \
        else OPTS[opt]
    inp, kw = make_problem(b, l, h, g, p, n, dtype, opts, seed=11)
    cfg = replace(forward.forward_config(b, h, p, n, caller_q, dtype), chunk_size=Q,
                  scan_walk=1, **over)
    y_ref, h_ref, _ = reference.ssd_recurrence(**inp, **kw)
    dt_limit = kw.pop("dt_limit", (0.0, float("inf")))
    calls = forward.forward_launches(**inp, chunk_size=caller_q, dt_limit=dt_limit,
                                     config=cfg, **kw)[0]
    assert "chunk_scan_walk" in [c.kernel._annotated_function.pyfunc.__name__[:-3]
                                 for c in calls]
    y, hf, _ = ssd_forward_cuda(**inp, chunk_size=caller_q, dt_limit=dt_limit, config=cfg, **kw)
    y3, h3, _ = ssd_forward_cuda(**inp, chunk_size=caller_q, dt_limit=dt_limit,
                                 config=replace(cfg, scan_walk=0, scan_heads=1,
                                                scan_block_q=min(cfg.scan_block_q, Q)), **kw)
    assert torch.isfinite(y).all() and torch.isfinite(hf).all()
    e_y, e_h, e_3 = rel_err(y, y_ref), rel_err(hf, h_ref), rel_err(y, y3)
    tol = forward_tol(dtype)
    msg = (f"walk {over} Q={Q} caller {caller_q} {opt}: out err {e_y:.2e}, final-state err "
           f"{e_h:.2e}, tol {tol:.0e}; against the three-kernel forward {e_3:.2e}")
    log_result(msg)
    assert e_y <= tol and e_h <= tol, msg


@pytest.mark.parametrize("caller_q", [128, 256])
@pytest.mark.parametrize("dims, segments, occupancy", [
    ((2, 8192, 16, 1, 64, 128), 8, 2), ((1, 4096, 64, 1, 64, 128), 2, 0),
    ((2, 8192, 48, 1, 64, 128), 1, 0), ((2, 8192, 32, 1, 64, 256), 1, 0),
    ((2, 8192, 80, 1, 64, 128), 1, 2), ((2, 8192, 48, 1, 128, 128), 1, 2)],
    ids=["seg8-two-per-sm", "seg2", "one-wave", "dstate256-p32", "two-per-sm",
         "headdim128-two-per-sm"])
def test_walk_against_mamba_ssm(dims, segments, occupancy, caller_q):
    """The walk as the shape rule runs it (`forward.walk_form`: chunk 64; S runs; one or two
    programs per SM; 32-channel programs at dstate 256): its error against the float64
    recurrence within 1.5x mamba_ssm's at the caller's chunk (the walk computes at 64)."""
    from mamba2_cutile.ssd import forward

    b, l, h, g, p, n = dims
    inp, kw = make_problem(b, l, h, g, p, n, torch.bfloat16, OPTS["D_head"], seed=5)
    # the plan the public function runs on this GPU (its SM count and tuning table)
    calls = forward.forward_launches(**inp, chunk_size=caller_q, **kw)[0]
    names = [c.kernel._annotated_function.pyfunc.__name__[:-3] for c in calls]
    sms = torch.cuda.get_device_properties(inp["x"].device).multi_processor_count
    assert forward.walk_form(b, h, p, n, torch.bfloat16, l, sms) == (segments, occupancy), (
        "another SM count than 132?")
    walk = calls[names.index("chunk_scan_walk")]
    # with runs, each walk program forms its run's entering state (walk_carry)
    assert walk.grid[2] == segments and "chunk_state_carry" not in names, (names, walk.grid)
    from support.variants import kernel_arg
    assert kernel_arg(walk, "CARRY") is (segments > 1), names
    compare_with_mamba(inp, kw, caller_q, torch.bfloat16)


@pytest.mark.parametrize("caller_q", [128, 256])
@pytest.mark.parametrize("dims", [(1, 512, 24, 1, 64, 128), (2, 700, 8, 2, 40, 96)],
                         ids=["130m-T512", "p40-n96-T700"])
def test_short_walk_against_mamba_ssm(dims, caller_q):
    """The short walk as the shape rule runs it (`forward.short_walk`: chunk 64, 16-channel
    programs, the causal fix-up in each program, two launches): its error against the
    float64 recurrence within 1.5x mamba_ssm's, at a headdim and dstate that are not
    multiples of the tiles and a partial last chunk too."""
    from mamba2_cutile.ssd import forward

    b, l, h, g, p, n = dims
    inp, kw = make_problem(b, l, h, g, p, n, torch.bfloat16, OPTS["D_head"], seed=5)
    calls = forward.forward_launches(**inp, chunk_size=caller_q, **kw)[0]
    names = [c.kernel._annotated_function.pyfunc.__name__[:-3] for c in calls]
    assert names == ["decay_cumsum", "chunk_scan_walk"], "another SM count than 132?"
    compare_with_mamba(inp, kw, caller_q, torch.bfloat16)


def test_more_than_65535_batch_heads():
    """batch * heads above CUDA's 65535 limit of grid axes y and z."""
    inp, kw = make_problem(600, 3, 128, 1, 4, 16, torch.bfloat16, {"D": "h", "init": True})
    check(inp, kw, 64, torch.bfloat16)


def test_tiny_headdim_and_dstate():
    inp, kw = make_problem(2, 130, 4, 2, 1, 1, torch.bfloat16, OPTS["all"])
    check(inp, kw, 64, torch.bfloat16)


def test_mixed_dtypes():
    """bf16 x and z, fp16 B and C, a bf16 dt view, bf16 D/dt_bias/initial_states, fp16 states."""
    inp, kw = make_problem(2, 300, 4, 2, 64, 64, torch.bfloat16, OPTS["all"])
    inp["B"], inp["C"] = inp["B"].half(), inp["C"].half()
    wide = torch.zeros(2, 300, 3 * 4, device="cuda", dtype=torch.bfloat16)
    wide[..., 4:8] = inp["dt"].bfloat16()
    inp["dt"] = wide[..., 4:8]                       # strided bf16 view, as from in_proj
    for k in ("D", "dt_bias", "initial_states"):
        kw[k] = kw[k].bfloat16()
    check(inp, kw, 128, torch.bfloat16, state_dtype=torch.float16)


def test_empty_batch():
    inp, kw = make_problem(1, 64, 2, 1, 16, 16, torch.bfloat16, {})
    inp = {k: (v[:0] if k != "A" else v) for k, v in inp.items()}
    y, h = mamba_chunk_scan_combined(**inp, chunk_size=64, return_final_states=True)
    assert y.shape == (0, 64, 2, 16) and h.shape == (0, 2, 16, 16)


@pytest.mark.parametrize("cu_list", [[0, 0, 5, 25, 400], [0, 10, 400], [0, 128, 256, 400],
                                     [0, 100, 400, 400]], ids=str)
def test_varlen_edges(cu_list):
    """Leading/trailing empty sequences, a first sequence ending inside chunk 0, sequences
    ending on chunk boundaries; with initial states."""
    l = cu_list[-1]
    inp, kw = make_problem(1, l, 4, 2, 32, 48, torch.bfloat16, {"init": True, "D": "h"})
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    seq = torch.zeros(1, l, dtype=torch.int32, device="cuda")
    for s, (a, e) in enumerate(zip(cu_list[:-1], cu_list[1:])):
        seq[0, a:e] = s
    kw["seq_idx"] = seq
    _, h_ref, v_ref = reference.ssd_recurrence(**inp, cu_seqlens=cu, **kw)
    _, h, v = mamba_chunk_scan_combined(**inp, chunk_size=128, cu_seqlens=cu,
                                        return_final_states=True, return_varlen_states=True,
                                        state_dtype=torch.float32, **kw)
    assert torch.isfinite(h).all() and torch.isfinite(v).all()
    e_v, e_h = rel_err(v, v_ref), rel_err(h, h_ref)
    tol = VARLEN_EDGES_TOL
    msg = f"varlen err {e_v:.2e}, final-state err {e_h:.2e}, tol {tol:.0e}"
    print(msg)
    log_result(msg)
    assert e_v <= tol and e_h <= tol, msg


def test_expanded_inputs():
    """B, C shared by the batch and dt shared by the heads as stride-0 expansions: the same
    answer as the materialized tensors (they are copied before the launch)."""
    inp, kw = make_problem(2, 300, 4, 2, 64, 64, torch.bfloat16, {"D": "h", "init": True})
    inp["B"] = inp["B"][:1].expand_as(inp["B"])
    inp["C"] = inp["C"][:1].expand_as(inp["C"])
    inp["dt"] = inp["dt"][..., :1].expand_as(inp["dt"])
    y, h = check(inp, kw, 128, torch.bfloat16)
    dense = {k: v.contiguous() for k, v in inp.items()}
    y2, h2 = mamba_chunk_scan_combined(**dense, chunk_size=128, return_final_states=True, **kw)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    torch.testing.assert_close(h, h2, rtol=0, atol=0)
