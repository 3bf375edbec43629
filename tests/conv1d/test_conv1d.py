"""Causal conv1d on the CPU: the PyTorch path against the float64 definition
(`reference.conv1d`, itself checked against F.conv1d), its gradients (gradcheck in float64 and
against the reference's autograd), the decode update against the forward on the concatenated
sequence, argument errors, the custom ops under torch.compile, and the cuTile kernels' own
source run on the float64 emulation (`conv1d_emulator`) against the reference."""

import dataclasses
import math

import pytest
import torch
from support.grads import DOUBLE_BACKWARD
import torch.nn.functional as F

from mamba2_cutile.conv1d import causal_conv1d_fn, causal_conv1d_update, plan
from mamba2_cutile.conv1d.api import UnsupportedActivation
from mamba2_cutile.reference.conv1d import causal_conv1d_ref, causal_conv1d_update_ref

F64 = torch.float64
#: float32 path vs float64 definition (relative to max|ref|): measured at most 1.6e-7 on the
#: outputs and 3.4e-7 on the gradients (CPU, 2026-12-01); about 4x that
TOL_F32 = 1.5e-6


def make_x(b, d, l, layout, dtype=F64, gen=None, extra=5):
    """x (b, d, l): contiguous, or a channel slice of a wider (b, l, d + 2 * extra) projection
    viewed channel-last (stride(1) == 1, stride(2) == d + 2 * extra)."""
    if layout == "contiguous":
        return torch.randn(b, d, l, dtype=dtype, generator=gen)
    proj = torch.randn(b, l, d + 2 * extra, dtype=dtype, generator=gen)
    return proj[..., extra:extra + d].transpose(1, 2)


