"""CPU: the backward's plans on `meta` tensors: grid limits and 64-bit variants (their compiles
are in test_ssd_compile.py); BackwardConfig refuses the fields it no longer has."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("cuda.tile")

from mamba2_cutile.bench import plans  # noqa: E402
from mamba2_cutile.ssd import backward  # noqa: E402


@pytest.mark.parametrize("problem, overrides", [
    (dict(batch=600, seqlen=3, nheads=128, headdim=4, dstate=16, chunk_size=64), {}),
    # the head splits' dB/dC partials: one sum_partials row per token (B * L rows)
    (dict(batch=8, seqlen=8192, nheads=80, chunk_size=256), dict(dcb_head_split=2)),
    (dict(batch=1, seqlen=65536 + 7, nheads=64, chunk_size=256), dict(dcb_head_split=4)),
    (dict(batch=8, seqlen=8192, nheads=80, chunk_size=256),
     dict(bc_fused=1, da_mode=1, bc_head_split=2)),
], ids=["batch-heads", "dcb-split-B8", "dcb-split-64K", "fused-split-B8"])
def test_plan_grids_respect_cuda_limits(problem, overrides):
    """Axes 1 and 2 of every grid stay within 65535, also for huge batch * heads and for the
    head splits' sums over B * L rows."""
    calls = plans.backward_problem_plan(overrides=overrides, **problem)
    for call in calls:
        assert all(1 <= g for g in call.grid)
        assert all(g <= 65535 for g in call.grid[1:])
        assert call.grid[0] < 2**31
    if overrides:
        assert "sum_partials_fn" in [_name(c) for c in calls]


@pytest.mark.parametrize("overrides", [dict(), dict(da_mode=2, bc_fused=1),
                                       dict(bc_fused=0, da_mode=0)],
                         ids=["default", "da_mode2", "unfused"])
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


#: options that were removed after the H200 measured them slower at every shape (S = C B^T
#: precomputed for bwd_chunk_dx, several heads per dx program; the fused dB/dC head split
#: came back on 2026-12-03 for short sequences): a config naming one must be refused
REMOVED_FIELDS = ("dx_cb", "dx_head_block")


@pytest.mark.parametrize("name", REMOVED_FIELDS)
def test_removed_fields_are_refused(name, monkeypatch):
    """MAMBA2_CUTILE_BWD_CONFIG="<name>=1" raises the config system's unknown-field error
    naming the field (and the variable), as does a config string parsed for BackwardConfig;
    the field is not listed among the ones the error offers."""
    from mamba2_cutile import config

    args = (2, 80, 1, 64, 128, 256, torch.bfloat16)
    monkeypatch.setenv(config.ENV_BACKWARD, f"{name}=1")
    with pytest.raises(ValueError, match=f"{config.ENV_BACKWARD}: unknown field '{name}'") as e:
        backward.backward_config(*args)
    listed = str(e.value).split("fields of BackwardConfig: ")[1].rstrip(")").split(", ")
    assert "lowp" in listed and name not in listed
    with pytest.raises(ValueError, match=f"unknown field '{name}'"):
        config.parse_overrides(backward.BackwardConfig, f"lowp=1,{name}=1", "test")
    monkeypatch.delenv(config.ENV_BACKWARD)
    with pytest.raises(TypeError, match=name):
        replace(backward.backward_config(*args), **{name: 1})


def _name(call):
    return call.kernel._annotated_function.pyfunc.__name__


@pytest.mark.parametrize("b,l,h,g,fused,splits", [
    (1, 512, 24, 1, 1, 12), (1, 512, 7, 1, 1, 7), (1, 1000, 24, 1, 2, 8), (1, 1024, 80, 1, 2, 8),
    (1, 1408, 64, 1, 2, 4), (1, 1409, 64, 1, 2, 4), (1, 2048, 64, 1, 2, 4),
    (1, 2049, 64, 1, 2, 1), (1, 4096, 64, 1, 2, 1), (1, 512, 128, 8, 2, 1),
    (2, 8192, 80, 1, 2, 1), (4, 16384, 8, 1, 2, 1)])
