"""CPU, float64: the explicit chunked backward (`chunked_backward.ssd_chunked_backward`) against
torch.autograd through the token-by-token recurrence (and the chunked forward)."""

import pytest
import torch

from mamba2_cutile import reference
from mamba2_cutile.reference import ssd_chunked_backward
from support.grads import NAMES, assert_grads_close

F64 = torch.float64
TOL = 1e-9


def make_inputs(seed=0, b=2, l=150, h=4, g=2, p=5, n=7, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(x=r(b, l, h, p), dt=r(b, l, h) * 0.5 + 0.3,
                A=-torch.rand(h, generator=gen, dtype=dtype) - 0.5,
                B=r(b, l, g, n), C=r(b, l, g, n), D_head=r(h), D_chan=r(h, p), z=r(b, l, h, p),
                dt_bias=r(h) * 0.3, initial_states=r(b, h, p, n))


def make_seq_idx(b, l):
    """Resets within chunks, exactly at chunk boundaries (64, 128, 192, 256), right after one
    (65, 129), just before one (63), at token 1, at the last token, one-token sequences, gaps
    in the ids, and a row that does not start at 0."""
    rows = ([1, 40, 64, 100, 128, 129, 192, 250, l - 1],
            [63, 64, 65, 130, 200, 256, 257])
    seq = torch.zeros(b, l, dtype=torch.int32)
    for r in range(b):
        marks = rows[r % 2]
        seq[r] = 5 * r
        for k, pos in enumerate(marks):
            if 0 < pos < l:
                seq[r, pos:] = 5 * r + 2 * (k + 1)
    return seq


OPTIONS = {
    "none": dict(),
    "D_head": dict(D="D_head"),
    "D_chan": dict(D="D_chan"),
    "z": dict(z=True),
    "D_z": dict(D="D_head", z=True),
    "bias_softplus": dict(dt_bias=True, dt_softplus=True),
    "dt_limit": dict(dt_bias=True, dt_softplus=True, dt_limit=(0.7, 1.1)),
    "dt_limit_nosoftplus": dict(dt_limit=(0.2, 0.6)),
    "initial_states": dict(initial_states=True),
    "seq_idx": dict(seq_idx=True),
    "seq_idx_init": dict(seq_idx=True, initial_states=True),
    "all": dict(D="D_chan", z=True, dt_bias=True, dt_softplus=True, dt_limit=(0.7, 1.1),
                initial_states=True, seq_idx=True),
}


def build(opt, l, b=2, h=4, g=2, p=5, n=7, seed=0):
    inp = make_inputs(seed=seed, b=b, l=l, h=h, g=g, p=p, n=n)
    args = dict(x=inp["x"], dt=inp["dt"], A=inp["A"], B=inp["B"], C=inp["C"],
                D=inp[opt["D"]] if "D" in opt else None,
                z=inp["z"] if opt.get("z") else None,
                dt_bias=inp["dt_bias"] if opt.get("dt_bias") else None,
                initial_states=inp["initial_states"] if opt.get("initial_states") else None)
    kw = dict(seq_idx=make_seq_idx(b, l) if opt.get("seq_idx") else None,
              dt_softplus=opt.get("dt_softplus", False),
              dt_limit=opt.get("dt_limit", (0.0, float("inf"))))
    return args, kw


def autograd_grads(forward, args, kw, dout, dfinal, **extra):
    leaves = {k: (None if v is None else v.clone().requires_grad_(True)) for k, v in args.items()}
    y, h, _ = forward(**leaves, **kw, **extra)
    outs, cots = [y], [dout]
    if dfinal is not None:
        outs.append(h)
        cots.append(dfinal)
    names = [k for k in NAMES if leaves[k] is not None]
    got = torch.autograd.grad(outs, [leaves[k] for k in names], cots, allow_unused=True)
    res = dict.fromkeys(NAMES)
    for k, gr in zip(names, got):
        res[k] = torch.zeros_like(args[k]) if gr is None else gr
    return res


def explicit_grads(args, kw, chunk, dout, dfinal, dtype=F64):
    return ssd_chunked_backward(args["x"], args["dt"], args["A"], args["B"], args["C"], chunk,
                                dout, dfinal, D=args["D"], z=args["z"], dt_bias=args["dt_bias"],
                                initial_states=args["initial_states"], dtype=dtype, **kw)


def cotangents(args, seed=7):
    gen = torch.Generator().manual_seed(seed)
    x, B = args["x"], args["B"]
    b, l, h, p = x.shape
    dout = torch.randn(b, l, h, p, generator=gen, dtype=x.dtype)
    dfinal = torch.randn(b, h, p, B.shape[-1], generator=gen, dtype=x.dtype)
    return dout, dfinal


def assert_close(got, ref, tol=TOL):
    # the explicit stages return float64 for float64 inputs; some tests compare other dtypes
    assert_grads_close(got, ref, tol, check_dtype=False)


@pytest.mark.parametrize("with_final", [True, False], ids=["dfinal", "no_dfinal"])
@pytest.mark.parametrize("l", [150, 300, 37, 1])
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_matches_recurrence_autograd(opt, l, with_final):
    args, kw = build(OPTIONS[opt], l)
    dout, dfinal = cotangents(args)
    dfinal = dfinal if with_final else None
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    got = explicit_grads(args, kw, 64, dout, dfinal)
    assert_close(got, ref)


@pytest.mark.parametrize("chunk", [16, 64, 128])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_chunk_sizes_and_groups(chunk, g):
    args, kw = build(OPTIONS["all"], 150, g=g, seed=3)
    dout, dfinal = cotangents(args, seed=11)
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    assert_close(explicit_grads(args, kw, chunk, dout, dfinal), ref)


def test_matches_chunked_forward_autograd():
    args, kw = build(OPTIONS["all"], 300, seed=4)
    dout, dfinal = cotangents(args, seed=2)
    ref = autograd_grads(reference.ssd_chunked, args, kw, dout, dfinal, chunk_size=64,
                         dtype=F64)
    assert_close(explicit_grads(args, kw, 64, dout, dfinal), ref)


def test_dt_limit_really_clamps():
    """The dt_limit cases above clamp a good share of dt at both ends."""
    for opt in ("dt_limit", "dt_limit_nosoftplus"):
        args, kw = build(OPTIONS[opt], 300)
        v = args["dt"] + (0 if args["dt_bias"] is None else args["dt_bias"])
        w = torch.nn.functional.softplus(v) if kw["dt_softplus"] else v
        lo, hi = kw["dt_limit"]
        assert (w < lo).float().mean() > 0.1 and (w > hi).float().mean() > 0.1


@pytest.mark.parametrize("softplus", [False, True])
def test_clamp_and_softplus_boundaries(softplus):
    """dt exactly at the clamp bounds (torch.clamp passes the gradient there) and dt + bias
    exactly at softplus's threshold (20: sigmoid branch) and just above it."""
    args, kw = build(dict(dt_bias=True), 150, seed=5)
    dt = args["dt"].clone()
    bias = args["dt_bias"]
    pre = (lambda y: torch.log(torch.expm1(torch.tensor(y, dtype=F64)))) if softplus \
        else (lambda y: torch.tensor(y, dtype=F64))
    dt[:, ::7] = pre(0.25) - bias
    dt[:, 3::11] = pre(0.75) - bias
    if softplus:
        dt[0, 5] = 20.0 - bias       # v = 20 (up to rounding): the sigmoid branch
        dt[1, 9] = 20.0 - bias + 1e-9
    v = dt + bias
    w = torch.nn.functional.softplus(v) if softplus else v
    # bounds equal to values that occur exactly (head 0; other heads land within rounding)
    lo, hi = w[0, 0, 0].item(), w[0, 3, 0].item()
    assert (w == lo).sum() >= 2 and (w == hi).sum() >= 2
    assert (w < lo).any() and (w > hi).any()
    if softplus:
        assert (v == 20.0).any() and ((v > 20.0) & (v < 20.0 + 1e-6)).any()
    args["dt"] = dt
    kw = dict(seq_idx=None, dt_softplus=softplus, dt_limit=(lo, hi))
    dout, dfinal = cotangents(args)
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    assert_close(explicit_grads(args, kw, 64, dout, dfinal), ref)
    if softplus:   # the threshold tokens with an unbounded limit
        kw["dt_limit"] = (0.0, 100.0)
        ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
        got = explicit_grads(args, kw, 64, dout, dfinal)
        assert_close(got, ref)
        # at v = 20 torch uses sigmoid(20) = 1 - 2e-9, not 1: check those entries tightly
        at = v >= 20.0
        rel = ((got["dt"] - ref["dt"]).abs() / ref["dt"].abs())[at]
        assert rel.max() < 1e-11


def test_default_limit_clamps_negative_dt():
    """The default dt_limit (0, inf) clamps, as mamba_ssm's Triton scan does: a negative dt
    (no softplus) counts as 0 and passes no gradient; the others keep theirs."""
    args, kw = build(dict(), 150)
    args["dt"] = args["dt"] - 0.5
    neg = args["dt"] < 0
    assert neg.any() and (~neg).any()
    dout, dfinal = cotangents(args)
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    got = explicit_grads(args, kw, 64, dout, dfinal)
    assert_close(got, ref)
    assert (got["dt"][neg] == 0).all() and (got["dt"][~neg] != 0).all()


def test_dfinal_only():
    """Only the final state's gradient (dout = 0): reaches only the last sequence of each row."""
    args, kw = build(OPTIONS["all"], 300)
    _, dfinal = cotangents(args)
    dout = torch.zeros_like(args["x"])
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    got = explicit_grads(args, kw, 64, None, dfinal)
    assert_close(got, ref)
    last = kw["seq_idx"] == kw["seq_idx"][:, -1:]
    assert (got["x"][~last] == 0).all()


def test_empty_sequence():
    args, kw = build(OPTIONS["all"], 0)
    dout, dfinal = cotangents(args)
    got = explicit_grads(args, kw, 64, dout, dfinal)
    assert torch.equal(got["initial_states"], dfinal)
    assert all(got[k].abs().sum() == 0 for k in NAMES if k != "initial_states")


def test_float32_compute_and_dtypes():
    args, kw = build(OPTIONS["all"], 150, seed=6)
    dout, dfinal = cotangents(args)
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    a32 = {k: None if v is None else v.float() for k, v in args.items()}
    got = explicit_grads(a32, kw, 64, dout.float(), dfinal.float(), dtype=torch.float32)
    for k in NAMES:
        assert got[k].dtype == torch.float32
    assert_close({k: None if v is None else v.double() for k, v in got.items()}, ref, tol=1e-4)


# ----------------------------------------------------------------------------------------------
# non-finite inputs: the gradients keep to where the recurrence's own gradients are non-finite
# ----------------------------------------------------------------------------------------------

def _bad_problem(what, value, at, packed, l=40):
    """One head group, z, D, an initial state; one NaN / Inf in `what` (an input or dout) at
    token `at` (`what` None: none); `packed`: three sequences (tokens 0-11, 12-26, 27-39) in
    chunks of 16."""
    gen = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    h, p, n = 2, 3, 4
    args = dict(x=r(1, l, h, p), dt=r(1, l, h).abs() * 0.5 + 0.1,
                A=-torch.rand(h, generator=gen, dtype=F64) - 0.5, B=r(1, l, 1, n),
                C=r(1, l, 1, n), D=r(h), z=r(1, l, h, p), dt_bias=None,
                initial_states=r(1, h, p, n))
    kw = dict(seq_idx=torch.tensor([[0] * 12 + [1] * 15 + [2] * 13]) if packed else None,
              dt_softplus=False, dt_limit=(0.0, float("inf")))
    dout, dfinal = r(1, l, h, p), r(1, h, p, n)
    if what == "dout":
        dout[0, at, 0, 0] = value
    elif what is not None:
        args[what] = args[what].clone()
        args[what][0, at] = value
    return args, kw, dout, dfinal


def _branch_free(monkeypatch, on):
    """The form taken where values cannot be read (torch.compile, GPU tensors): no split of
    packed sequences at a non-finite dt, the masked products' non-finite rows found without a
    branch."""
    if on:
        from mamba2_cutile.reference import chunked_backward
        monkeypatch.setattr(chunked_backward, "_readable", lambda *ts: False)


@pytest.mark.parametrize("branch_free", [False, True], ids=["eager", "branch-free"])
@pytest.mark.parametrize("packed", [False, True], ids=["one", "packed"])
@pytest.mark.parametrize("at", [5, 20, 33])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("what", ["x", "B", "C", "z", "dout"])
def test_bad_value_stays_where_the_recurrence_has_it(what, value, at, packed, branch_free,
                                                     monkeypatch):
    """A NaN or Inf in x, B, C, z or dout: every per-token gradient the recurrence's autograd
    gives finite is finite and equal here (the chunk products select their masked-out terms
    instead of multiplying them by 0: other sequences' rows in the state products, a state
    that does not carry; with values readable or not), and every one it
    gives non-finite is non-finite here, but dt at a later sequence's first token, where the
    recurrence's autograd itself forms 0 * NaN through the reset it selects away."""
    _branch_free(monkeypatch, branch_free)
    args, kw, dout, dfinal = _bad_problem(what, value, at, packed)
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    got = explicit_grads(args, kw, 16, dout, dfinal)
    starts = torch.zeros(40, dtype=torch.bool)
    if packed:
        starts[[12, 27]] = True
    for name in ("x", "dt", "B", "C", "z"):
        r, g = ref[name][0], got[name][0]
        fin = r.isfinite()
        assert g[fin].isfinite().all(), (name, (fin & ~g.isfinite()).nonzero()[:5].tolist())
        scale = r[fin].abs().max()
        assert ((g[fin] - r[fin]).abs().max() <= 1e-13 * scale), name   # measured 1.1e-15
        extra = ~fin & g.isfinite()
        if name == "dt":
            extra = extra & ~starts[:, None]
        assert not extra.any(), (name, extra.nonzero()[:5].tolist())


@pytest.mark.parametrize("branch_free", [False, True], ids=["eager", "branch-free"])
@pytest.mark.parametrize("at", [12, 27])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("what, init", [("x", True), ("B", True), ("C", True), ("C", False),
                                        ("z", True), ("dout", True), ("dout", False)])
def test_bad_value_at_a_sequence_start_keeps_the_head_gradients(what, init, value, at,
                                                                 branch_free, monkeypatch):
    """A NaN / Inf at a packed sequence's first token: the recurrence starts that sequence
    from a reset state, so A, D and the initial state get finite gradients wherever its
    autograd gives them, equal here: the chunked decay gradient's carry and state terms
    there (an Inf times a zero weight or a zero entering state) are selected away rather than
    multiplied, with values readable or not (the branch-free form of torch.compile)."""
    _branch_free(monkeypatch, branch_free)
    args, kw, dout, dfinal = _bad_problem(what, value, at, packed=True)
    if not init:
        args["initial_states"] = None
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    got = explicit_grads(args, kw, 16, dout, dfinal)
    checked = 0
    for name in ("A", "D", "initial_states"):
        if ref.get(name) is None:
            continue
        r, g = ref[name], got[name]
        fin = r.isfinite()
        if not fin.any():
            continue
        checked += int(fin.sum())
        assert g[fin].isfinite().all(), (name, r, g)
        # measured 5.1e-16
        assert (g[fin] - r[fin]).abs().max() <= 4e-15 * r[fin].abs().max(), (name, r, g)
    assert checked > 0      # (a bad x without an initial state leaves none finite)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_bad_dt_run_leaves_the_next_sequence_exact(value):
    """dt NaN / Inf over most of a chunk in one packed sequence: each bad step counts as
    -MAX_LOG_STEP in the chunk's cumsum, which does not restart at the sequence change, so the
    eager form takes the sequences apart and the next sequence's gradients stay as exact as
    a clean run's (the branch-free form: about 7e-13, finite)."""
    args, kw, dout, dfinal = _bad_problem(None, None, None, packed=False, l=80)
    args["dt"] = args["dt"].clone()
    args["dt"][0, :56] = value
    kw["seq_idx"] = torch.tensor([[0] * 56 + [1] * 24])
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    got = explicit_grads(args, kw, 64, dout, dfinal)
    for name in ("x", "dt", "B", "C", "z"):
        r, g = ref[name][0, 56:], got[name][0, 56:]
        fin = r.isfinite()
        assert fin[1:].all() and g[fin].isfinite().all(), name
        # measured at most 2.2e-15 (the branch-free form 6.7e-13)
        assert (g[fin] - r[fin]).abs().max() <= 1e-14 * r[fin].abs().max(), name


def test_minus_inf_A_head_gradients_follow_the_recurrence():
    """A = -inf for one head (decay exactly 0): dx, dB, dC, dz, dD and dinitial_states equal
    the recurrence's autograd (the step clamp keeps G finite); the other head's dt and A too."""
    args, kw = build(OPTIONS["D_z"], 70, h=2, g=1)
    args["A"] = torch.tensor([-float("inf"), -0.7], dtype=F64)
    args["initial_states"] = torch.randn(2, 2, 5, 7, dtype=F64,
                                         generator=torch.Generator().manual_seed(3))
    dout, dfinal = cotangents(args)
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, dfinal, dtype=F64)
    got = explicit_grads(args, kw, 32, dout, dfinal)
    # over 40 seeds: at most 1.5e-15 of the largest entry (x, B, C, z, D, initial_states, the
    # finite head's dt); dA, a sum with cancellation, at most 1.1e-16 of the sum of |ddt|
    for name in ("x", "B", "C", "z", "D", "initial_states"):
        assert got[name].isfinite().all(), name
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-14 * ref[name].abs().max())
    ddt = ref["dt"][..., 1]
    torch.testing.assert_close(got["dt"][..., 1], ddt, rtol=0, atol=1e-14 * ddt.abs().max())
    torch.testing.assert_close(got["A"][1], ref["A"][1], rtol=0, atol=1e-15 * ddt.abs().sum())