def make_seq_idx(b, l):
    """Boundaries inside the sequence, at token 1, at the last token, one-token sequences,
    padding (negative ids) at the start of a row, gaps in the ids."""
    seq = torch.zeros(b, l, dtype=torch.int32)
    cuts = ([1, 5, 6, l // 2, l - 1], [3, 4, l // 3])
    for r in range(b):
        seq[r] = 3 * r
        for k, pos in enumerate(cuts[r % 2]):
            if 0 < pos < l:
                seq[r, pos:] = 3 * r + 2 * (k + 1)
    if b > 1:
        seq[1, :2] = -1
    return seq


def problem(b=2, d=7, l=29, w=4, layout="contiguous", bias=True, init=False, seq=False,
            seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    x = make_x(b, d, l, layout, dtype, gen)
    weight = torch.randn(d, w, dtype=dtype, generator=gen)
    kw = dict(bias=torch.randn(d, dtype=dtype, generator=gen) if bias else None,
              initial_states=torch.randn(b, d, w - 1, dtype=dtype, generator=gen) if init
              else None,
              seq_idx=make_seq_idx(b, l) if seq else None)
    return x, weight, kw


def test_reference_is_f_conv1d():
    """The definition agrees with F.conv1d on the padded input (no seq_idx)."""
    x, w, kw = problem(init=True)
    out, final = causal_conv1d_ref(x, w, kw["bias"], None, kw["initial_states"])
    padded = torch.cat([kw["initial_states"], x], -1)
    want = F.conv1d(padded, w.unsqueeze(1), kw["bias"], groups=x.shape[1])
    assert torch.equal(out, want) or (out - want).abs().max() < 1e-13
    assert torch.equal(final, padded[..., -3:])


@pytest.mark.parametrize("w", range(2, 9))
@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("opts", ["plain", "bias_silu", "init_seq_swish"])
def test_forward_matches_reference(w, layout, opts):
    x, weight, kw = problem(d=9, l=23, w=w, layout=layout, bias=opts != "plain",
                            init="init" in opts, seq="seq" in opts, seed=w)
    act = {"plain": None, "bias_silu": "silu", "init_seq_swish": "swish"}[opts]
    x32, w32 = x.float(), weight.float()
    kw32 = {k: (v.float() if v is not None and v.is_floating_point() else v)
            for k, v in kw.items()}
    out, final = causal_conv1d_fn(x32, w32, return_final_states=True, activation=act, **kw32)
    ref, ref_final = causal_conv1d_ref(x, weight, kw["bias"], kw["seq_idx"],
                                       kw["initial_states"], act)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert (out.double() - ref).abs().max() <= TOL_F32 * ref.abs().max()
    assert torch.equal(final.double(), ref_final.float().double())


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
def test_output_layout_follows_x(layout):
    x, w, kw = problem(layout=layout)
    out = causal_conv1d_fn(x, w, **kw)
    if layout == "channel_last":
        assert out.stride(1) == 1 and out.transpose(1, 2).is_contiguous()
    else:
        assert out.is_contiguous()


def test_float64_path_is_exact_enough():
    x, w, kw = problem(init=True, seq=True)
    out = causal_conv1d_fn(x, w, activation="silu", **kw)
    ref, _ = causal_conv1d_ref(x, w, kw["bias"], kw["seq_idx"], kw["initial_states"], "silu")
    assert (out - ref).abs().max() < 1e-13


def test_seq_idx_isolates_sequences():
    """Each packed sequence equals the conv of that sequence alone (padding tokens 0); the
    first one also sees initial_states."""
    x, w, kw = problem(b=2, l=31, init=True, seq=True)
    out = causal_conv1d_fn(x, w, activation="silu", **kw)
    for r in range(2):
        ids = kw["seq_idx"][r]
        for sid in ids.unique().tolist():
            pos = (ids == sid).nonzero().flatten()
            a, e = int(pos[0]), int(pos[-1]) + 1
            first = a == 0
            alone = causal_conv1d_fn(x[r:r + 1, :, a:e], w, bias=kw["bias"],
                                     initial_states=kw["initial_states"][r:r + 1]
                                     if first else None, activation="silu")
            want = alone if sid >= 0 else torch.zeros_like(alone)
            assert (out[r:r + 1, :, a:e] - want).abs().max() < 1e-13


def test_final_states_semantics():
    """Without seq_idx: the last W-1 inputs (initial states shifted in when seqlen < W-1);
    with: the last W-1 inputs of the row's last sequence, zero-padded; written into
    final_states_out when given."""
    x, w, kw = problem(l=2, w=5, init=True)
    _, final = causal_conv1d_fn(x, w, initial_states=kw["initial_states"],
                                return_final_states=True)
    assert torch.equal(final, torch.cat([kw["initial_states"][..., 2:], x], -1))
    x, w, kw = problem(l=12, w=4)
    seq = torch.tensor([[0] * 10 + [1] * 2, [0] * 12], dtype=torch.int32)
    out_buf = torch.full((2, 7, 3), 7.0, dtype=F64)
    _, final = causal_conv1d_fn(x, w, seq_idx=seq, return_final_states=True,
                                final_states_out=out_buf)
    assert final is out_buf
    assert torch.equal(final[0], torch.cat([torch.zeros(7, 1, dtype=F64), x[0, :, 10:]], -1))
    assert torch.equal(final[1], x[1, :, 9:])


def test_autograd_gradcheck_float64():
    x, w, kw = problem(b=2, d=3, l=9, w=4, init=True, seq=True)
    seq = kw["seq_idx"]
    ins = [t.clone().requires_grad_() for t in (x, w, kw["bias"], kw["initial_states"])]

    def f(x_, w_, b_, h_):
        out, final = causal_conv1d_fn(x_, w_, b_, seq_idx=seq, initial_states=h_,
                                      return_final_states=True, activation="silu")
        return out, final

    assert torch.autograd.gradcheck(f, ins)


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("w,seq,init", [(2, False, False), (4, True, True), (7, True, False),
                                        (8, False, True)])
def test_gradients_match_reference_autograd(layout, w, seq, init):
    x, weight, kw = problem(d=6, l=21, w=w, layout=layout, init=init, seq=seq, seed=w)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(x.shape, dtype=F64, generator=gen)
    dfinal = torch.randn(x.shape[0], x.shape[1], w - 1, dtype=F64, generator=gen)

    def grads(fn, cast):
        leaves = [cast(t).clone().requires_grad_() for t in (x, weight, kw["bias"])]
        h = None if kw["initial_states"] is None else \
            cast(kw["initial_states"]).clone().requires_grad_()
        out, final = fn(leaves[0], leaves[1], leaves[2], h)
        loss = (out.double() * dout).sum() + (final.double() * dfinal).sum()
        return torch.autograd.grad(loss, leaves + ([h] if h is not None else []))

    ours = grads(lambda a, b_, c, h: causal_conv1d_fn(
        a, b_, c, seq_idx=kw["seq_idx"], initial_states=h, return_final_states=True,
        activation="silu"), lambda t: t.float())
    ref = grads(lambda a, b_, c, h: causal_conv1d_ref(a, b_, c, kw["seq_idx"], h, "silu"),
                lambda t: t)
    for g, r in zip(ours, ref):
        assert (g.double() - r).abs().max() <= TOL_F32 * max(1.0, float(r.abs().max()))


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
def test_gradients_without_bias_or_initial_states(layout):
    """The backward op's absent gradients are distinct empty tensors (custom-op outputs may
    not alias); through autograd and through the op directly under opcheck."""
    x, w, _ = problem(layout=layout, bias=False)
    xs, ws = x.float().requires_grad_(), w.float().requires_grad_()
    got = torch.autograd.grad(causal_conv1d_fn(xs, ws, activation="silu").square().sum(),
                              (xs, ws))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad(causal_conv1d_ref(xr, wr, activation="silu")[0].square().sum(),
                               (xr, wr))
    for g, r in zip(got, want):
        assert (g.double() - r).abs().max() <= TOL_F32 * r.abs().max()
    torch.library.opcheck(torch.ops.mamba2_cutile.causal_conv1d_bwd.default,
                          (x.float(), w.float(), None, None, None, torch.randn(x.shape),
                           None, True), test_utils=("test_schema", "test_faketensor"))


def test_seq_idx_with_int64_dtype():
    x, w, kw = problem(seq=True)
    a = causal_conv1d_fn(x, w, seq_idx=kw["seq_idx"].long())
    b = causal_conv1d_fn(x, w, seq_idx=kw["seq_idx"])
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ update

@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("w", [2, 4, 8])
def test_update_continues_the_sequence(k, w):
    """prefill with causal_conv1d_fn, then decode k tokens at a time with the final states as
    conv_state: the same outputs as the forward over the whole sequence."""
    b, d, l0, steps = 2, 5, 11, 3
    gen = torch.Generator().manual_seed(w)
    x = torch.randn(b, d, l0 + k * steps, dtype=F64, generator=gen)
    weight = torch.randn(d, w, dtype=F64, generator=gen)
    bias = torch.randn(d, dtype=F64, generator=gen)
    full = causal_conv1d_fn(x, weight, bias, activation="silu")
    _, state = causal_conv1d_fn(x[..., :l0], weight, bias, return_final_states=True,
                                activation="silu")
    state = state.clone()
    for s in range(steps):
        a = l0 + s * k
        xs = x[..., a:a + k] if k > 1 else x[..., a]
        out = causal_conv1d_update(xs, state, weight, bias, activation="silu")
        want = full[..., a:a + k] if k > 1 else full[..., a]
        assert out.shape == xs.shape
        assert (out - want).abs().max() < 1e-13


@pytest.mark.parametrize("k", [1, 4, 9])
def test_update_circular_buffer_and_slots(k):
    """cache_seqlens makes conv_state a ring; slots pick rows, negative slots are padding
    rows; against the float64 definition (and the untouched slots stay as they were)."""
    b, d, w, S, nslots = 3, 6, 4, 5, 7
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(b, d, k, dtype=F64, generator=gen)
    state = torch.randn(nslots, d, S, dtype=F64, generator=gen)
    weight = torch.randn(d, w, dtype=F64, generator=gen)
    cache = torch.tensor([0, 13, 4], dtype=torch.int32)
    slots = torch.tensor([5, -1, 2], dtype=torch.int32)
    want, want_state = causal_conv1d_update_ref(x, state, weight, None, None, cache, slots)
    st = state.clone()
    out = causal_conv1d_update(x, st, weight, cache_seqlens=cache, conv_state_indices=slots)
    assert (out - want).abs().max() < 1e-13
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(st, want_state)
    assert torch.equal(st[[0, 1, 3, 4, 6]], state[[0, 1, 3, 4, 6]])


def test_update_circular_equals_plain_shift():
    """A ring of length W-1 read at p equals the shifted state rotated by p."""
    b, d, w = 2, 4, 4
    gen = torch.Generator().manual_seed(3)
    ring = torch.randn(b, d, w - 1, dtype=F64, generator=gen)
    x = torch.randn(b, d, dtype=F64, generator=gen)
    weight = torch.randn(d, w, dtype=F64, generator=gen)
    p = torch.tensor([1, 2], dtype=torch.int32)
    shifted = torch.stack([ring[r].roll(-int(p[r]), dims=-1) for r in range(b)])
    a = causal_conv1d_update(x, ring.clone(), weight, cache_seqlens=p)
    c = causal_conv1d_update(x, shifted.clone(), weight)
    assert (a - c).abs().max() < 1e-14


@pytest.mark.parametrize("circular", [False, True])
def test_update_keeps_a_wider_state_exact(circular):
    """A float64 cache beside float32 x: the entries the update keeps or moves are
    bit-identical, the written ones equal x; the output is the float32 convolution."""
    gen = torch.Generator().manual_seed(5)
    state = 1 + 1e-12 * torch.randn(2, 3, 6, dtype=F64, generator=gen)
    x = torch.randn(2, 3, 2, generator=gen)
    weight = torch.randn(3, 4, generator=gen)
    st = state.clone()
    p = torch.tensor([4, 1], dtype=torch.int32)
    out = causal_conv1d_update(x, st, weight, cache_seqlens=p if circular else None)
    if circular:
        want = state.clone()
        for r in range(2):
            for t in range(2):
                want[r, :, (int(p[r]) + t) % 6] = x[r, :, t].double()
        window = torch.stack([torch.cat([state[r][:, [(int(p[r]) + j) % 6 for j in (-3, -2, -1)]],
                                         x[r].double()], -1) for r in range(2)])
    else:
        want = torch.cat([state, x.double()], -1)[..., -6:]
        window = torch.cat([state[..., -3:], x.double()], -1)
    assert torch.equal(st, want)
    ref = sum(weight.double()[:, j, None] * window[..., j:j + 2] for j in range(4))
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 2e-6       # float32: at most 4.2e-7 (50 seeds)

# ------------------------------------------------------------------------------------ errors

def _good():
    x, w, kw = problem()
    return x, w, kw["bias"]


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: a.update(activation="relu"), ValueError, "activation"),
    (lambda a: a.update(x=torch.randn(2, 7)), ValueError, "x must have 3"),
    (lambda a: a.update(x=torch.randn(2, 7, 0, dtype=F64)), ValueError, "seqlen"),
    (lambda a: a.update(weight=torch.randn(7, 9, dtype=F64)), ValueError, "width"),
    (lambda a: a.update(weight=torch.randn(6, 4, dtype=F64)), ValueError, "weight"),
    (lambda a: a.update(bias=torch.randn(6, dtype=F64)), ValueError, "bias"),
    (lambda a: a.update(seq_idx=torch.zeros(2, 28, dtype=torch.int32)), ValueError, "seq_idx"),
    (lambda a: a.update(seq_idx=torch.zeros(2, 29)), TypeError, "seq_idx"),
    (lambda a: a.update(initial_states=torch.randn(2, 7, 4, dtype=F64)), ValueError,
     "initial_states"),
    (lambda a: a.update(return_final_states=True,
                        final_states_out=torch.randn(2, 7, 2, dtype=F64)), ValueError,
     "final_states_out"),
    (lambda a: a.update(x=torch.zeros(2, 7, 29, dtype=torch.int32)), TypeError, "x must be"),
])
def test_fn_errors_name_the_argument(change, exc, match):
    x, w, b = _good()
    args = dict(x=x, weight=w, bias=b)
    change(args)
    with pytest.raises(exc, match=match):
        causal_conv1d_fn(**args)


