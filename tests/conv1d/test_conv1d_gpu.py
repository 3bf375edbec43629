"""Causal conv1d on the GPU (cuTile kernels) against the float64 definition, on shapes that are
not multiples of the tiles: forward, backward, decode update, determinism, 64-bit indexing,
and (when importable) causal-conv1d itself as a baseline. The forward, backward,
determinism, 64-bit and CUDA-graph tests run for every kernel form (`FORMS`, through
MAMBA2_CUTILE_CONV1D_CONFIG); select one with -k, e.g. -k form1-small.

Tolerances (max|ours - ref| / max|ref|, `rel_err`): the reference runs in float64 on the same
(already rounded) inputs, and the kernels accumulate in float32, so the error is the final
rounding to the output dtype, at most half an ulp: 2^-9 (bf16), 2^-12 (fp16), and a few float32
ulps of the W-term sums for fp32. The tolerances are 2x those bounds for outputs (bf16 4e-3,
fp16 5e-4); gradients that are float32 sums over all tokens (dweight, dbias) and dx (W terms,
each a product of rounded inputs) get 3x (bf16 6e-3, fp16 8e-4). Measured on an H200
(2026-12-01): bf16 3.2e-3 / 3.4e-3, fp16 3.8e-4 / 3.9e-4, fp32 1.35e-7 outputs and 3.0e-7
gradients, so fp32 is bounded at 4x those (5e-7, 1.2e-6). Every check logs its measured error
(MAMBA2_TEST_LOG)."""

import os

import pytest
import torch

from mamba2_cutile.conv1d import causal_conv1d_fn, causal_conv1d_update
from mamba2_cutile.reference.conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from support.gpu import log_result, rel_err

pytestmark = pytest.mark.gpu

F64 = torch.float64
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL_OUT = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 5e-7}
TOL_GRAD = {torch.bfloat16: 6e-3, torch.float16: 8e-4, torch.float32: 1.2e-6}
#: (batch, dim, seqlen): dims and lengths that no tile divides, one long sequence, and one
#: dim the channel tiles divide (form 1's interior blocks then skip their bounds checks)
SHAPES = [(2, 1544, 1000), (1, 264, 333), (3, 72, 17), (1, 3352, 4097), (2, 1536, 1000)]
#: form 3 (row streaming, channel-last; contiguous inputs take form 1) at spans short enough
#: for several programs per row at the test shapes, and its row-tile variant
ROWS_CFG = ("form=3,block_d=256,span=128,rows=8,prefetch=1,bwd_block_d=128,bwd_span=64,"
            "bwd_rows=4,bwd_prefetch=1")
ROWS_TILE_CFG = ("form=3,block_d=128,span=64,rows=16,row_tile=1,bwd_block_d=256,bwd_span=128,"
                 "bwd_rows=8,bwd_row_tile=1")
#: form 3 at spans that are no multiple of each other nor powers of two
ROWS_ODD_SPAN_CFG = ("form=3,block_d=256,span=376,rows=8,bwd_block_d=128,bwd_span=40,"
                     "bwd_rows=4")
#: kernel forms (`Conv1dConfig.form`, set through MAMBA2_CUTILE_CONV1D_CONFIG): the dispatcher's
#: choice (form 1 for channel-last inputs, form 0 for contiguous ones), the first kernels
#: (form 0) at the dispatcher's tiles, the streamed-tap kernels at 128-channel tiles and at
#: small ones (many interior blocks), form 2 (tap-view forward, form 1's backward) with and
#: without a loop over blocks
FORMS = {"default": "", "form0": "form=0", "form1": "form=1,block_d=128",
         "form1-small": "form=1,block_l=16,block_d=64,"
         "bwd_block_l=16,bwd_block_d=32,bwd_tiles=2", "form2": "form=2",
         "form2-tiles": "form=2,block_l=16,block_d=64,tiles=4",
         "form3": ROWS_CFG, "form3-tile": ROWS_TILE_CFG}


@pytest.fixture(params=sorted(FORMS))
def form(request, monkeypatch):
    from mamba2_cutile.conv1d.plan import ENV_CONV1D
    monkeypatch.setenv(ENV_CONV1D, FORMS[request.param])
    return request.param


def _x(b, d, l, dtype, layout, gen):
    if layout == "channel_last":
        # the Mamba-2 layer's case: a channel slice of the in_proj output
        proj = torch.randn(b, l, d + 2 * 24, device="cuda", generator=gen).to(dtype)
        return proj[..., 24:24 + d].transpose(1, 2)
    return torch.randn(b, d, l, device="cuda", generator=gen).to(dtype)