def test_packed_sequences_keep_their_gradients_through_the_api():
    """Through mamba_chunk_scan_combined's autograd on CPU tensors: garbage in one packed
    sequence leaves the other's gradients finite and equal to a clean run's."""
    from mamba2_cutile import mamba_chunk_scan_combined
    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    l = 128
    x, B, C = r(1, l, 2, 4), r(1, l, 1, 4), r(1, l, 1, 4)
    dt, A = torch.rand(1, l, 2, generator=gen, dtype=F64) + 0.1, -torch.rand(2, dtype=F64) - 0.2
    seq = torch.tensor([[0] * 70 + [1] * 58])

    def grads(x):
        xl, Bl, Cl, dtl = (t.clone().requires_grad_(True) for t in (x, B, C, dt))
        y = mamba_chunk_scan_combined(xl, dtl, A, Bl, Cl, 64, seq_idx=seq)
        y[:, 70:].sum().backward()          # a loss on the second sequence only
        return [t.grad for t in (xl, Bl, Cl, dtl)]

    bad = x.clone()
    bad[0, 10] = float("nan")
    for g_bad, g_ok in zip(grads(bad), grads(x)):
        assert g_bad[:, 70:].isfinite().all()
        torch.testing.assert_close(g_bad[:, 70:], g_ok[:, 70:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("l, at", [(100, 99), (48, 47), (40, 39), (40, 20)])
def test_bad_last_token_leaves_dA_and_dD_finite(l, at):
    """A NaN x at a row's last token with a loss on every other output (next-token training):
    dA, dD and every per-token gradient equal the recurrence's (the exclusive sums shift
    instead of subtracting the NaN term, the last chunk's padding is dropped before dA)."""
    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    h, p, n = 2, 3, 4
    args = dict(x=r(1, l, h, p), dt=r(1, l, h).abs() * 0.5 + 0.1,
                A=-torch.rand(h, generator=gen, dtype=F64) - 0.5, B=r(1, l, 1, n),
                C=r(1, l, 1, n), D=r(h), z=None, dt_bias=None, initial_states=None)
    args["x"][0, at, 0, 0] = float("nan")
    kw = dict(seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf")))
    dout = r(1, l, h, p)
    dout[:, at:] = 0.0
    ref = autograd_grads(reference.ssd_recurrence, args, kw, dout, None, dtype=F64)
    got = explicit_grads(args, kw, 16 if l == 40 else 64, dout, None)
    for name in ("A", "D", "x", "dt", "B", "C"):
        fin = ref[name].isfinite()
        assert torch.equal(got[name].isfinite() | ~fin, torch.ones_like(fin)), name
        # measured at most 5.3e-14 apart
        torch.testing.assert_close(got[name][fin], ref[name][fin], rtol=0, atol=5e-13)