def test_unsupported_activation_is_also_not_implemented():
    x, w, b = _good()
    with pytest.raises(NotImplementedError):
        causal_conv1d_fn(x, w, b, activation="gelu")
    assert issubclass(UnsupportedActivation, ValueError)


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: a.update(x=torch.randn(2, 7, 0, dtype=F64)), ValueError, "at least one"),
    (lambda a: a.update(conv_state=torch.randn(2, 7, 2, dtype=F64)), ValueError, "state_len"),
    (lambda a: a.update(conv_state=torch.randn(3, 7, 3, dtype=F64)), ValueError, "slots"),
    # one slot's memory shared by both rows: each write would overwrite the other's
    (lambda a: a.update(conv_state=torch.zeros(1, 7, 3, dtype=F64).expand(2, 7, 3)),
     ValueError, "conv_state"),
    (lambda a: a.update(cache_seqlens=torch.tensor([1, -2])), ValueError, "cache_seqlens"),
    (lambda a: a.update(cache_seqlens=torch.tensor([1, 2, 3])), ValueError, "cache_seqlens"),
    (lambda a: a.update(conv_state_indices=torch.tensor([0, 2])), ValueError,
     "conv_state_indices"),
    (lambda a: a.update(conv_state_indices=torch.tensor([1, 1])), ValueError, "distinct"),
    (lambda a: a.update(conv_state_indices=torch.tensor([0.0, 1.0])), TypeError,
     "conv_state_indices"),
])
def test_update_errors_name_the_argument(change, exc, match):
    gen = torch.Generator().manual_seed(0)
    args = dict(x=torch.randn(2, 7, dtype=F64, generator=gen),
                conv_state=torch.randn(2, 7, 3, dtype=F64, generator=gen),
                weight=torch.randn(7, 4, dtype=F64, generator=gen))
    change(args)
    with pytest.raises(exc, match=match):
        causal_conv1d_update(**args)


def test_padding_rows_output_zero_whatever_they_hold():
    """A padding row (negative slot) outputs exactly 0 even when its x is NaN or the slot it
    would stand in for holds an Inf, and an empty cache (every row padding) is no error."""
    gen = torch.Generator().manual_seed(4)
    st = torch.randn(2, 4, 3, dtype=F64, generator=gen)
    st[0, 0, 0] = float("inf")
    x = torch.randn(3, 4, dtype=F64, generator=gen)
    x[1] = float("nan")
    w = torch.randn(4, 4, dtype=F64, generator=gen)
    slots = torch.tensor([1, -1, -1], dtype=torch.int32)
    out = causal_conv1d_update(x, st.clone(), w, activation="silu", conv_state_indices=slots)
    assert torch.equal(out[1:], torch.zeros(2, 4, dtype=F64)) and out[0].isfinite().all()
    empty = torch.zeros(0, 4, 3, dtype=F64)
    out = causal_conv1d_update(x, empty, w, conv_state_indices=torch.full((3,), -1))
    assert torch.equal(out, torch.zeros(3, 4, dtype=F64))


def test_padding_slots_may_repeat():
    gen = torch.Generator().manual_seed(0)
    st = torch.randn(2, 3, 3, dtype=F64, generator=gen)
    out = causal_conv1d_update(torch.randn(3, 3, dtype=F64, generator=gen), st.clone(),
                               torch.randn(3, 4, dtype=F64, generator=gen),
                               conv_state_indices=torch.tensor([-1, 1, -1]))
    assert torch.equal(out[0], torch.zeros(3, dtype=F64))


# ------------------------------------------------------------------------ custom ops / compile