def test_dispatcher_head_split(b, l, h, g, fused, splits):
    """Where the fused dB/dC launch would have at most 8 programs (chunks x n-tiles x batch x
    groups; chunk 128, two n-tiles) the dispatcher splits each group's heads over up to
    SMs / programs programs (the largest divisor of the heads per group); the launch's third
    grid axis is the split, it writes (splits, B, L, G, N) fp32 partials, and one
    sum_partials launch adds them into dB and dC (before bwd_chunk_dx). Longer sequences
    take dB and dC through the groups' C B^T gradient (bc_fused 2: bwd_chunk_dcb, then
    bwd_chunk_dbc_group), with the decay gradient's W terms from bwd_chunk_dcb (da_mode 3);
    from 9 to 32 programs with the heads split over the most programs (a power of two <= 8)
    whose grid stays within one per SM, its partials summed by sum_partials."""
    cfg = backward.backward_config(b, h, g, 64, 128, 256, torch.bfloat16, 132, seqlen=l)
    assert cfg.bc_fused == fused and backward.head_splits(cfg, h, g) == splits
    calls = plans.backward_problem_plan(batch=b, seqlen=l, nheads=h, ngroups=g,
                                        chunk_size=256)
    names = [_name(c) for c in calls]
    assert "sum_partials_fn" in names if splits > 1 else "sum_partials_fn" not in names
    if fused == 2:
        assert cfg.da_mode == 3 and "bwd_chunk_dbc_fused_fn" not in names
        i = names.index("bwd_chunk_dcb_fn")
        assert names[i + 1] == "bwd_chunk_dbc_group_fn"
        dbc = calls[i + 1]
        if splits == 1:
            assert dbc.args[11].dtype == torch.bfloat16     # dB, written directly
        else:
            assert dbc.args[11].shape == (splits * b, l, g, 128)
            assert names[i + 2] == "sum_partials_fn"
        return
    assert cfg.da_mode == 1
    dbc = calls[names.index("bwd_chunk_dbc_fused_fn")]
    assert dbc.grid[2] == splits
    assert dbc.args[10].shape == (splits, b, l, g, 128)
    assert dbc.args[10].dtype == torch.float32
    assert names[names.index("bwd_chunk_dbc_fused_fn") + 1] == "sum_partials_fn"


@pytest.mark.parametrize("b,l,h,g,side", [
    (2, 8192, 24, 1, 2), (2, 8192, 32, 1, 2), (2, 8192, 33, 1, 2), (2, 8192, 34, 1, 0), (2, 8192, 80, 1, 0),
    (4, 16384, 8, 1, 2), (2, 8192, 128, 8, 0), (1, 512, 24, 1, 2)])
def test_dispatcher_side_streams(b, l, h, g, side):
    """The reverse state pass goes on a side stream beside the recompute of the states
    (side_streams=2) where its grid (batch x heads, the whole 64 x 128 state a program) is at
    most half the SMs; in the plan it follows the recompute, marked for stream 1."""
    cfg = backward.backward_config(b, h, g, 64, 128, 256, torch.bfloat16, 132, seqlen=l)
    assert cfg.side_streams == side
    calls = plans.backward_problem_plan(batch=b, seqlen=l, nheads=h, ngroups=g, chunk_size=256)
    names = [_name(c) for c in calls]
    rev = calls[names.index("bwd_state_pass_fn")]
    assert rev.grid[0] * rev.grid[1] * rev.grid[2] == b * h
    assert rev.stream == (1 if side else 0)


def test_head_split_needs_the_fused_launch():
    cfg = backward.backward_config(1, 24, 1, 64, 128, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="bc_head_split=2 needs bc_fused=1"):
        replace(cfg, bc_fused=0, da_mode=0, bc_head_split=2)
    with pytest.raises(ValueError, match="dcb_head_split=2 needs bc_fused=2"):
        replace(cfg, bc_fused=1, da_mode=1, bc_head_split=1, dcb_head_split=2)


