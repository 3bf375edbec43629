"""Every conv1d kernel variant the dispatcher can pick compiles for sm_90 on the CPU (tileiras,
no GPU), from the same plans the GPU path launches (on meta tensors). The forward and update
variants are cheap (1-6 s each); a backward variant takes 30-60 s on 2 cores, so only its
all-options channel-last variant runs by default, the others are marked slow
(MAMBA2_TEST_SLOW=1). Registers and spills are printed when pyelftools is installed."""

import dataclasses

import pytest
import torch

pytest.importorskip("cuda.tile")

from mamba2_cutile.conv1d import plan  # noqa: E402

META = torch.device("meta")
BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _x(b, d, l, dtype, layout):
    if layout == "channel_last":
        # a channel slice of a wider projection, as the Mamba-2 layer passes it
        return torch.empty(b, l, d + 64, dtype=dtype, device=META)[..., 32:32 + d].transpose(1, 2)
    return torch.empty(b, d, l, dtype=dtype, device=META)


def forward_call(dtype=BF, layout="channel_last", w=4, opts=("bias", "init", "seq", "silu",
                                                             "final"), int64=False, d=1600,
                 **fields):
    """The forward's launch; `fields` override the dispatcher's config (e.g. form=1)."""
    b, d, l = (1, 1536, 2**21 + 3) if int64 else (2, d, 1000)
    x = _x(b, d, l, dtype, layout)
    cl = plan.is_channel_last(x)
    out = plan.empty_like_layout(x, cl)
    cfg = dataclasses.replace(plan.conv1d_config(b, d, l, cl, width=w), **fields)
    wt = torch.empty(w, d, dtype=FP32, device=META)
    return plan.forward_plan(
        x, wt, torch.empty(d, dtype=FP32, device=META) if "bias" in opts else None,
        torch.empty(b, d, w - 1, dtype=dtype, device=META) if "init" in opts else None,
        torch.empty(b, l, dtype=torch.int32, device=META) if "seq" in opts else None,
        out, torch.empty(b, d, w - 1, dtype=dtype, device=META) if "final" in opts else None,
        "silu" in opts, cfg)[0]


def backward_call(dtype=BF, layout="channel_last", w=4, opts=("bias", "init", "seq", "silu",
                                                              "dfinal"), int64=False, d=1600,
                  **fields):
    b, d, l = (1, 1536, 2**21 + 3) if int64 else (2, d, 1000)
    x = _x(b, d, l, dtype, layout)
    cl = plan.is_channel_last(x)
    cfg = dataclasses.replace(plan.conv1d_config(b, d, l, cl, width=w), **fields)
    parts = b * plan.backward_grid(x, cfg)[1]
    init = torch.empty(b, d, w - 1, dtype=dtype, device=META) if "init" in opts else None
    return plan.backward_plan(
        x, torch.empty(w, d, dtype=FP32, device=META),
        torch.empty(d, dtype=FP32, device=META) if "bias" in opts else None, init,
        torch.empty(b, l, dtype=torch.int32, device=META) if "seq" in opts else None,
        plan.empty_like_layout(x, cl),
        torch.empty(b, d, w - 1, dtype=dtype, device=META) if "dfinal" in opts else None,
        plan.empty_like_layout(x, cl), torch.empty(parts, w, d, dtype=FP32, device=META),
        torch.empty(parts, d, dtype=FP32, device=META),
        None if init is None else torch.empty_like(init), "silu" in opts, cfg)[0]


