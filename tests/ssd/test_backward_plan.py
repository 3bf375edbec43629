"""CPU: the backward's plans on `meta` tensors: grid limits and 64-bit variants (their compiles
are in test_ssd_compile.py)."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("cuda.tile")

from mamba2_cutile.bench import plans  # noqa: E402
from mamba2_cutile.ssd import backward  # noqa: E402


def test_plan_grids_respect_cuda_limits():
    """Axes 1 and 2 of every grid stay within 65535, also for huge batch * heads."""
    calls = plans.backward_problem_plan(batch=600, seqlen=3, nheads=128, headdim=4, dstate=16,
                                        chunk_size=64)
    for call in calls:
        assert all(1 <= g for g in call.grid)
        assert all(g <= 65535 for g in call.grid[1:])
        assert call.grid[0] < 2**31


@pytest.mark.parametrize("overrides", [dict(), dict(da_mode=2), dict(bc_fused=0, da_mode=0),
                                       dict(dx_cb=1), dict(bc_head_split=2, da_mode=2),
                                       dict(dx_head_block=4)],
                         ids=["default", "da_mode2", "unfused", "dx_cb", "head_split",
                              "dx_head_block"])
def test_int64_variant_whenever_an_argument_needs_it(overrides):
    """Every launch with an array argument of 2^31 elements or more gets its 64-bit variant
    (here the decay-gradient scratch is the largest array: narrow p- and n-tiles)."""
    import cuda.tile as ct

    b, l, h, g, p, n, Q = 1, 31744 * 256, 16, 1, 8, 256, 256
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    x, dt, A = e(b, l, h, p), e(b, l, h, dt=torch.float32), e(h, dt=torch.float32)
    B, C = e(b, l, g, n), e(b, l, g, n)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16),
                  dx_block_p=8, bc_block_n=16, **overrides)
    calls = []
    backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg)
    for call in calls:
        fn = call.kernel._annotated_function.pyfunc
        big = max(a.numel() for a in call.args if isinstance(a, torch.Tensor))
        is64 = any(v is ct.IndexedWithInt64 for v in fn.__annotations__.values())
        assert is64 == (big >= 2**31), (fn.__name__, big)


def _kernel_names(calls):
    return [c.kernel._annotated_function.pyfunc.__name__.removesuffix("_fn") for c in calls]


def _meta_problem(b, l, h, g, p, n):
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    return (e(b, l, h, p), e(b, l, h, dt=torch.float32), e(h, dt=torch.float32), e(b, l, g, n),
            e(b, l, g, n))


@pytest.mark.parametrize("Q, block_q", [(128, 64), (256, 32), (64, 64)])
def test_dx_cb_plan(Q, block_q):
    """dx_cb=1: chunk_cb runs right before bwd_chunk_dx over (nc * B * G, Q / BQ, Q / BQ)
    into a (B, nc, G, Q, Q) fp32 scratch counted in the buffers' bytes, which bwd_chunk_dx
    gets with DX_CB set; dx_cb=0 has neither (and passes DX_CB False)."""
    b, l, h, g, p, n = 2, 1000, 8, 2, 64, 128
    x, dt, A, B, C = _meta_problem(b, l, h, g, p, n)
    plans_, bufs_ = {}, {}
    for dx_cb in (0, 1):
        cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16),
                      chunk_size=Q, dx_block_q=block_q, dx_cb=dx_cb)
        calls = []
        backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg,
                              on_buffers=lambda bf, k=dx_cb: bufs_.__setitem__(k, bf))
        plans_[dx_cb] = calls
    names0, names1 = _kernel_names(plans_[0]), _kernel_names(plans_[1])
    assert "chunk_cb" not in names0 and len(names0) == 6 and bufs_[0].cb is None
    i = names1.index("chunk_cb")
    assert names1[:i] + names1[i + 1:] == names0 and names1[i + 1] == "bwd_chunk_dx"
    nc = -(-l // Q)
    cb = bufs_[1].cb
    assert cb.shape == (b, nc, g, Q, Q) and cb.dtype == torch.float32
    assert bufs_[1].nbytes() - bufs_[0].nbytes() == cb.numel() * 4
    cb_call, dx_call = plans_[1][i], plans_[1][i + 1]
    assert tuple(cb_call.grid) == (nc * b * g, Q // block_q, Q // block_q)
    assert cb_call.args[2] is cb and cb_call.args[4] == block_q
    fn = dx_call.kernel._annotated_function.pyfunc
    params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    args1 = dict(zip(params, dx_call.args))
    args0 = dict(zip(params, plans_[0][names0.index("bwd_chunk_dx")].args))
    assert args1["cb_buf"] is cb and args1["DX_CB"] is True and args0["DX_CB"] is False


def test_dx_cb_scratch_alone_picks_int64():
    """A problem where only the S buffer (B * Lp * G * Q elements) reaches 2^31: chunk_cb
    and bwd_chunk_dx (which reads it) take their 64-bit variants, the others stay 32-bit."""
    import cuda.tile as ct

    b, l, h, g, p, n, Q = 1, 2**21 + 5, 8, 8, 8, 16, 128
    x, dt, A, B, C = _meta_problem(b, l, h, g, p, n)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16), dx_cb=1)
    calls, bufs_ = [], {}
    backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg,
                          on_buffers=lambda bf: bufs_.setdefault("b", bf))
    assert bufs_["b"].cb.numel() >= 2**31
    for call in calls:
        fn = call.kernel._annotated_function.pyfunc
        is64 = any(v is ct.IndexedWithInt64 for v in fn.__annotations__.values())
        name = fn.__name__.removesuffix("_fn")
        assert is64 == (name in ("chunk_cb", "bwd_chunk_dx")), name
        big = max(a.numel() for a in call.args if isinstance(a, torch.Tensor))
        assert is64 == (big >= 2**31), (name, big)


@pytest.mark.parametrize("value", [2, -1])
def test_dx_cb_must_be_0_or_1(value):
    cfg = backward.backward_config(1, 4, 1, 64, 128, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="dx_cb"):
        replace(cfg, dx_cb=value)


@pytest.mark.parametrize("split, want", [(1, 1), (2, 2), (4, 4), (8, 4)])
def test_head_split_plan(split, want):
    """bc_head_split: the fused dB/dC launch gets `want` programs on grid axis 2 (gcd with the 4
    heads per group) and fp32 (splits, B, L, G, N) partials for dB and dC, counted in the
    buffers' bytes, as its db/dc arguments with HEAD_SPLIT = splits; unsplit it writes dB and
    dC themselves and no partials exist. The launch count stays 6."""
    b, l, h, g, p, n, Q = 2, 1000, 8, 2, 64, 128, 128
    x, dt, A, B, C = _meta_problem(b, l, h, g, p, n)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16), bc_head_split=split)
    calls, bufs_ = [], {}
    backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg,
                          on_buffers=lambda bf: bufs_.setdefault("b", bf))
    bufs = bufs_["b"]
    names = _kernel_names(calls)
    assert len(names) == 6
    call = calls[names.index("bwd_chunk_dbc_fused")]
    nc = -(-l // Q)
    assert tuple(call.grid) == (nc * b * g, -(-n // cfg.bc_block_n), want)
    fn = call.kernel._annotated_function.pyfunc
    args = dict(zip(fn.__code__.co_varnames[:fn.__code__.co_argcount], call.args))
    assert args["HEAD_SPLIT"] == want
    base = replace(cfg, bc_head_split=1)
    base_bytes = backward.allocate_buffers(x, dt, B, C, None, None, None, base,
                                           backward.default_state_dtype(x.dtype)).nbytes()
    if want == 1:
        assert bufs.db_part is None and bufs.dc_part is None
        assert args["db"] is bufs.dB and args["dc"] is bufs.dC
        assert bufs.nbytes() == base_bytes
    else:
        for part in (bufs.db_part, bufs.dc_part):
            assert part.shape == (want, b, l, g, n) and part.dtype == torch.float32
        assert args["db"] is bufs.db_part and args["dc"] is bufs.dc_part
        assert bufs.nbytes() - base_bytes == 2 * want * b * l * g * n * 4


def test_head_split_reduction():
    """reduce_head_splits: dB and dC become the sum over the partials' axis 0 (float64
    reference, rounded once to bf16), the same bits on every call; nothing without a split."""
    b, l, h, g, p, n, Q = 1, 70, 4, 1, 8, 16, 64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, l, h, p, generator=gen).bfloat16()
    B = torch.randn(b, l, g, n, generator=gen).bfloat16()
    dt = torch.rand(b, l, h, generator=gen)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16), bc_head_split=4)
    bufs = backward.allocate_buffers(x, dt, B, B, None, None, None, cfg)
    assert bufs.db_part.shape[0] == 4
    bufs.db_part.copy_(torch.randn(bufs.db_part.shape, generator=gen))
    bufs.dc_part.copy_(torch.randn(bufs.dc_part.shape, generator=gen))
    backward.reduce_head_splits(bufs)
    first = (bufs.dB.clone(), bufs.dC.clone())
    for out, part in ((bufs.dB, bufs.db_part), (bufs.dC, bufs.dc_part)):
        want = part.double().sum(dim=0)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), want, rtol=2**-8, atol=1e-6)
    backward.reduce_head_splits(bufs)
    assert torch.equal(first[0], bufs.dB) and torch.equal(first[1], bufs.dC)
    unsplit = backward.allocate_buffers(x, dt, B, B, None, None, None,
                                        replace(cfg, bc_head_split=1))
    unsplit.dB.fill_(3.0)
    backward.reduce_head_splits(unsplit)
    assert unsplit.db_part is None and unsplit.dB.eq(3.0).all()


def test_head_split_partials_alone_pick_int64():
    """A problem where only the dB/dC partials (splits * B*L*G*N elements) reach 2^31: the
    fused dB/dC launch takes its 64-bit variant, every other launch stays 32-bit."""
    import cuda.tile as ct

    b, l, h, g, p, n, Q = 1, 2**22 + 5, 2, 1, 8, 256, 256
    x, dt, A, B, C = _meta_problem(b, l, h, g, p, n)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16), bc_head_split=2)
    calls, bufs_ = [], {}
    backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg,
                          on_buffers=lambda bf: bufs_.setdefault("b", bf))
    bufs = bufs_["b"]
    assert bufs.db_part.numel() >= 2**31 > bufs.dB.numel()
    for call in calls:
        fn = call.kernel._annotated_function.pyfunc
        is64 = any(v is ct.IndexedWithInt64 for v in fn.__annotations__.values())
        name = fn.__name__.removesuffix("_fn")
        assert is64 == (name == "bwd_chunk_dbc_fused"), name
        big = max(a.numel() for a in call.args if isinstance(a, torch.Tensor))
        assert is64 == (big >= 2**31), (name, big)


@pytest.mark.parametrize("over", [dict(bc_head_split=3), dict(bc_head_split=0),
                                  dict(bc_head_split=128),
                                  dict(bc_head_split=2, bc_fused=0, da_mode=0)])
def test_head_split_validation(over):
    cfg = backward.backward_config(1, 4, 1, 64, 128, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="bc_head_split"):
        replace(cfg, **over)


@pytest.mark.parametrize("hpg, split, want", [(80, 2, 2), (80, 4, 4), (80, 32, 16), (6, 4, 2),
                                              (3, 4, 1), (1, 8, 1), (16, 64, 16)])
def test_head_splits_divide_the_heads(hpg, split, want):
    cfg = replace(backward.backward_config(1, hpg, 1, 64, 128, 128, torch.bfloat16),
                  bc_head_split=split)
    assert backward.head_splits(cfg, 2 * hpg, 2) == want


def _dx_call(calls):
    (call,) = [c for c in calls if _kernel_names([c])[0].startswith("bwd_chunk_dx")]
    fn = call.kernel._annotated_function.pyfunc
    return call, dict(zip(fn.__code__.co_varnames[:fn.__code__.co_argcount], call.args))


@pytest.mark.parametrize("h, g, block, want", [(8, 2, 2, 2), (8, 1, 8, 8), (80, 1, 16, 16),
                                               (12, 2, 4, 2), (8, 8, 8, 1)])
def test_dx_head_block_plan(h, g, block, want):
    """dx_head_block: the dx launch is bwd_chunk_dx_heads with HEAD_BLOCK = want heads per
    program (gcd with the heads per group) on a grid of (n_q * B * H / want, n_pt), writing the
    same buffers (same bytes: no scratch) with the same arguments as bwd_chunk_dx; want = 1 is
    bwd_chunk_dx itself. Still 6 launches."""
    b, l, p, n, Q = 2, 1000, 64, 128, 128
    x, dt, A, B, C = _meta_problem(b, l, h, g, p, n)
    base = backward.backward_config(b, h, g, p, n, Q, torch.bfloat16)
    plans_, bufs_ = {}, {}
    for blk in (1, block):
        calls = []
        backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend,
                              config=replace(base, dx_head_block=blk),
                              on_buffers=lambda bf, k=blk: bufs_.__setitem__(k, bf))
        plans_[blk] = calls
    assert backward.dx_head_blocks(replace(base, dx_head_block=block), h, g) == want
    names = _kernel_names(plans_[block])
    assert len(names) == 6
    assert names == _kernel_names(plans_[1])[:3] + names[3:4] + _kernel_names(plans_[1])[4:]
    call, args = _dx_call(plans_[block])
    call1, args1 = _dx_call(plans_[1])
    n_q, n_pt = -(-l // base.dx_block_q), -(-p // base.dx_block_p)
    assert _kernel_names([call1]) == ["bwd_chunk_dx"]
    assert tuple(call1.grid) == (n_q * b * h, n_pt, 1)
    if want == 1:
        assert _kernel_names([call]) == ["bwd_chunk_dx"]
        return
    assert _kernel_names([call]) == ["bwd_chunk_dx_heads"]
    assert tuple(call.grid) == (n_q * b * h // want, n_pt, 1)
    assert args["HEAD_BLOCK"] == want and "HEADS_PER_GROUP" not in args
    assert args["b"].shape[2] == g and args["x"].shape[2] == h
    for k, v in args.items():
        if k in args1 and k != "HEAD_BLOCK" and isinstance(v, torch.Tensor):
            assert v.shape == args1[k].shape and v.dtype == args1[k].dtype, k
    assert bufs_[block].nbytes() == bufs_[1].nbytes()


@pytest.mark.parametrize("over", [dict(da_mode=2), dict(dx_cb=1)], ids=["da_mode2", "dx_cb"])
def test_dx_head_block_falls_back(over):
    """Options the multi-head kernel does not take keep the one-head bwd_chunk_dx launch."""
    b, l, h, g, p, n, Q = 1, 500, 8, 1, 64, 128, 128
    x, dt, A, B, C = _meta_problem(b, l, h, g, p, n)
    cfg = replace(backward.backward_config(b, h, g, p, n, Q, torch.bfloat16), dx_head_block=8,
                  **over)
    assert backward.dx_head_blocks(cfg, h, g) == 1
    calls = []
    backward.run_backward(x, dt, A, B, C, Q, x, launch_fn=calls.extend, config=cfg)
    call, args = _dx_call(calls)
    assert _kernel_names([call]) == ["bwd_chunk_dx"]
    assert tuple(call.grid) == (-(-l // cfg.dx_block_q) * b * h, 2, 1)


@pytest.mark.parametrize("value", [0, 3, 12, 128, -2])
def test_dx_head_block_validation(value):
    cfg = backward.backward_config(1, 4, 1, 64, 128, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="dx_head_block"):
        replace(cfg, dx_head_block=value)


def test_dx_head_block_from_environment(monkeypatch):
    """MAMBA2_CUTILE_BWD_CONFIG selects it; the default is 1 (bwd_chunk_dx)."""
    args = (2, 80, 1, 64, 128, 256, torch.bfloat16)
    assert backward.backward_config(*args).dx_head_block == 1
    monkeypatch.setenv("MAMBA2_CUTILE_BWD_CONFIG", "dx_head_block=8")
    cfg = backward.backward_config(*args)
    assert cfg.dx_head_block == 8 and backward.dx_head_blocks(cfg, 80, 1) == 8
    monkeypatch.setenv("MAMBA2_CUTILE_BWD_CONFIG", "dx_head_block=6")
    with pytest.raises(ValueError, match="dx_head_block"):
        backward.backward_config(*args)


@pytest.mark.parametrize("hpg, block, want", [(80, 2, 2), (80, 8, 8), (80, 32, 16), (6, 4, 2),
                                              (3, 4, 1), (1, 8, 1), (16, 64, 16)])
def test_dx_head_blocks_divide_the_heads(hpg, block, want):
    cfg = replace(backward.backward_config(1, hpg, 1, 64, 128, 128, torch.bfloat16),
                  dx_head_block=block)
    assert backward.dx_head_blocks(cfg, 2 * hpg, 2) == want