@pytest.mark.parametrize("split, splits", [(4, 4), (6, 4), (64, 64), (1, 1)])
def test_dcb_head_split_plan(split, splits):
    """dcb_head_split (bc_fused 2): the dS launch's grid and dS memory grow by the split
    (one dS per split), bwd_chunk_dbc_group writes (splits * B, L, G, N) fp32 partials, and
    sum_partials adds them into dB and dC right after it; without a split dB and dC are
    written directly, no sum launch."""
    b, l, h, g = 1, 2048, 64, 1
    base = plans.backward_problem_plan(batch=b, seqlen=l, nheads=h, ngroups=g, chunk_size=256,
                                       overrides=dict(dcb_head_split=1))
    calls = plans.backward_problem_plan(batch=b, seqlen=l, nheads=h, ngroups=g, chunk_size=256,
                                        overrides=dict(dcb_head_split=split))
    names = [_name(c) for c in calls]
    i = names.index("bwd_chunk_dcb_fn")
    j = [_name(c) for c in base].index("bwd_chunk_dcb_fn")
    assert calls[i].grid[0] == base[j].grid[0] * splits
    assert calls[i].args[8].shape[0] == splits * b                      # dS per split
    assert names[i + 1] == "bwd_chunk_dbc_group_fn"
    dbc = calls[i + 1]
    assert dbc.grid[0] == base[j + 1].grid[0] * splits
    if splits == 1:
        assert "sum_partials_fn" not in names and dbc.args[11].dtype == torch.bfloat16
        return
    assert dbc.args[11].shape == (splits * b, l, g, 128) and dbc.args[11].dtype == torch.float32
    assert names[i + 2] == "sum_partials_fn"


@pytest.mark.parametrize("b,l,h,g,p,n", [(2, 8192, 80, 1, 64, 128), (2, 8192, 128, 8, 64, 128),
                                         (1, 300, 3, 1, 40, 24)])