def _seq_idx(b, l):
    seq = torch.zeros(b, l, dtype=torch.int32)
    for r in range(b):
        for k, pos in enumerate((1, l // 3, l // 3 + 1, l - 1)):
            if 0 < pos < l:
                seq[r, pos:] = 2 * (k + 1) + r
    if b > 1:
        seq[1, :3] = -1
    return seq.cuda()


def _problem(shape, dtype, layout, w, opts, seed=0):
    b, d, l = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = _x(b, d, l, dtype, layout, gen)
    weight = (torch.randn(d, w, device="cuda", generator=gen) / w ** 0.5).to(dtype)
    kw = dict(
        bias=torch.randn(d, device="cuda", generator=gen).to(dtype) if "bias" in opts else None,
        initial_states=torch.randn(b, d, w - 1, device="cuda", generator=gen).to(dtype)
        if "init" in opts else None,
        seq_idx=_seq_idx(b, l) if "seq" in opts else None)
    return x, weight, kw


OPTS = {"all": ("bias", "init", "seq", "silu"), "none": (), "bias_silu": ("bias", "silu"),
        "init_seq": ("init", "seq")}


#: (dtype, layout, width, options): every dtype and layout with all options at width 4, the
#: other widths and option subsets at one dtype (each is its own kernel variant to compile)
FWD_CASES = [(dt, lay, 4, "all") for dt in DTYPES for lay in ("channel_last", "contiguous")] + [
    (torch.bfloat16, "channel_last", 2, "none"), (torch.bfloat16, "channel_last", 3, "all"),
    (torch.bfloat16, "channel_last", 8, "all"), (torch.bfloat16, "contiguous", 8, "bias_silu"),
    (torch.float32, "channel_last", 5, "init_seq"), (torch.float16, "contiguous", 2, "none")]
BWD_CASES = [(torch.bfloat16, "channel_last", 4, "all"), (torch.bfloat16, "contiguous", 4, "all"),
             (torch.float32, "channel_last", 2, "none"), (torch.float16, "channel_last", 8,
                                                         "init_seq"),
             (torch.float32, "contiguous", 5, "bias_silu"), (torch.float32, "channel_last", 4,
                                                            "all")]


def _case_id(c):
    return f"{str(c[0])[6:]}-{c[1]}-w{c[2]}-{c[3]}"


@pytest.mark.parametrize("case", FWD_CASES, ids=_case_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward(case, shape, form):
    dtype, layout, w, opts = case
    x, weight, kw = _problem(shape, dtype, layout, w, OPTS[opts])
    act = "silu" if "silu" in OPTS[opts] else None
    out, final = causal_conv1d_fn(x, weight, return_final_states=True, activation=act, **kw)
    ref, ref_final = causal_conv1d_ref(x, weight, kw["bias"], kw["seq_idx"],
                                       kw["initial_states"], act)
    err, err_final = rel_err(out, ref), rel_err(final, ref_final)
    log_result(f"out {err:.3e} final {err_final:.3e}")
    assert out.dtype == dtype and out.shape == x.shape
    assert err <= TOL_OUT[dtype] and err_final == 0.0     # final states are copies


@pytest.mark.parametrize("case", BWD_CASES, ids=_case_id)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[3], SHAPES[4]],
                         ids=lambda s: "x".join(map(str, s)))
def test_backward(case, shape, form):
    dtype, layout, w, opts = case
    x, weight, kw = _problem(shape, dtype, layout, w, OPTS[opts], seed=w)
    act = "silu" if "silu" in OPTS[opts] else None
    b, d, l = shape
    gen = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(b, d, l, device="cuda", generator=gen).to(dtype)
    dfinal = torch.randn(b, d, w - 1, device="cuda", generator=gen).to(dtype)
    names = ["x", "weight", "bias", "initial_states"]
    leaves = [t for t in (x, weight, kw["bias"], kw["initial_states"])]

    def grads(fn, cast):
        ins = [None if t is None else cast(t).detach().requires_grad_() for t in leaves]
        out, final = fn(*ins)
        loss = (out.to(F64) * dout.to(F64)).sum() + (final.to(F64) * dfinal.to(F64)).sum()
        live = [t for t in ins if t is not None]
        return dict(zip([n for n, t in zip(names, ins) if t is not None],
                        torch.autograd.grad(loss, live)))

    ours = grads(lambda a, w_, c, h: causal_conv1d_fn(
        a, w_, c, seq_idx=kw["seq_idx"], initial_states=h, return_final_states=True,
        activation=act), lambda t: t)
    ref = grads(lambda a, w_, c, h: causal_conv1d_ref(a, w_, c, kw["seq_idx"], h, act),
                lambda t: t.to(F64))
    errs = {k: rel_err(ours[k], ref[k]) for k in ref}
    log_result(" ".join(f"d{k} {v:.3e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert v <= TOL_GRAD[dtype], (k, v)


def test_backward_is_deterministic(form):
    x, weight, kw = _problem(SHAPES[3], torch.bfloat16, "channel_last", 4, OPTS["all"])
    dout = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
    runs = []
    for _ in range(2):
        ins = [t.detach().requires_grad_() for t in (x, weight, kw["bias"],
                                                     kw["initial_states"])]
        out = causal_conv1d_fn(ins[0], ins[1], ins[2], seq_idx=kw["seq_idx"],
                               initial_states=ins[3], activation="silu")
        runs.append(torch.autograd.grad(out, ins, dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("circular", [False, True])
@pytest.mark.parametrize("w", [2, 4])
def test_update(dtype, k, circular, w):
    b, d, nslots = 5, 1544, 9
    state_len = w - 1 + (3 if circular else 0)
    gen = torch.Generator(device="cuda").manual_seed(k + w)
    x = torch.randn(b, d, k, device="cuda", generator=gen).to(dtype)
    state = torch.randn(nslots, d, state_len, device="cuda", generator=gen).to(dtype)
    weight = torch.randn(d, w, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(d, device="cuda", generator=gen).to(dtype)
    cache = torch.tensor([0, 5, 2, 17, 1], dtype=torch.int32, device="cuda") if circular \
        else None
    slots = torch.tensor([3, -1, 0, 8, 6], dtype=torch.int32, device="cuda")
    want, want_state = causal_conv1d_update_ref(x, state, weight, bias, "silu", cache, slots)
    st = state.clone()
    out = causal_conv1d_update(x if k > 1 else x[..., 0], st, weight, bias, activation="silu",
                               cache_seqlens=cache, conv_state_indices=slots)
    out = out if k > 1 else out.unsqueeze(-1)
    err = rel_err(out, want)
    log_result(f"out {err:.3e}")
    assert err <= TOL_OUT[dtype]
    assert torch.equal(st.to(F64), want_state)        # the state moves values, never rounds
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_update_matches_forward_continuation():
    """Decoding token by token from the prefill's final states gives the prefill-of-the-whole
    sequence outputs (bf16, channel-last prefill)."""
    b, d, l0, steps, w = 2, 1544, 300, 4, 4
    x, weight, kw = _problem((b, d, l0 + steps), torch.bfloat16, "channel_last", w,
                             ("bias",))
    full = causal_conv1d_fn(x, weight, kw["bias"], activation="silu")
    _, state = causal_conv1d_fn(x[..., :l0], weight, kw["bias"], return_final_states=True,
                                activation="silu")
    state = state.contiguous()
    for s in range(steps):
        out = causal_conv1d_update(x[..., l0 + s], state, weight, kw["bias"], activation="silu")
        err = rel_err(out, full[..., l0 + s])
        log_result(f"step {s} {err:.3e}")
        assert err <= TOL_OUT[torch.bfloat16]


def test_int64_indexing(form):
    """x of 2^31+ elements (4.3 GB in bf16): the 64-bit kernel variant; the tail checked
    against the definition on the tail's window."""
    b, d, l, w = 1, 1024, 2**21 + 5, 4
    x = torch.randn(b, d, l, device="cuda").to(torch.bfloat16)
    weight = torch.randn(d, w, device="cuda").to(torch.bfloat16)
    out = causal_conv1d_fn(x, weight, activation="silu")
    tail = x[..., -(100 + w - 1):]
    ref, _ = causal_conv1d_ref(tail, weight, activation="silu")
    err = rel_err(out[..., -100:], ref[..., w - 1:])
    log_result(f"tail {err:.3e}")
    assert err <= TOL_OUT[torch.bfloat16]



@pytest.mark.parametrize("layout", ["channel_last", "contiguous"])
def test_long_sequence_forward_backward(layout):
    """A sequence past 512 x 65535 tokens (x of 2^31+ elements, 4.3 GB in bf16), the default
    config: the grid's token axis stays within CUDA's 65535 (form 3's spans grow past 512
    tokens channel-last; forms 0 / 1 walk more token blocks per program contiguous), forward
    and backward against F.conv1d + SiLU in float32 on the same inputs."""
    import torch.nn.functional as F

    from mamba2_cutile.conv1d import plan
    b, d, w = 1, 64, 4
    l = 512 * plan.MAX_GRID_Y + 1000
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = _x(b, d, l, torch.bfloat16, layout, gen)
    weight = (torch.randn(d, w, device="cuda", generator=gen) / w ** 0.5).to(torch.bfloat16)
    bias = torch.randn(d, device="cuda", generator=gen).to(torch.bfloat16)
    # detach keeps x's strides (the channel-last slice stays one; a clone would be contiguous)
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    assert plan.is_channel_last(leaves[0]) == (layout == "channel_last")
    out = causal_conv1d_fn(*leaves, activation="silu")
    dout = torch.randn(b, d, l, device="cuda", generator=gen).to(torch.bfloat16)
    got = torch.autograd.grad(out, leaves, dout)
    # the float32 reference in windows of 2^22 tokens (each with its w-1 tokens of history):
    # one F.conv1d over 2^31+ elements would need tens of GB of float32 intermediates
    ref = torch.empty(b, d, l, device="cuda")
    want = [torch.zeros(b, d, l, device="cuda"), torch.zeros(d, w, device="cuda"),
            torch.zeros(d, device="cuda")]
    wr = weight.detach().float().requires_grad_()
    br = bias.detach().float().requires_grad_()
    step = 1 << 22
    for s in range(0, l, step):
        e = min(l, s + step)
        lo = max(0, s - (w - 1))
        xw = x[..., lo:e].detach().float().requires_grad_()
        pre = F.conv1d(F.pad(xw, (w - 1 - (s - lo), 0)), wr[:, None, :], br, groups=d)
        yw = F.silu(pre)
        gx, gw, gb = torch.autograd.grad(yw, (xw, wr, br), dout[..., s:e].float())
        ref[..., s:e] = yw.detach()
        want[0][..., lo:e] += gx
        want[1] += gw
        want[2] += gb
    err = rel_err(out, ref, window=step)
    log_result(f"{layout} out {err:.3e}")
    assert err <= TOL_OUT[torch.bfloat16]
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
        err = rel_err(g, r, window=step)
        log_result(f"{layout} {name} {err:.3e}")
        assert err <= TOL_GRAD[torch.bfloat16]

def _baseline():
    if os.environ.get("MAMBA2_TEST_COMPARE_MAMBA", "1") == "0":
        pytest.skip("MAMBA2_TEST_COMPARE_MAMBA=0: the baseline comparison is off")
    try:
        from causal_conv1d import causal_conv1d_fn as theirs
    except Exception:  # noqa: BLE001
        pytest.skip("causal_conv1d is not importable: no baseline to compare with")
    return theirs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_against_causal_conv1d(dtype):
    """No worse than 1.5x causal-conv1d's own error against the float64 definition (on the
    options it supports: channel-last x, initial states, final states)."""
    theirs = _baseline()
    x, weight, kw = _problem(SHAPES[0], dtype, "channel_last", 4, ("bias", "init"))
    ref, ref_final = causal_conv1d_ref(x, weight, kw["bias"], None, kw["initial_states"],
                                       "silu")
    ours, _ = causal_conv1d_fn(x, weight, kw["bias"], initial_states=kw["initial_states"],
                               return_final_states=True, activation="silu")
    base, _ = theirs(x, weight, kw["bias"], initial_states=kw["initial_states"],
                     return_final_states=True, activation="silu")
    e_ours, e_base = rel_err(ours, ref), rel_err(base, ref)
    log_result(f"ours {e_ours:.3e} causal_conv1d {e_base:.3e}")
    assert e_ours <= max(1.5 * e_base, TOL_OUT[dtype] / 4)


def test_cuda_graph_capture_forward_backward(form):
    """No host synchronization: forward + backward capture in a CUDA graph and replay to the
    eager results."""
    x, weight, kw = _problem(SHAPES[1], torch.bfloat16, "channel_last", 4, OPTS["all"])
    dout = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
    ins = [t.detach().requires_grad_() for t in (x, weight, kw["bias"], kw["initial_states"])]

    def step():
        out = causal_conv1d_fn(ins[0], ins[1], ins[2], seq_idx=kw["seq_idx"],
                               initial_states=ins[3], activation="silu")
        return (out,) + torch.autograd.grad(out, ins, dout)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_training_step():
    """torch.compile(fullgraph=True) (inductor) traces the custom ops; the gradients equal
    the eager ones."""
    x, weight, kw = _problem(SHAPES[1], torch.bfloat16, "channel_last", 4, ("bias", "seq"))

    def loss(x_, w_, b_):
        return causal_conv1d_fn(x_, w_, b_, seq_idx=kw["seq_idx"],
                                activation="silu").float().square().sum()

    ins = [t.detach().requires_grad_() for t in (x, weight, kw["bias"])]
    want = torch.autograd.grad(loss(*ins), ins)
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*ins), ins)
    for g, r in zip(got, want):
        err = rel_err(g, r)     # same kernels; only inductor's elementwise rounding may differ
        log_result(f"compiled vs eager {err:.3e}")
        assert err <= TOL_GRAD[torch.bfloat16]


def test_bench_runs():
    from mamba2_cutile.bench.conv1d import bench_conv1d, format_rows
    rows = bench_conv1d(shapes=[(1, 2048, 1544)], reps=3)
    print(format_rows(rows))
    ours = [r for r in rows if r["impl"] == "ours"]
    assert {r["mode"] for r in ours} == {"fwd", "fwdbwd"}
    assert all(r["ms"] > 0 and r["rel_err"] <= TOL_OUT[torch.bfloat16] for r in ours)


def test_sweep_runs_and_checks_candidates():
    """The sweep times each candidate (kernel alone and whole call) and compares its results
    with the default config's: the forms compute the same sums in the same float32 order up
    to the final rounding, so they agree to a bf16 ulp or two (2^-8 = 3.9e-3 relative to the
    maximum); a bad field is a row with an error, not a crash."""
    from mamba2_cutile.bench.conv1d import best_of_sweep, sweep_conv1d
    rows = sweep_conv1d(shapes=[(1, 2048, 1536)], fwd_candidates=["", "form=1", "form=9"],
                        bwd_candidates=["", "form=1,bwd_tiles=2"], reps=3)
    ok = [r for r in rows if "error" not in r]
    assert len(ok) == 4 and [r["config"] for r in rows if "error" in r] == ["form=9"]
    for r in ok:
        log_result(f"{r['mode']} {r['config']}: {r['kernel_ms']:.4f} ms {r['peak_pct']:.1f}% "
                   f"diff {r['max_rel_diff']:.2e}")
        assert r["kernel_ms"] > 0 and r["call_ms"] > 0 and r["max_rel_diff"] <= 8e-3
    assert len(best_of_sweep(rows)) == 2


#: (name, dtype, shape, options, config): form 3's quick check, one compile each: every option
#: at a dim no channel tile divides, a dim they divide (unchecked full steps), float32 (the
#: IEEE SiLU; 16-bit inputs take the approximate exp2 / reciprocal), the row-tile variant
#: (the first three are the quick set: -k "row_streaming and not row-tile")
ROWS_QUICK = [
    ("bf16-all-partial-d", torch.bfloat16, SHAPES[0], "all", ROWS_CFG),
    ("bf16-unchecked", torch.bfloat16, SHAPES[4], "bias_silu", ROWS_CFG),
    ("fp32-short", torch.float32, SHAPES[1], "bias_silu", ROWS_CFG),
    ("bf16-row-tile", torch.bfloat16, SHAPES[4], "bias_silu", ROWS_TILE_CFG),
    # spans that are no power of two (run-time kernel arguments): 376 and 40 tokens on 4097
    ("bf16-odd-spans", torch.bfloat16, SHAPES[3], "all", ROWS_ODD_SPAN_CFG),
    # the dispatcher's automatic spans (whole waves of CTA slots) at 16K tokens: forward
    # 147 spans of 112 tokens, backward 59 of 280 (1544 channels, 132 SMs)
    ("bf16-auto-waves", torch.bfloat16, (1, 1544, 16389), "all", ""),
]


@pytest.mark.parametrize("name,dtype,shape,opts,cfg", ROWS_QUICK, ids=[c[0] for c in ROWS_QUICK])
def test_row_streaming_forward_backward(name, dtype, shape, opts, cfg, monkeypatch):
    """Form 3 (channel-last, width 4, SiLU) against the float64 definition: out, final states
    and the gradients of x, weight, bias, initial states (tolerances as for every form: the
    approximate sigmoid of 16-bit inputs adds ~2^-21 relative, far below their rounding)."""
    from mamba2_cutile.conv1d.plan import ENV_CONV1D
    monkeypatch.setenv(ENV_CONV1D, cfg)
    w = 4
    x, weight, kw = _problem(shape, dtype, "channel_last", w, OPTS[opts], seed=3)
    b, d, l = shape
    gen = torch.Generator(device="cuda").manual_seed(5)
    dout = torch.randn(b, d, l, device="cuda", generator=gen).to(dtype)
    dfinal = torch.randn(b, d, w - 1, device="cuda", generator=gen).to(dtype)
    leaves = [t for t in (x, weight, kw["bias"], kw["initial_states"]) if t is not None]

    def run(fn, cast):
        ins = [cast(t).detach().requires_grad_() for t in leaves]
        it = iter(ins)
        a, w_ = next(it), next(it)
        c = next(it) if kw["bias"] is not None else None
        h = next(it) if kw["initial_states"] is not None else None
        out, final = fn(a, w_, c, h)
        loss = (out.to(F64) * dout.to(F64)).sum() + (final.to(F64) * dfinal.to(F64)).sum()
        return (out, final) + torch.autograd.grad(loss, ins)

    ours = run(lambda a, w_, c, h: causal_conv1d_fn(
        a, w_, c, seq_idx=kw["seq_idx"], initial_states=h, return_final_states=True,
        activation="silu"), lambda t: t)
    ref = run(lambda a, w_, c, h: causal_conv1d_ref(a, w_, c, kw["seq_idx"], h, "silu"),
              lambda t: t.to(F64))
    names = ["out", "final", "dx", "dweight"] + ["dbias"] * (kw["bias"] is not None) + \
        ["dinit"] * (kw["initial_states"] is not None)
    errs = {n: rel_err(o, r) for n, o, r in zip(names, ours, ref)}
    log_result(" ".join(f"{k} {v:.3e}" for k, v in errs.items()))
    assert errs["final"] == 0.0
    assert errs["out"] <= TOL_OUT[dtype]
    for k, v in errs.items():
        if k not in ("out", "final"):
            assert v <= TOL_GRAD[dtype], (k, v)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_row_streaming_int64(direction, monkeypatch):
    """Form 3's 64-bit variants: channel-last x of 2^31+ elements (4.3 GB in bf16); the last
    100 tokens of out (and of dx) against the definition on the tail's window (dx(u) needs
    g(u .. u+W-1), and pre(t) the W-1 inputs before t: all inside the window for the last
    100 tokens)."""
    from mamba2_cutile.conv1d.plan import ENV_CONV1D
    monkeypatch.setenv(ENV_CONV1D, ROWS_CFG)
    b, d, l, w, n = 1, 1024, 2**21 + 5, 4, 100
    x = torch.randn(b, l, d, device="cuda").to(torch.bfloat16).transpose(1, 2)
    weight = torch.randn(d, w, device="cuda").to(torch.bfloat16)
    bias = torch.randn(d, device="cuda").to(torch.bfloat16)
    if direction == "fwd":
        out = causal_conv1d_fn(x, weight, bias, activation="silu")
        ref, _ = causal_conv1d_ref(x[..., -(n + w - 1):], weight, bias, activation="silu")
        err = rel_err(out[..., -n:], ref[..., w - 1:])
    else:
        dout = torch.randn(b, l, d, device="cuda").to(torch.bfloat16).transpose(1, 2)
        xs = x.detach().requires_grad_()
        dx, = torch.autograd.grad(causal_conv1d_fn(xs, weight, bias, activation="silu"), xs,
                                  dout)
        win = x[..., -(n + 2 * (w - 1)):].to(F64).requires_grad_()
        ref, _ = causal_conv1d_ref(win, weight.to(F64), bias.to(F64), activation="silu")
        dref, = torch.autograd.grad(ref, win, dout[..., -(n + 2 * (w - 1)):].to(F64))
        # the window's last n tokens: their g terms all lie inside it
        err = rel_err(dx[..., -n:], dref[..., -n:])
    log_result(f"{direction} tail {err:.3e}")
    assert err <= (TOL_OUT if direction == "fwd" else TOL_GRAD)[torch.bfloat16]