def test_opcheck_forward_op():
    x, w, kw = problem(layout="channel_last", init=True, seq=True)
    x, w = x.float().requires_grad_(), w.float().requires_grad_()
    torch.library.opcheck(torch.ops.mamba2_cutile.causal_conv1d_fwd.default,
                          (x, w, kw["bias"].float(), kw["seq_idx"],
                           kw["initial_states"].float(), True, True),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


def test_torch_compile_fullgraph_forward_backward():
    x, w, kw = problem(layout="channel_last", init=True, seq=True)
    x, w, b = (t.float().requires_grad_() for t in (x, w, kw["bias"]))

    def layer(x_, w_, b_):
        return causal_conv1d_fn(x_, w_, b_, seq_idx=kw["seq_idx"], activation="silu").sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, w, b), (x, w, b))
    want = torch.autograd.grad(layer(x, w, b), (x, w, b))
    for g, r in zip(got, want):
        assert torch.allclose(g, r, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the kernels, emulated

EMU_CFG = plan.Conv1dConfig(block_l=8, block_d=16, tiles=2, bwd_block_l=8, bwd_block_d=16,
                            bwd_tiles=2)
#: the emulation runs the kernels in float64: only summation-order rounding differs
TOL_EMU = 1e-13


def _emu_problem(layout, w, seed, d=40, l=37):
    b = 2          # several token and channel blocks, neither a multiple (d = 40, l = 37)
    x, weight, kw = problem(b=b, d=d, l=l, w=w, layout=layout, init=True, seq=True, seed=seed)
    return x, weight, kw


@pytest.mark.parametrize("form", sorted(plan.FORMS))
@pytest.mark.parametrize("tiles", ["small", "default"])
@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("w,silu,opts", [(4, True, "all"), (2, False, "none"), (8, True, "all"),
                                         (3, True, "seq"), (5, False, "init")])
def test_kernels_emulated_forward_backward(layout, w, silu, opts, tiles, form):
    """small: 8x16 tiles, 2 token blocks per program (many blocks, partial ones on both
    axes); default: the dispatcher's tiles (one partial channel block, 2-3 token blocks).
    Every kernel form (`Conv1dConfig.form`)."""
    _emulated_forward_backward(layout, w, silu, opts, tiles, form)


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("w,silu,opts", [(4, True, "all"), (2, False, "none"), (8, True, "all")])
def test_kernels_emulated_unchecked_interior(layout, w, silu, opts, monkeypatch):
    """Form 1 with block_d dividing dim: the interior blocks' loads and stores skip their
    bounds checks (the emulation asserts that each such tile lies inside its array)."""
    monkeypatch.setattr(plan, "unchecked_supported", lambda: True)
    assert plan._unchecked(dataclasses.replace(EMU_CFG, form=1), 32, EMU_CFG.block_d)
    _emulated_forward_backward(layout, w, silu, opts, "small", 1, d=32)


@pytest.mark.parametrize("form", [1, 2])
@pytest.mark.parametrize("w,l", [(4, 1), (4, 3), (4, 4), (8, 9), (2, 17)])
def test_kernels_emulated_short_sequences(form, w, l):
    """Sequences of about the width: form 2's tap view has l-(w-1) rows (one at l = w),
    shorter ones take form 1's forward; all options, channel-last."""
    _emulated_forward_backward("channel_last", w, True, "all", "small", form, l=l)


def _emulated_forward_backward(layout, w, silu, opts, tiles, form, d=40, l=37):
    from conv1d_emulator import run_calls
    x, weight, kw = _emu_problem(layout, w, w, d, l)
    bias = kw["bias"] if opts == "all" else None
    init = kw["initial_states"] if opts in ("all", "init") else None
    seq = kw["seq_idx"] if opts in ("all", "seq") else None
    cl = plan.is_channel_last(x)
    b, d, l = x.shape
    cfg = EMU_CFG if tiles == "small" else plan.conv1d_config(b, d, l, cl, width=w)
    cfg = dataclasses.replace(cfg, form=form)
    act = "silu" if silu else None
    out = plan.empty_like_layout(x, cl)
    final = torch.empty(b, d, w - 1, dtype=F64)
    run_calls(plan.forward_plan(x, weight.t().contiguous(), bias, init, seq, out, final, silu,
                                cfg))
    leaves = [t.clone().requires_grad_() if t is not None else None
              for t in (x, weight, bias, init)]
    ref, ref_final = causal_conv1d_ref(leaves[0], leaves[1], leaves[2], seq, leaves[3], act)
    assert (out - ref).abs().max() < TOL_EMU
    assert (final - ref_final).abs().max() < TOL_EMU
    gen = torch.Generator().manual_seed(9)
    dout = torch.randn(b, d, l, dtype=F64, generator=gen)
    dfinal = torch.randn(b, d, w - 1, dtype=F64, generator=gen)
    want = torch.autograd.grad((ref * dout).sum() + (ref_final * dfinal).sum(),
                               [t for t in leaves if t is not None])
    dx = plan.empty_like_layout(x, cl)
    parts = b * plan.backward_grid(x, cfg)[1]
    dw_part = torch.full((parts, w, d), float("nan"), dtype=F64)   # each row written once
    db_part = torch.full((parts, d), float("nan"), dtype=F64)
    dinit = torch.full((b, d, w - 1), float("nan"), dtype=F64) if init is not None else None
    # dweight / dbias from the plan's own sum of the partials (sum_partials), dweight through
    # its transposed view
    dweight = torch.full((d, w), float("nan"), dtype=F64)
    dbias = torch.full((d,), float("nan"), dtype=F64) if bias is not None else None
    calls = plan.backward_plan(x, weight.t().contiguous(), bias, init, seq,
                               plan.in_layout(dout, cl), dfinal, dx, dw_part, db_part, dinit,
                               silu, cfg, dweight, dbias)
    assert len(calls) == 2
    run_calls(calls)
    torch.testing.assert_close(dweight, dw_part.sum(0).t(), rtol=1e-13, atol=1e-13)
    got = [dx, dweight] + ([dbias] if bias is not None else []) + \
        ([dinit] if init is not None else [])
    for g, r in zip(got, want):
        assert (g - r).abs().max() < TOL_EMU



@pytest.mark.parametrize("form", sorted(plan.FORMS))
@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
def test_kernels_emulated_fitted_grid(layout, form, monkeypatch):
    """The grids `fit_grid` makes for sequences past 65535 token blocks, emulated at a grid
    limit of 2 programs: forms 0-2 walk 7 token blocks of 8 per program (fitted tiles and
    bwd_tiles), form 3 takes two 64-token spans; forward and backward against float64."""
    monkeypatch.setattr(plan, "MAX_GRID_Y", 2)
    x = torch.empty(2, 101, 40, device="meta").transpose(1, 2) if layout == "channel_last" \
        else torch.empty(2, 40, 101, device="meta")
    rows = form == 3 and plan.is_channel_last(x)
    cfg = dataclasses.replace(EMU_CFG, form=form)
    assert plan.backward_grid(x, cfg)[1] <= 2
    if not rows:
        assert plan.fit_grid(cfg, 101, False, False).tiles == 7
        assert plan.fit_grid(cfg, 101, False, True).bwd_tiles == 7
    _emulated_forward_backward(layout, 4, True, "all", "default" if rows else "small", form,
                               l=101)

@pytest.mark.parametrize("state_layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("circular", [False, True])
@pytest.mark.parametrize("k", [1, 3, 9])
def test_kernels_emulated_update(circular, k, state_layout):
    """channel_last: conv_state as the transpose of a (nslots, state_len, dim) buffer (the
    layer's decode cache)."""
    from conv1d_emulator import run_calls
    b, d, w, S, nslots = 3, 40, 4, 5, 6
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(b, d, k, dtype=F64, generator=gen)
    state = torch.randn(nslots, d, S, dtype=F64, generator=gen)
    if state_layout == "channel_last":
        state = state.transpose(1, 2).contiguous().transpose(1, 2)
    weight = torch.randn(d, w, dtype=F64, generator=gen)
    bias = torch.randn(d, dtype=F64, generator=gen)
    cache = torch.tensor([0, 7, 3], dtype=torch.int32) if circular else None
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)
    want, want_state = causal_conv1d_update_ref(x, state, weight, bias, "silu", cache, slots)
    out = torch.empty(b, d, k, dtype=F64)
    scratch = torch.empty(b, d, S, dtype=F64)
    run_calls(plan.update_plan(x, state, weight.t().contiguous(), bias, cache, slots, out,
                               scratch, True))
    assert (out - want).abs().max() < TOL_EMU
    assert torch.equal(state, want_state)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_bad_token_stays_in_its_sequence(bad):
    """A NaN/Inf at token t changes no output before t, and none of a later packed sequence
    (the PyTorch path selects instead of multiplying by masked zeros)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 6, 20, dtype=F64, generator=gen)
    w = torch.randn(6, 4, dtype=F64, generator=gen)
    seq = torch.tensor([[0] * 9 + [1] * 11], dtype=torch.int32)
    clean, fin = causal_conv1d_fn(x, w, seq_idx=seq, activation="silu",
                                  return_final_states=True)
    xb = x.clone()
    xb[0, 2, 7] = bad
    got, fin_b = causal_conv1d_fn(xb, w, seq_idx=seq, activation="silu",
                                  return_final_states=True)
    assert torch.equal(got[..., :7], clean[..., :7])
    assert torch.equal(got[..., 9:], clean[..., 9:]) and torch.equal(fin_b, fin)
    assert not torch.isfinite(got[0, 2, 7])


#: form 3 (row streaming) at spans and step sizes that make several programs per row, partial
#: last steps and spans, and lookahead rows crossing into the next span; row loads and row tiles
ROWS_CFGS = {
    "span8-rows4": dict(span=8, rows=4, bwd_span=8, bwd_rows=4),
    "span16-rows8-tile-prefetch": dict(span=16, rows=8, row_tile=1, prefetch=1, bwd_span=16,
                                       bwd_rows=8, bwd_row_tile=1, bwd_prefetch=1),
    "span8-rows1-prefetch": dict(span=8, rows=1, prefetch=1, bwd_span=8, bwd_rows=1,
                                 bwd_prefetch=1),
    "span32-rows2-tile": dict(span=32, rows=2, row_tile=1, bwd_span=16, bwd_rows=16,
                              bwd_row_tile=1),
    "span16-rows4-prefetch": dict(span=16, rows=4, prefetch=1, bwd_span=32, bwd_rows=4,
                                  bwd_prefetch=1),
}


def _rows_cfg(name):
    return dataclasses.replace(EMU_CFG, form=3, **ROWS_CFGS[name])


@pytest.mark.parametrize("rows_cfg", sorted(ROWS_CFGS))
@pytest.mark.parametrize("w,silu,opts,silu_mode", [
    (4, True, "all", 2), (4, True, "all", 1), (2, False, "none", 0), (8, True, "all", 2),
    (3, True, "seq", 2), (5, False, "init", 0)])
def test_kernels_emulated_row_streaming(w, silu, opts, rows_cfg, silu_mode, monkeypatch):
    """Form 3 on channel-last x (37 tokens, 40 channels: partial channel blocks, partial
    last steps), forward and backward against the float64 definition; the SiLU in both of
    its forms (1: IEEE, float32 inputs; 2: the exp2 / reciprocal form of 16-bit inputs, exact
    in the emulation)."""
    monkeypatch.setattr(plan, "conv1d_config", lambda *a, **k: _rows_cfg(rows_cfg))
    monkeypatch.setattr(plan, "_rows_silu", lambda s, xp: silu_mode if s else 0)
    _emulated_forward_backward("channel_last", w, silu, opts, "default", 3)


#: spans that are no power of two (a run-time kernel argument): several programs per row at
#: 101 tokens, none of them a multiple of the span (24: 5 spans, the last 5 tokens; 40: 3
#: spans, the last 21), row loads and row tiles, prefetch on and off
ODD_SPAN_CFGS = {
    "span24-rows8-bwd40-rows4": dict(span=24, rows=8, bwd_span=40, bwd_rows=4),
    "span40-rows4-bwd24-rows8-tile-prefetch": dict(span=40, rows=4, row_tile=1, prefetch=1,
                                                   bwd_span=24, bwd_rows=8, bwd_row_tile=1,
                                                   bwd_prefetch=1),
}


@pytest.mark.parametrize("name", sorted(ODD_SPAN_CFGS))
@pytest.mark.parametrize("w,opts", [(4, "all"), (3, "all")])
def test_kernels_emulated_row_streaming_odd_spans(w, opts, name, monkeypatch):
    """Form 3 at spans of 24 and 40 tokens on 101 tokens: halo rows from the previous span,
    seq_idx, initial states (dinit), final states and dfinal, dweight partials of spans that
    end inside a step's lookahead, forward and backward against the float64 definition."""
    cfg = dataclasses.replace(EMU_CFG, form=3, **ODD_SPAN_CFGS[name])
    monkeypatch.setattr(plan, "conv1d_config", lambda *a, **k: cfg)
    _emulated_forward_backward("channel_last", w, True, opts, "default", 3, l=101)


@pytest.mark.parametrize("rows_cfg", ["span8-rows4", "span16-rows8-tile-prefetch",
                                      "span16-rows4-prefetch"])
@pytest.mark.parametrize("w,silu,opts", [(4, True, "all"), (8, True, "all"), (2, False, "none")])
def test_kernels_emulated_row_streaming_unchecked(w, silu, opts, rows_cfg, monkeypatch):
    """Form 3 with block_d dividing dim: full steps skip their bounds checks (the emulation
    asserts that each such tile lies inside its array)."""
    monkeypatch.setattr(plan, "unchecked_supported", lambda: True)
    monkeypatch.setattr(plan, "conv1d_config", lambda *a, **k: _rows_cfg(rows_cfg))
    _emulated_forward_backward("channel_last", w, silu, opts, "default", 3, d=32, l=70)


@pytest.mark.parametrize("w,l,rows_cfg", [
    (4, 1, "span8-rows4"), (4, 3, "span16-rows8-tile-prefetch"), (4, 4, "span8-rows4"),
    (8, 9, "span16-rows8-tile-prefetch"), (8, 5, "span8-rows4"), (2, 17, "span8-rows4"),
    (4, 8, "span16-rows8-tile-prefetch"), (4, 11, "span16-rows4-prefetch"),
    (8, 3, "span8-rows1-prefetch")])
def test_kernels_emulated_row_streaming_short(w, l, rows_cfg, monkeypatch):
    """Sequences of about the width and of about one span: halo from the initial states,
    final states reaching into them, dfinal terms in the first span's dinit."""
    monkeypatch.setattr(plan, "conv1d_config", lambda *a, **k: _rows_cfg(rows_cfg))
    _emulated_forward_backward("channel_last", w, True, "all", "default", 3, l=l)


def test_row_streaming_plan():
    """Form 3's grid (spans along the tokens), its partial-buffer rows, the contiguous layout
    on form 1, and the config's checks."""
    x = make_x(2, 100, 1000, "channel_last")
    cfg = plan.Conv1dConfig(form=3, block_d=64, span=256, bwd_block_d=32, bwd_span=128)
    out = plan.empty_like_layout(x, True)
    call = plan.forward_plan(x, torch.empty(4, 100, dtype=F64), None, None, None, out, None,
                             True, cfg)[0]
    from mamba2_cutile.kernels import causal_conv1d_fwd_rows, causal_conv1d_fwd_stream
    # (float64 x: no automatic occupancy hint, see test_rows_plan_hints_and_fields)
    assert call.kernel is causal_conv1d_fwd_rows.causal_conv1d_fwd_rows
    assert tuple(call.grid) == (2, 4, 2)
    assert plan.backward_grid(x, cfg) == (4, 8, 2)
    c = x.contiguous()
    call = plan.forward_plan(c, torch.empty(4, 100, dtype=F64), None, None, None,
                             torch.empty_like(c), None, True, cfg)[0]
    assert call.kernel is causal_conv1d_fwd_stream.causal_conv1d_fwd_stream
    assert plan.backward_grid(c, cfg) == plan.backward_grid(c, dataclasses.replace(cfg, form=1))
    assert plan.rows_span(128, 8, 1, 64, 100, 256, 132, 8) == 128       # explicit
    auto = plan.Conv1dConfig(form=3, block_d=64, bwd_block_d=32)
    assert plan.backward_grid(x, auto) == (4, 16, 2)      # 8 x 2 blocks: the 64-token floor
    for bad, match in ((dict(span=4), "span"), (dict(rows=16, span=8), "span"),
                       (dict(span=12), "span=12 must be 0 .* multiple of rows=8"),
                       (dict(bwd_span=30, bwd_rows=4), "bwd_span=30 .* bwd_rows=4"),
                       (dict(span=65544), "span"), (dict(span=-8), "span"),
                       (dict(bwd_rows=3), "bwd_rows"), (dict(row_tile=2), "row_tile"),
                       (dict(block_d=2048), "block_d"), (dict(ctas_per_sm=0), "ctas_per_sm"),
                       (dict(bwd_ctas_per_sm=33), "bwd_ctas_per_sm"),
                       (dict(ctas_hint=2), "ctas_hint")):
        with pytest.raises(ValueError, match=match):
            plan.Conv1dConfig(**bad)
    # any multiple of rows is a span now (a run-time kernel argument)
    cfg = plan.Conv1dConfig(form=3, block_d=64, span=376, bwd_block_d=32, bwd_span=40,
                            bwd_rows=4)
    assert tuple(plan.forward_plan(x, torch.empty(4, 100, dtype=F64), None, None, None, out,
                                   None, True, cfg)[0].grid) == (2, 3, 2)
    assert plan.backward_grid(x, cfg) == (4, 25, 2)


def _programs(blocks, seqlen, span):
    return blocks * -(-seqlen // span)


def test_rows_span_fills_whole_waves():
    """span 0: the span whose grid fills whole waves of ctas_per_sm x SMs CTA slots
    (`plan.rows_span`), at the sweep's shapes, and its bounds over many shapes."""
    rs = plan.rows_span
    # (1, 16384, 5376), forward tiles (21 channel blocks): 7 per SM -> 44 spans of 376
    # tokens, 924 programs = one full wave of 924 slots; 8 per SM (the default) -> 50 x 328
    assert rs(0, 8, 1, 5376, 16384, 256, 132, 7) == 376
    assert _programs(21, 16384, 376) == 924
    assert rs(0, 8, 1, 5376, 16384, 256, 132, 8) == 328 and _programs(21, 16384, 328) == 1050
    # (1, 65536, 1792), 7 blocks: 131 spans of 504 tokens, 917 programs of 924 slots
    assert rs(0, 8, 1, 1792, 65536, 256, 132, 7) == 504 and _programs(7, 65536, 504) == 917
    # backward tiles (42 blocks), 6 per SM: 1344 programs at 512 would be 1.7 waves; two
    # full waves of 792 slots take 37 spans of 448 tokens (1554 programs)
    assert rs(0, 8, 1, 5376, 16384, 128, 132, 6) == 448 and _programs(42, 16384, 448) == 1554
    # small: the 64-token floor (a multiple of rows), one program at seqlen <= 64
    assert rs(0, 8, 1, 1536, 2048, 256, 132, 8) == 64
    assert rs(0, 64, 1, 64, 100, 256, 132, 8) == 64
    assert rs(0, 16, 1, 64, 50, 256, 132, 8) == 64
    assert rs(0, 1, 1, 64, 5, 256, 132, 8) == 64
    for batch, dim, seqlen in ((1, 5376, 16384), (2, 8448, 32768), (4, 10240, 8192),
                               (1, 1792, 65536), (3, 1544, 16389), (1, 264, 333),
                               (8, 4096, 4097), (1, 100, 1)):
        for rows in (1, 4, 8, 16, 64):
            for block_d, ctas in ((256, 8), (128, 6), (64, 12), (128, 1)):
                span = rs(0, rows, batch, dim, seqlen, block_d, 132, ctas)
                blocks = batch * -(-dim // block_d)
                slots = ctas * 132
                k_min = -(-seqlen // 512)
                waves = -(-(blocks * k_min) // slots)
                assert span % rows == 0 and 64 <= span and span <= max(512, 64), span
                assert _programs(blocks, seqlen, span) <= max(waves * slots, blocks)
                if span - rows >= 64:   # above the floor: one step shorter overfills
                    assert _programs(blocks, seqlen, span - rows) > waves * slots


@pytest.mark.parametrize("dim, seqlen, batch", [(5376, 16384, 1), (1792, 65536, 1),
                                                 (10240, 8192, 4)])
def test_rows_backward_rule_reaches_launch(dim, seqlen, batch):
    """The dispatcher's backward at the layer widths (256 divides dim): 256-channel programs at
    7 per SM, and the launch carries the occupancy-7 hint (72 registers, no stack in the sm_90
    compile; unhinted the variant needs 123); a width 256 does not divide keeps 128-channel
    programs at 8 per SM."""
    from mamba2_cutile.kernels.causal_conv1d_bwd_rows import causal_conv1d_bwd_rows
    from mamba2_cutile.runtime import with_hints
    cfg = plan.conv1d_config(batch, dim, seqlen, True)
    assert (cfg.form, cfg.bwd_block_d, cfg.bwd_ctas_per_sm, cfg.ctas_hint) == (3, 256, 7, 1)
    x = torch.empty(batch, seqlen, dim, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    wt = torch.empty(4, dim, device="meta")
    n = plan.backward_grid(x, cfg)[1] * batch
    call = plan.backward_plan(x, wt, torch.empty(dim, device="meta"), None, None, x, None, x,
                              torch.empty(n, 4, dim, device="meta"),
                              torch.empty(n, dim, device="meta"), None, True, None)[0]
    assert call.kernel is with_hints(causal_conv1d_bwd_rows, 7, 0)
    assert call.args[14] == 256                                       # BLOCK_D
    other = plan.conv1d_config(1, 5376 + 128, 16384, True)
    assert (other.bwd_block_d, other.bwd_ctas_per_sm) == (128, 8)


def test_rows_plan_hints_and_fields():
    """Form 3's forward runs under the occupancy hint ctas_per_sm (default 8) unless
    occupancy is set or ctas_hint is 0, and only where that compiles without spills (16-bit,
    32-bit indexing: float32 and 64-bit variants run unhinted, their spans at 6 per SM); the
    backward under bwd_ctas_per_sm (default 8) likewise, its span the same either way; the
    spans follow ctas_per_sm / bwd_ctas_per_sm; the dispatcher's defaults."""
    from mamba2_cutile.kernels.causal_conv1d_bwd_rows import causal_conv1d_bwd_rows
    from mamba2_cutile.kernels.causal_conv1d_fwd_rows import causal_conv1d_fwd_rows
    from mamba2_cutile.runtime import with_hints
    cfg = plan.conv1d_config(1, 5376, 16384, True)
    assert (cfg.ctas_per_sm, cfg.bwd_ctas_per_sm, cfg.ctas_hint, cfg.span) == (8, 7, 1, 0)
    # this test's backward checks were written for 128-channel programs at 8 per SM
    cfg = dataclasses.replace(cfg, bwd_block_d=128, bwd_ctas_per_sm=8)
    x = torch.empty(1, 16384, 5376 + 8, device="meta",
                    dtype=torch.bfloat16)[..., :5376].transpose(1, 2)
    wt = torch.empty(4, 5376, device="meta")
    out = plan.empty_like_layout(x, True)

    def fwd(x=x, out=out, **fields):
        return plan.forward_plan(x, wt, None, None, None, out, None, True,
                                 dataclasses.replace(cfg, **fields))[0]

    call = fwd()
    assert call.kernel is with_hints(causal_conv1d_fwd_rows, 8, 0)
    assert call.kernel is not causal_conv1d_fwd_rows
    assert tuple(call.grid) == (21, 50, 1) and call.args[8] == 328     # span
    assert fwd(ctas_hint=0).kernel is causal_conv1d_fwd_rows
    assert fwd(occupancy=4).kernel is with_hints(causal_conv1d_fwd_rows, 4, 0)
    call = fwd(ctas_per_sm=7)
    assert call.kernel is with_hints(causal_conv1d_fwd_rows, 7, 0)
    assert tuple(call.grid) == (21, 44, 1) and call.args[8] == 376
    assert fwd(span=384).args[8] == 384 and tuple(fwd(span=384).grid) == (21, 43, 1)
    # no automatic hint where it spills: float32, 64-bit indexing, row tiles, 16 rows
    x32 = x.float()
    call = fwd(x32, plan.empty_like_layout(x32, True))
    assert call.kernel is causal_conv1d_fwd_rows and call.args[8] == 448     # 6 per SM
    assert fwd(row_tile=1).kernel is causal_conv1d_fwd_rows
    assert fwd(rows=16).kernel is causal_conv1d_fwd_rows
    assert fwd(warps=8).kernel is with_hints(causal_conv1d_fwd_rows, 0, 8)  # 5 per SM fit
    big = torch.empty(1, 2**21 + 3, 1536, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    call = fwd(big, plan.empty_like_layout(big, True))
    from mamba2_cutile.kernels.causal_conv1d_fwd_rows import causal_conv1d_fwd_rows_i64
    assert call.kernel is causal_conv1d_fwd_rows_i64
    assert fwd(x32, plan.empty_like_layout(x32, True), occupancy=8).kernel is \
        with_hints(causal_conv1d_fwd_rows, 8, 0)
    parts = plan.backward_grid(x, cfg)
    assert parts == (42, 50, 1)                  # two waves of 8 x 132 slots: 2100 of 2112

    def bwd(x=x, out=out, **fields):
        c = dataclasses.replace(cfg, **fields)
        n = plan.backward_grid(x, c)[1]
        return plan.backward_plan(x, wt, None, None, None, out, None, out,
                                  torch.empty(n, 4, 5376, device="meta"),
                                  torch.empty(n, 5376, device="meta"), None, True, c)[0]

    call = bwd()
    assert call.kernel is with_hints(causal_conv1d_bwd_rows, 8, 0) and call.args[12] == 328
    assert bwd(ctas_hint=0).kernel is causal_conv1d_bwd_rows
    assert bwd(bwd_occupancy=5).kernel is with_hints(causal_conv1d_bwd_rows, 5, 0)
    # unhinted where it would spill (float32), with the same span: the grid (the dweight
    # partials) does not depend on the hint
    call = bwd(x32, plan.empty_like_layout(x32, True))
    assert call.kernel is causal_conv1d_bwd_rows and call.args[12] == 328
    assert bwd(bwd_rows=16).kernel is causal_conv1d_bwd_rows
    assert plan.backward_grid(x, dataclasses.replace(cfg, bwd_ctas_per_sm=6)) == (42, 37, 1)
    assert plan.backward_grid(x, dataclasses.replace(cfg, bwd_ctas_per_sm=5)) == (42, 47, 1)
    assert plan.backward_grid(x, dataclasses.replace(cfg, bwd_ctas_per_sm=7)) == (42, 44, 1)


def test_sweep_candidates_are_valid_configs():
    """Every sweep candidate (both sets) parses into a valid Conv1dConfig over the default
    (a typo would cost a GPU run a failed row)."""
    from mamba2_cutile.bench import conv1d as bench
    base = plan.conv1d_config(1, 5376, 16384, True)
    for fwd, bwd in bench.CANDIDATE_SETS.values():
        for spec in fwd + bwd:
            dataclasses.replace(base, **bench._parse_fields(spec))
    for name in ("rows", "waves"):
        fwd, bwd = bench.CANDIDATE_SETS[name]
        assert fwd[0] == bwd[0] == "" and all("form=3" in c for c in fwd[1:] + bwd[1:])
    # the waves set: the automatic span at 6-8 (forward) and 5-12 (backward) CTAs per SM
    fwd, bwd = bench.CANDIDATE_SETS["waves"]
    assert {dataclasses.replace(base, **bench._parse_fields(c)).ctas_per_sm
            for c in fwd} == {6, 7, 8}
    assert {dataclasses.replace(base, **bench._parse_fields(c)).bwd_ctas_per_sm
            for c in bwd} == {5, 6, 7, 8, 12}


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("form", [0, 1, 2, 3])
def test_long_sequence_grid_fits(layout, form):
    """The grid's token axis stays within CUDA's 65535 (a 2^21-token sequence is 65537 blocks
    of 32 tokens) and still covers every token: more token blocks per program (forms 0-2, the
    forward's and the backward's own) or longer spans (form 3), in the launches and in the
    backward's partial rows alike; only the launch's own fields are fitted (a 70M-token
    channel-last x runs on form 3's spans); a set span that cannot fit is refused."""
    from support.variants import kernel_arg
    d, w = 64, 4
    for l in (2**21 + 5, 40_000_000, 70_000_000):
        if layout == "channel_last":
            x = torch.empty(1, l, d, dtype=torch.bfloat16, device="meta").transpose(1, 2)
        else:
            x = torch.empty(1, d, l, dtype=torch.bfloat16, device="meta")
        cl = plan.is_channel_last(x)
        rows = form == 3 and cl
        cfg = dataclasses.replace(plan.conv1d_config(1, d, l, cl), form=form)
        if l > 64 * plan.MAX_GRID_Y * cfg.bwd_block_l and not rows:
            with pytest.raises(ValueError, match="seqlen"):
                plan.backward_grid(x, cfg)
            continue
        wt = torch.empty(w, d, device="meta")
        out = plan.empty_like_layout(x, cl)
        fwd = plan.forward_plan(x, wt, None, None, None, out, None, True, cfg)[0]
        grid = plan.backward_grid(x, cfg)
        parts = grid[1]
        bwd = plan.backward_plan(x, wt, None, None, None, out, None, out,
                                 torch.empty(parts, w, d, device="meta"),
                                 torch.empty(parts, d, device="meta"), None, True, cfg)[0]
        assert tuple(bwd.grid) == tuple(grid)
        for call in (fwd, bwd):
            assert max(call.grid[1:]) <= plan.MAX_GRID_Y
        if rows:                                       # span argument x programs >= seqlen
            assert fwd.args[8] * fwd.grid[1] >= l and bwd.args[12] * bwd.grid[1] >= l
        else:                                          # block_l x tiles x programs >= seqlen
            fc, bc = plan.fit_grid(cfg, l, False, False), plan.fit_grid(cfg, l, False, True)
            assert fc.block_l * fc.tiles * fwd.grid[1] >= l - (w - 1) * (form == 2 and cl)
            assert bc.bwd_block_l * bc.bwd_tiles * bwd.grid[1] >= l
            assert kernel_arg(fwd, "TILES") == fc.tiles
            assert kernel_arg(bwd, "TILES") == bc.bwd_tiles
    with pytest.raises(ValueError, match="span=64"):
        plan.fit_grid(plan.Conv1dConfig(form=3, span=64), 40_000_000, True, False)
    with pytest.raises(ValueError, match="bwd_span=64"):
        plan.fit_grid(plan.Conv1dConfig(form=3, bwd_span=64), 40_000_000, True, True)
    with pytest.raises(ValueError, match="seqlen"):
        plan.fit_grid(plan.Conv1dConfig(), 2**40, False, False)


def test_eager_calls_equal_the_ops():
    """Eager calls run the ops' bodies (no dispatch): the forward and every gradient, and the
    decode update with its in-place state, bit-equal to the ops'; a double backward raises
    on both paths."""
    from mamba2_cutile.conv1d import custom_ops

    gen = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x0, w0, b0, init0 = r(2, 6, 19), r(6, 4), r(6), r(2, 6, 3)
    seq = torch.zeros(2, 19, dtype=torch.int32)
    seq[0, 9:] = 1
    dout, dfin = r(2, 6, 19), r(2, 6, 3)
    results = []
    for path in ("eager", "op"):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        fn = (custom_ops.conv1d_call if path == "eager"
              else torch.ops.mamba2_cutile.causal_conv1d_fwd)
        out, fin = fn(x, w, b, None, init0, True, True)
        assert (type(out.grad_fn).__name__ == "_EagerConvBackward") == (path == "eager")
        results.append((out, fin) + torch.autograd.grad([out, fin], [x, w, b], [dout, dfin],
                                                        retain_graph=True))
        (gx,) = torch.autograd.grad(out, [x], dout, create_graph=True)
        with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD[path]):
            gx.sum().backward()
        out2, _ = fn(x0, w0, b0, seq, None, False, False)
        results[-1] += (out2,)
    for a, b_ in zip(*results):
        torch.testing.assert_close(a, b_, rtol=0, atol=0)

    states, outs = [], []
    for fn in (custom_ops.conv1d_update_call, torch.ops.mamba2_cutile.causal_conv1d_update):
        state = torch.arange(2 * 6 * 5, dtype=torch.float64).reshape(2, 6, 5) / 7
        lens = torch.tensor([3, 7], dtype=torch.int32)
        outs.append(fn(x0[:, :, :2], state, w0, b0, True, lens, None))
        states.append(state)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(states[0], states[1], rtol=0, atol=0)


@pytest.mark.parametrize("checked", [True, False])
def test_int64_ids_past_int32_stay_apart(monkeypatch, checked):
    """int64 seq_idx values past int32 are taken, as the scan takes them, and keep their
    sequences apart instead of saturating onto one id, whether values are checked (CPU) or
    not (the GPU's default, torch.compile)."""
    from mamba2_cutile.conv1d import api
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 6, dtype=F64, generator=gen)
    w = torch.randn(3, 4, dtype=F64, generator=gen)
    # two sequences; one broken by a padding token; ids that come back (3, 5, 3)
    for small in ([[0, 0, 0, 1, 1, 1]], [[0, -1, 0, 0, 1, 1]], [[3, 5, 3, 3, 5, 3]]):
        small = torch.tensor(small)
        want = causal_conv1d_fn(x, w, seq_idx=small.to(torch.int32))
        with monkeypatch.context() as m:
            if not checked:
                m.setattr(api, "value_checks_enabled", lambda on_cuda: False)
            for base in (2**31 - 1, 2**31, 2**40):
                got = causal_conv1d_fn(x, w, seq_idx=torch.where(small >= 0, small + base, small))
                assert torch.equal(got, want), (small.tolist(), base)


def test_unchecked_slot_past_the_cache_is_padding(monkeypatch):
    """Unchecked (torch.compile on CPU tensors), a slot past the cache is a padding row, as
    on the GPU: out 0 and no state changed, instead of an IndexError."""
    from mamba2_cutile.conv1d import api
    gen = torch.Generator().manual_seed(4)
    state = torch.randn(2, 4, 3, dtype=F64, generator=gen)
    x = torch.randn(2, 4, dtype=F64, generator=gen)
    w = torch.randn(4, 3, dtype=F64, generator=gen)
    idx = torch.tensor([0, 5], dtype=torch.int32)
    monkeypatch.setattr(api, "value_checks_enabled", lambda on_cuda: False)
    st = state.clone()
    out = causal_conv1d_update(x, st, w, conv_state_indices=idx)
    want_st = state.clone()
    want = causal_conv1d_update(x[:1], want_st[:1], w)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(st, want_st)


def test_update_output_has_no_gradient():
    """A decode step carries no gradient, as causal-conv1d's: inputs that require one give an
    output that does not (no backward that would raise)."""
    x = torch.randn(2, 4, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    out = causal_conv1d_update(x, torch.randn(2, 4, 2), w, torch.randn(4, requires_grad=True))
    assert not out.requires_grad and out.grad_fn is None