@pytest.mark.parametrize("d_dim", [0, 1, 2])
def test_dcb_shares_the_dx_partials_memory(b, l, h, g, p, n, d_dim):
    """bc_fused 2's dS (written and read by the dB/dC launches) and bwd_chunk_dx's partials
    (written after them, read by bwd_dt and the host's sums) share one fp32 block of the larger
    size; the dB/dC launches run before bwd_chunk_dx, which runs before bwd_dt. A D of shape
    (H,) gets its partials summed over each p-tile: (cdiv(L, dx_block_q), B, H, n_pt)."""
    cfg = replace(backward.backward_config(b, h, g, p, n, 256, torch.bfloat16),
                  bc_fused=2, da_mode=1)
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    x, dt = e(b, l, h, p), e(b, l, h, dt=torch.float32)
    B = e(b, l, g, n)
    D = None if d_dim == 0 else e(*((h,) if d_dim == 1 else (h, p)), dt=torch.float32)
    bufs = backward.allocate_buffers(x, dt, B, B, None, D, None, cfg)
    Q, lp = cfg.chunk_size, -(-l // cfg.chunk_size) * cfg.chunk_size
    n_pt, n_q = -(-p // cfg.dx_block_p), -(-l // cfg.dx_block_q)
    parts = [bufs.da_part, bufs.ddt_part] + ([] if D is None else [bufs.dD_part])
    block = bufs.dcb._base
    assert block is not None and all(t._base is block for t in parts)
    assert bufs.dcb.shape == (b, g, lp, Q) and bufs.dcb.storage_offset() == 0
    pad = lambda k: -(-k // 64) * 64  # noqa: E731
    assert block.numel() == max(b * g * lp * Q, sum(pad(t.numel()) for t in parts))
    # the partials tile the block in order, each 64 elements (256 bytes) aligned, disjoint
    at = 0
    for t in parts:
        assert t.storage_offset() == at and t.is_contiguous()
        at += pad(t.numel())
    if D is not None:
        assert bufs.dD_part.shape == (n_q, b, h, n_pt if d_dim == 1 else p)
    calls = []
    xk = torch.empty((b, l, h, p), dtype=torch.bfloat16, device="meta")
    backward.run_backward(xk, dt, e(h, dt=torch.float32), B, B, 256, xk, D=D,
                          launch_fn=calls.extend, config=cfg)
    names = [_name(c) for c in calls]
    assert (names.index("bwd_chunk_dcb_fn") < names.index("bwd_chunk_dbc_group_fn")
            < names.index("bwd_chunk_dx_fn") < names.index("bwd_dt_fn"))


@pytest.mark.parametrize("over, ok", [(dict(da_mode=3, bc_fused=2), True),
                                      (dict(da_mode=3, bc_fused=1), False),
                                      (dict(da_mode=2, bc_fused=2), False),
                                      (dict(da_mode=4, bc_fused=2), False)])
def test_da_mode_needs_its_dbc_launch(over, ok):
    """da_mode 2 takes its W terms from the fused dB/dC launch (bc_fused 1), 3 from
    bwd_chunk_dcb (bc_fused 2); any other pairing is refused, naming the field."""
    cfg = backward.backward_config(2, 80, 1, 64, 128, 256, torch.bfloat16)
    if ok:
        assert replace(cfg, **over).da_mode == over["da_mode"]
    else:
        with pytest.raises(ValueError, match=f"da_mode={over['da_mode']} must be"):
            replace(cfg, **over)


@pytest.mark.parametrize("spec, want", [
    ("bc_fused=1", (1, 1)), ("bc_fused=0", (0, 1)), ("bc_head_split=2,bc_fused=1", (1, 1)),
    ("bc_fused=2", (2, 3)), ("bc_fused=2,da_mode=1", (2, 1)), ("da_mode=1", (2, 1)),
    ("bc_fused=1,da_mode=2", (1, 2))])
@pytest.mark.parametrize("seqlen", [256, 8192])
def test_bc_fused_override_takes_its_da_mode(spec, want, seqlen, monkeypatch):
    """MAMBA2_CUTILE_BWD_CONFIG naming bc_fused but not da_mode works at every sequence
    length: where the rule's da_mode or head split needs the dB/dC launch being replaced
    (da_mode 3 with bc_fused 2, a split with 1), da_mode 1 and no split come with it. Short
    sequences start from bc_fused 1, da_mode 1 and a head split, long ones from bc_fused 2,
    da_mode 3."""
    from mamba2_cutile import config

    monkeypatch.setenv(config.ENV_BACKWARD, spec)
    cfg = backward.backward_config(2, 80, 1, 64, 128, 256, torch.bfloat16, 132, seqlen=seqlen)
    if seqlen == 256 and spec in ("bc_fused=2", "da_mode=1"):
        want = (2, 1) if spec == "bc_fused=2" else (1, 1)     # from bc_fused 1, da_mode 1
    assert (cfg.bc_fused, cfg.da_mode) == want
    if "bc_head_split" in spec:
        assert cfg.bc_head_split == 2
    else:
        assert cfg.bc_head_split == 1 or (seqlen == 256 and cfg.bc_fused == 1)


@pytest.mark.parametrize("spec, seqlen, want", [
    ("bc_head_split=4", 1024, (1, 1, 4, 1, 32)),    # the dS rule: the fused launch named
    ("da_mode=2", 1024, (1, 2, 1, 1, 32)),
    ("dcb_head_split=4", 512, (2, 1, 1, 4, 32)),    # the head-split rule: the dS launch named
    ("da_mode=3", 512, (2, 3, 1, 1, 32)),
    ("bc_head_split=4", 512, (1, 1, 4, 1, 32)),     # already the rule's launch
    ("dcb_head_split=2", 1024, (2, 3, 1, 2, 64))])
def test_split_override_names_its_launch(spec, seqlen, want, monkeypatch):
    """MAMBA2_CUTILE_BWD_CONFIG naming a head split or da_mode without bc_fused works at every
    sequence length: it brings the dB/dC launch it needs (bc_head_split > 1 and da_mode 2:
    bc_fused 1; dcb_head_split > 1 and da_mode 3: bc_fused 2) and resets the rule's choices
    that need the other one. (bc_fused, da_mode, bc_head_split, dcb_head_split,
    dx_block_p); B=1, 64 heads, 1 group, chunk 256."""
    from mamba2_cutile import config

    monkeypatch.setenv(config.ENV_BACKWARD, spec)
    cfg = backward.backward_config(1, 64, 1, 64, 128, 256, torch.bfloat16, 132, seqlen=seqlen)
    assert (cfg.bc_fused, cfg.da_mode, cfg.bc_head_split, cfg.dcb_head_split,
            cfg.dx_block_p) == want


@pytest.mark.parametrize("fused, kept", [(2, 4), (1, 1), (0, 1)])
def test_bc_fused_override_drops_a_dcb_head_split(fused, kept):
    """A config carrying dcb_head_split (bc_fused 2) that an override moves to bc_fused 1 or
    0 loses the split (it needs the bc_fused-2 launches) with da_mode 3, instead of being
    refused; kept at bc_fused 2."""
    cfg = replace(backward.backward_config(2, 80, 1, 64, 128, 256, torch.bfloat16, 132,
                                           seqlen=8192), dcb_head_split=4)
    over = cfg.paired_overrides({"bc_fused": fused})
    got = replace(cfg, **over)
    assert got.dcb_head_split == kept and got.bc_fused == fused
    assert got.da_mode == (3 if fused == 2 else 1)
    with pytest.raises(ValueError, match="dcb_head_split=4 needs bc_fused=2"):
        replace(cfg, bc_fused=1, da_mode=1)


def test_da_mode_named_with_the_wrong_launch_is_refused(monkeypatch):
    from mamba2_cutile import config

    monkeypatch.setenv(config.ENV_BACKWARD, "bc_fused=1,da_mode=3")
    with pytest.raises(ValueError, match=f"{config.ENV_BACKWARD}: .*da_mode=3 must be"):
        backward.backward_config(2, 80, 1, 64, 128, 256, torch.bfloat16, 132, seqlen=8192)


@pytest.mark.parametrize("b,l,h,g,p,n", [(2, 8192, 80, 1, 64, 128), (2, 8192, 48, 1, 128, 128),
                                         (1, 300, 3, 1, 40, 24)])
def test_da_mode3_buffers(b, l, h, g, p, n):
    """da_mode 3: da_part, which bwd_chunk_dcb writes beside dS, has its own memory,
    max(Q / bc_block_q, n_pt) slots; v_part holds one number per bwd_chunk_dx program and
    shares the block of dS with ddt_part and dD_part; bwd_chunk_dcb gets da_part and its W
    flag, bwd_chunk_dx the slot count."""
    base = replace(backward.backward_config(b, h, g, p, n, 256, torch.bfloat16), bc_fused=2,
                   da_mode=1, bc_block_q=32)
    cfg = replace(base, da_mode=3)
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    x, dt, B, D = e(b, l, h, p), e(b, l, h, dt=torch.float32), e(b, l, g, n), e(h, dt=torch.float32)
    bufs = backward.allocate_buffers(x, dt, B, B, None, D, None, cfg)
    Q, lp = cfg.chunk_size, -(-l // cfg.chunk_size) * cfg.chunk_size
    n_pt, nc = -(-p // cfg.dx_block_p), -(-l // cfg.chunk_size)
    assert bufs.da_part._base is None
    assert bufs.da_part.shape == (max(Q // 32, n_pt), b, h, lp)
    assert bufs.v_part.shape == (n_pt, b, h, nc * (Q // cfg.dx_block_q))
    block = bufs.dcb._base
    assert all(t._base is block for t in (bufs.v_part, bufs.ddt_part, bufs.dD_part))
    assert all(t.storage_offset() % 64 == 0 for t in (bufs.v_part, bufs.ddt_part, bufs.dD_part))

    def scratch(c):
        u = backward.allocate_buffers(x, dt, B, B, None, D, None, c)
        return u.dcb._base.numel() + (u.da_part.numel() if u.da_part._base is None else 0)
    # at model shapes (many heads: dS smaller than the partials) one v_part number per dx
    # program more, and at 4 p-tiles half of da_mode 1's da slots fewer; headdim 128 in two
    # 64-channel dx programs: as many da slots as da_mode 1 (Q / 32 = n_pt * Q / dx_block_q),
    # and dS's block 10.5% larger
    # (headdim 64 against 32-channel programs: the dispatcher's 64-channel ones write fewer
    # partials still)
    if h >= 48:
        narrow = replace(cfg, dx_block_p=32) if p == 64 else cfg
        assert scratch(narrow) <= scratch(replace(narrow, da_mode=1)) * (
            0.75 if -(-p // narrow.dx_block_p) > 2 else 1.11 if narrow.dx_block_p == 64
            else 1.01)
        if p == 64:
            assert scratch(cfg) < scratch(narrow)
    calls = []
    backward.run_backward(x, dt, e(h, dt=torch.float32), B, B, 256, x, D=D,
                          launch_fn=calls.extend, config=cfg)
    names = [_name(c) for c in calls]
    dcb, dx = calls[names.index("bwd_chunk_dcb_fn")], calls[names.index("bwd_chunk_dx_fn")]
    assert dcb.args[-2] is True and dcb.args[9].shape == bufs.da_part.shape
    assert dx.args[-2] == Q // 32


@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_recompute_at_the_backwards_chunk(chunk):
    """The recompute launches run at the backward's chunk (BackwardConfig.chunk_size, e.g.
    MAMBA2_CUTILE_BWD_CONFIG=chunk_size=256), not at the chunk the forward's rule would
    compute a call of that length with (128 for a long bf16 chunk-256 call): its buffers are
    sized at the backward's chunk."""
    from support.variants import kernel_arg
    b, l, h, g, p, n = 2, 8192, 80, 1, 64, 128
    cfg = replace(backward.backward_config(b, h, g, p, n, 256, torch.bfloat16, seqlen=l),
                  chunk_size=chunk, dx_block_q=min(64, chunk), bc_block_q=min(32, chunk))
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    x, dt, B = e(b, l, h, p), e(b, l, h, dt=torch.float32), e(b, l, g, n)
    assert backward.recompute_config(cfg, x, B).chunk_size == chunk
    calls = []
    backward.run_backward(x, dt, e(h, dt=torch.float32), B, B, 256, x, launch_fn=calls.extend,
                          config=cfg)
    state = next(c for c in calls if _name(c) == "chunk_state_pass_fn")
    assert kernel_arg(state, "Q") == chunk
    assert kernel_arg(state, "cum").shape[2] == -(-l // chunk) * chunk
    assert kernel_arg(state, "states").shape[2] == -(-l // chunk)


@pytest.mark.parametrize("has_z", [False, True])
def test_dispatcher_dx_tiles_follow_z(has_z):
    """The public path (`run_backward` with no config) hands the dispatcher the sequence length
    and whether z is given: at 2 x 8000 tokens of 8 heads of 64 (da_mode 3) bwd_chunk_dx runs
    one 64-channel, 4-warp program per token block without z, two 32-channel ones with z."""
    b, l, h, g, p, n = 2, 8000, 8, 1, 64, 128
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    x, B = e(b, l, h, p), e(b, l, g, n)
    calls = []
    backward.run_backward(x, e(b, l, h, dt=torch.float32), e(h, dt=torch.float32), B, B, 256,
                          x, D=e(h, dt=torch.float32), z=x if has_z else None,
                          launch_fn=calls.extend, sms=132)
    dx = calls[[_name(c) for c in calls].index("bwd_chunk_dx_fn")]
    assert dx.grid[1] == (2 if has_z else 1)
    assert dx.args[19] == (32 if has_z else 64)        # BLOCK_P