def update_calls(dtype=BF, w=4, k=1, opts=("bias", "silu", "circular", "idx"), int64=False):
    b, d = 8, 1600
    nslots, state_len = (2**31 // (d * 4) + 1, 4) if int64 else (16, w - 1 + 2)
    x = torch.empty(b, d, k, dtype=dtype, device=META)
    state = torch.empty(nslots, d, state_len, dtype=dtype, device=META)
    return plan.update_plan(
        x, state, torch.empty(w, d, dtype=FP32, device=META),
        torch.empty(d, dtype=FP32, device=META) if "bias" in opts else None,
        torch.empty(b, dtype=torch.int32, device=META) if "circular" in opts else None,
        torch.empty(b, dtype=torch.int32, device=META) if "idx" in opts else None,
        torch.empty(b, d, k, dtype=dtype, device=META),
        torch.empty(b, d, state_len, dtype=dtype, device=META), "silu" in opts)


#: form 1 at its own tiles (the dispatcher's channel-last default is form 3's wider ones)
F1 = dict(form=1, block_d=64, bwd_block_d=64)
#: form 3 at the sweep's first candidates (kernels/causal_conv1d_*_rows.py)
ROWS = dict(form=3, block_d=256, span=512, rows=8, prefetch=1, bwd_block_d=256, bwd_span=512,
            bwd_rows=8)

FAST = [
    ("fwd-bf16-cl-all", lambda: forward_call()),
    ("fwd-fp16-contig-all", lambda: forward_call(FP16, "contiguous")),
    ("fwd-fp32-cl-none-w2", lambda: forward_call(FP32, w=2, opts=())),
    ("fwd-bf16-cl-w8-int64", lambda: forward_call(w=8, opts=("bias", "silu"), int64=True)),
    ("update-bf16-all", lambda: update_calls()[0]),
    ("state-copy-bf16", lambda: update_calls()[1]),
    ("update-fp32-plain-k4-w8", lambda: update_calls(FP32, w=8, k=4, opts=())[0]),
    ("update-bf16-int64", lambda: update_calls(int64=True)[0]),
    ("state-copy-int64", lambda: update_calls(int64=True)[1]),
    ("bwd-bf16-cl-all", lambda: backward_call()),
    # form 1 (streamed taps), at dims its tiles divide (unchecked interior blocks) and not
    ("fwd1-bf16-cl-all", lambda: forward_call(d=1536, **F1)),
    ("fwd1-bf16-cl-bias-silu-16x128", lambda: forward_call(opts=("bias", "silu"), d=1536,
                                                           **F1, block_l=16)),
    ("fwd1-bf16-cl-bias-silu-32x64", lambda: forward_call(opts=("bias", "silu"), d=1536,
                                                          **F1)),
    ("bwd1-bf16-cl-all", lambda: backward_call(d=1536, **F1)),
    ("bwd1-bf16-cl-bias-silu-partial-d", lambda: backward_call(opts=("bias", "silu"), d=1544,
                                                               **F1)),
    # form 2's forward (tap views; its backward is form 1's)
    ("fwd2-bf16-cl-all", lambda: forward_call(form=2)),
    ("fwd2-bf16-cl-bias-silu-32x64", lambda: forward_call(opts=("bias", "silu"), d=1536,
                                                          form=2, block_d=64)),
    # form 3 (row streaming): the sweep's first candidates, unchecked (block_d divides dim),
    # and all options at a partial channel block
    ("fwd3-bf16-cl-bias-silu-256-r8", lambda: forward_call(opts=("bias", "silu"), d=1536,
                                                           **ROWS)),
    ("fwd3-bf16-cl-all", lambda: forward_call(**ROWS)),
    ("bwd3-bf16-cl-bias-silu-256-r8", lambda: backward_call(opts=("bias", "silu"), d=1536,
                                                            **ROWS)),
    # the dispatcher's form 3 (automatic spans; the forward under the occupancy-8 hint:
    # 64 registers, 8 CTAs/SM; the backward under the occupancy-8 hint: 64, 8/SM) and the
    # forward without the hint
    ("fwd3-bf16-cl-bias-silu-default", lambda: forward_call(opts=("bias", "silu"), d=5376)),
    ("fwd3-bf16-cl-bias-silu-nohint", lambda: forward_call(opts=("bias", "silu"), d=5376,
                                                           ctas_hint=0)),
    ("bwd3-bf16-cl-bias-silu-default", lambda: backward_call(opts=("bias", "silu"), d=5376)),
]
SLOW = [
    ("fwd-bf16-contig-w3-seq", lambda: forward_call(layout="contiguous", w=3, opts=("seq",))),
    ("fwd-bf16-contig-w2-all", lambda: forward_call(layout="contiguous", w=2)),
    ("fwd-fp16-cl-w2-all", lambda: forward_call(FP16, w=2)),
    ("bwd-bf16-contig-all", lambda: backward_call(layout="contiguous")),
    ("bwd-fp32-cl-none-w2", lambda: backward_call(FP32, w=2, opts=())),
    ("bwd-fp16-cl-w8-silu-init", lambda: backward_call(FP16, w=8, opts=("silu", "init"))),
    ("bwd-bf16-cl-int64", lambda: backward_call(opts=("bias", "silu"), int64=True)),
    ("fwd1-fp16-contig-all", lambda: forward_call(FP16, "contiguous", d=1536, **F1)),
    ("fwd1-fp32-cl-none-w2", lambda: forward_call(FP32, w=2, opts=(), **F1)),
    ("fwd1-bf16-cl-w8-int64", lambda: forward_call(w=8, opts=("bias", "silu"), int64=True,
                                                   **F1)),
    # (at one block per program: with a loop over blocks these spill 16-40 bytes)
    ("bwd1-bf16-contig-all-tiles1", lambda: backward_call(layout="contiguous", d=1536, **F1,
                                                          bwd_tiles=1)),
    ("bwd1-fp16-cl-w8-silu-init-tiles1", lambda: backward_call(
        FP16, w=8, opts=("silu", "init"), **F1, bwd_tiles=1)),
    ("bwd1-bf16-cl-int64-tiles1", lambda: backward_call(opts=("bias", "silu"), int64=True,
                                                        **F1, bwd_tiles=1)),
    ("fwd2-fp32-cl-none-w2-tiles4", lambda: forward_call(FP32, w=2, opts=(), form=2, tiles=4)),
    ("fwd2-bf16-cl-w8-int64", lambda: forward_call(w=8, opts=("bias", "silu"), int64=True,
                                                   form=2)),
    ("fwd3-fp32-cl-none-w2", lambda: forward_call(FP32, w=2, opts=(), **ROWS)),
    # the dispatcher's form 3 where the automatic occupancy hint is left off (it spilled
    # 24 and 168 bytes there): float32, and 64-bit indexing at width 4
    ("fwd3-fp32-cl-all-default", lambda: forward_call(FP32)),
    ("fwd3-bf16-cl-all-int64-default", lambda: forward_call(int64=True)),
    ("fwd3-fp16-cl-w8-int64", lambda: forward_call(FP16, w=8, opts=("bias", "silu"),
                                                   int64=True, **ROWS)),
    ("fwd3-bf16-cl-bias-silu-512-r16", lambda: forward_call(
        opts=("bias", "silu"), d=1536, **dict(ROWS, block_d=512, rows=16))),
    ("fwd3-bf16-cl-bias-silu-row-tile", lambda: forward_call(
        opts=("bias", "silu"), d=1536, **dict(ROWS, row_tile=1))),
    ("bwd3-bf16-cl-all", lambda: backward_call(**ROWS)),
    ("bwd3-fp32-cl-w2-none", lambda: backward_call(FP32, w=2, opts=(), **ROWS)),
    ("bwd3-fp16-cl-w8-silu-init", lambda: backward_call(FP16, w=8, opts=("silu", "init"),
                                                        **ROWS)),
    ("bwd3-bf16-cl-int64", lambda: backward_call(opts=("bias", "silu"), int64=True, **ROWS)),
    ("bwd3-bf16-cl-bias-silu-row-tile", lambda: backward_call(
        opts=("bias", "silu"), d=1536, **dict(ROWS, bwd_row_tile=1))),
    ("bwd3-bf16-cl-bias-silu-128-r16", lambda: backward_call(
        opts=("bias", "silu"), d=1536, **dict(ROWS, bwd_block_d=128, bwd_rows=16))),
]


def _compile(make):
    from mamba2_cutile.bench.compile import compile_cubin
    cubin = compile_cubin(make(), "sm_90")
    assert len(cubin) > 0
    try:
        from mamba2_cutile.bench.resources import resources
    except ImportError:        # pyelftools (the dev extra) is optional
        pytest.skip("compiled; registers and spills not read: pyelftools (the dev extra) missing")
    res = resources(cubin)
    print(res)
    # the tiles were chosen so that no variant spills (conv1d.plan.conv1d_config)
    assert res["stack"] == 0, res


@pytest.mark.compile
@pytest.mark.parametrize("name,make", FAST, ids=[n for n, _ in FAST])
def test_variant_compiles(name, make):
    _compile(make)


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("name,make", SLOW, ids=[n for n, _ in SLOW])
def test_less_common_variant_compiles(name, make):
    _compile(make)


def test_row_span_is_a_runtime_argument():
    """Form 3's span is an int32 kernel argument, not a constant: every span (any multiple
    of rows) shares one compiled variant."""
    import typing
    from mamba2_cutile.bench.compile import _is_constant
    from mamba2_cutile.kernels import causal_conv1d_bwd_rows, causal_conv1d_fwd_rows
    for kern in (causal_conv1d_fwd_rows.causal_conv1d_fwd_rows,
                 causal_conv1d_bwd_rows.causal_conv1d_bwd_rows):
        hints = typing.get_type_hints(kern._annotated_function.pyfunc, include_extras=True)
        assert not _is_constant(hints["span"]) and _is_constant(hints["ROWS"])
    a, b = forward_call(**dict(ROWS, span=376)), forward_call(**dict(ROWS, span=512))
    assert a.kernel is b.kernel and a.args[8] == 376 and b.args[8] == 512


def test_int64_variants_are_picked():
    assert forward_call(int64=True).kernel is not forward_call().kernel
    assert backward_call(int64=True).kernel is not backward_call().kernel
    assert forward_call(int64=True, form=1).kernel is not forward_call(form=1).kernel
    assert backward_call(int64=True, form=1).kernel is not backward_call(form=1).kernel
    assert forward_call(int64=True, **ROWS).kernel is not forward_call(**ROWS).kernel
    assert backward_call(int64=True, **ROWS).kernel is not backward_call(**ROWS).kernel


def test_forms_pick_their_kernels():
    from mamba2_cutile.kernels import causal_conv1d_bwd_stream, causal_conv1d_fwd_stream
    assert forward_call(form=1).kernel is causal_conv1d_fwd_stream.causal_conv1d_fwd_stream
    assert backward_call(form=1).kernel is causal_conv1d_bwd_stream.causal_conv1d_bwd_stream
    assert forward_call(form=0).kernel is not forward_call(form=1).kernel
    # the dispatcher: channel-last inputs up to width 4 take form 3, wider ones form 1, the
    # contiguous layout form 0
    assert forward_call().kernel is forward_call(**ROWS).kernel
    assert backward_call().kernel is backward_call(**ROWS).kernel
    assert forward_call(w=8).kernel is forward_call(w=8, form=1).kernel
    assert plan.conv1d_config(1, 4096, 16384, False).form == 0
    from mamba2_cutile.kernels.causal_conv1d_fwd_taps import causal_conv1d_fwd_taps
    assert forward_call(form=2).kernel is causal_conv1d_fwd_taps
    # form 2 is channel-last only: the contiguous layout takes form 1's forward
    assert forward_call(layout="contiguous", form=2).kernel is \
        causal_conv1d_fwd_stream.causal_conv1d_fwd_stream
    assert backward_call(form=2).kernel is causal_conv1d_bwd_stream.causal_conv1d_bwd_stream
    # form 1's UNCHECKED (its last argument but one) only where the channel tiles divide dim
    assert forward_call(d=1536, form=1).args[-2] is plan.unchecked_supported()
    assert forward_call(d=1544, form=1).args[-2] is False
    assert backward_call(d=1536, form=1, unchecked=0).args[-2] is False
    assert update_calls(int64=True)[0].kernel is not update_calls()[0].kernel
    # form 3: the row kernels for channel-last x, form 1's for the contiguous layout; its
    # UNCHECKED (the last argument) only where the channel tiles divide dim; SiLU mode 2
    # (approximate sigmoid) for 16-bit inputs, 1 (IEEE) for float32
    from mamba2_cutile.kernels import causal_conv1d_bwd_rows, causal_conv1d_fwd_rows
    from mamba2_cutile.runtime import with_hints
    # (the forward under its automatic occupancy hint, ctas_per_sm = 8)
    assert forward_call(**ROWS).kernel is with_hints(
        causal_conv1d_fwd_rows.causal_conv1d_fwd_rows, 8, 0)
    assert forward_call(**ROWS, ctas_hint=0).kernel is \
        causal_conv1d_fwd_rows.causal_conv1d_fwd_rows
    assert backward_call(**ROWS).kernel is causal_conv1d_bwd_rows.causal_conv1d_bwd_rows
    assert forward_call(layout="contiguous", **ROWS).kernel is \
        causal_conv1d_fwd_stream.causal_conv1d_fwd_stream
    assert backward_call(layout="contiguous", **ROWS).kernel is \
        causal_conv1d_bwd_stream.causal_conv1d_bwd_stream
    # (the arguments end with SILU, HAS_FINAL, ROW_TILE, UNCHECKED, PREFETCH)
    assert forward_call(d=1536, **ROWS).args[-2] is plan.unchecked_supported()
    assert forward_call(d=1600, **ROWS).args[-2] is False
    assert backward_call(d=1536, **dict(ROWS, unchecked=0)).args[-2] is False
    assert forward_call(**ROWS).args[-1] is True and \
        backward_call(**ROWS).args[-1] is False           # prefetch, bwd_prefetch
    silu_arg = -5
    assert forward_call(**ROWS).args[silu_arg] == 2
    assert forward_call(FP32, **ROWS).args[silu_arg] == 1
    assert forward_call(opts=("bias",), **ROWS).args[silu_arg] == 0


def test_default_config_and_env(monkeypatch):
    cfg = plan.conv1d_config(1, 4096, 16384, True)
    assert (cfg.form, cfg.block_d, cfg.rows, cfg.prefetch, cfg.span) == (3, 256, 8, 0, 0)
    assert (cfg.bwd_block_d, cfg.bwd_rows, cfg.bwd_prefetch, cfg.bwd_span) == (256, 8, 0, 0)
    assert cfg.bwd_ctas_per_sm == 7
    # 256 channels only where they divide dim (unchecked rows)
    cfg = plan.conv1d_config(1, 4000, 16384, True)
    assert (cfg.bwd_block_d, cfg.bwd_ctas_per_sm) == (128, 8)
    cfg = plan.conv1d_config(1, 4096, 16384, True, width=5)
    assert (cfg.block_l, cfg.block_d, cfg.form) == (16, 64, 1) and cfg.bwd_tiles == 8
    assert plan.conv1d_config(1, 64, 64, True).bwd_tiles == 1   # few blocks: one per program
    assert plan.conv1d_config(1, 4096, 16384, True, width=8).bwd_block_l == 8
    monkeypatch.setenv(plan.ENV_CONV1D, "block_l=64,shift_tma=1")
    cfg = plan.conv1d_config(1, 4096, 16384, True)
    assert (cfg.block_l, cfg.shift_tma) == (64, 1)
    monkeypatch.setenv(plan.ENV_CONV1D, "block_l=4")
    with pytest.raises(ValueError, match="block_l"):
        plan.conv1d_config(1, 4096, 16384, True)
    monkeypatch.setenv(plan.ENV_CONV1D, "form=1,bwd_tiles=4,bwd_occupancy=2,warps=4")
    cfg = plan.conv1d_config(1, 4096, 16384, True)
    assert (cfg.form, cfg.bwd_tiles, cfg.bwd_occupancy, cfg.warps) == (1, 4, 2, 4)
    for bad in ("form=5", "warps=2", "unchecked=2", "store_tma=5", "form=1,block_d=512"):
        monkeypatch.setenv(plan.ENV_CONV1D, bad)
        with pytest.raises(ValueError, match=bad.split("=")[-2].split(",")[-1]):
            plan.conv1d_config(1, 4096, 16384, True)
    monkeypatch.setenv(plan.ENV_CONV1D, "nonsense=1")
    with pytest.raises(ValueError, match=plan.ENV_CONV1D):
        plan.conv1d_config(1, 4096, 16384, True)


def test_layouts():
    proj = torch.empty(2, 100, 300)
    x = proj[..., 10:110].transpose(1, 2)
    assert plan.kernel_layout(x) == (x, True)
    c = torch.empty(2, 100, 50)
    assert plan.kernel_layout(c)[1] is False
    odd = torch.empty(2, 50, 100, 3)[..., 0].transpose(1, 2)     # no unit stride: copied
    y, cl = plan.kernel_layout(odd)
    assert y.is_contiguous() and cl is False
