"""The forward scan stays causal under bad input: a NaN or +-Inf at token t never changes an
output before t, on the CPU path, on the forward kernels' source (float64 emulation, CPU) and
on the kernels themselves (GPU).

On the GPU, chunk_scan's plain tile is not causal by itself (masked entries are zeros
multiplied in, 0 * NaN = NaN). With `scan_causal` 1, 2 or 3 (MAMBA2_CUTILE_CONFIG; 1 costs
18% on clean input at the seed problem, 3 2.3-3.4%) the forward's second chunk_scan launch recomputes, in a sanitizing form, the tiles whose outputs
hold a non-finite value (1: counted per tile, same grid) or whose accumulator's sum (2) or row
sums (3) are not finite (a program per FIX_SPAN tiles) (kernels/chunk_scan.py); with 4
(the shape rule's default), chunk_state_pass flags the heads a non-finite input reaches and a
program per head recomputes the chunks holding one; decay_cumsum
and chunk_state_pass keep the decay finite and other sequences' garbage out by selects in
every mode. The kernel tests below run the causal modes on the kernels' source (emulated) and
on the GPU (the decay limits in every mode); `test_emulated_default_not_causal` records that
the plain mode (`scan_causal=0`) is not causal.

The contract checked for every bad input (one entry of x, B, C, z or dt, raw or through
dt_bias + softplus, at the middle, first or last token of a chunk, with and without seq_idx,
chunk 64/128/256):

- before t, the outputs equal (torch.equal) those of a clean run of the same implementation:
  the same inputs with the bad entry holding its finite value;
- at and after t, wherever the float64 recurrence (reference.ssd_recurrence) is finite, the
  output matches it within the path's tolerance; the final state too where the recurrence's
  is finite (after a seq_idx reset that follows the bad token);
- where the recurrence is non-finite: the CPU path is non-finite too; the kernels are
  non-finite at token t itself and from the next chunk on (checked; inside t's chunk the
  flagged tile sets NaN where a kept key's x is bad, and a bad B or dt stays in its kept rows).

A = -inf for a head (decay exactly 0) and A = 0 (decay 1) must simply match the recurrence.

Tolerances, max|ours - ref| / max|ref| over the entries where the reference is finite, about
5x the largest error measured on these problems (CPU, 2026-12-01): CPU path in float32 1e-5
(measured 2.0e-6 on out, 1.6e-6 on the final state over every input, place, chunk size and
seq_idx setting); emulated kernels, float64 throughout, 2e-14 (measured 3.5e-15); GPU
support.tolerances.forward_tol, the clean forward's bounds (bad input must not add error
where the result is finite); the GPU tests log their errors.
"""

import math
import os
from dataclasses import replace

import pytest
import torch

from mamba2_cutile import mamba_chunk_scan_combined
from mamba2_cutile.config import ENV_FORWARD
from mamba2_cutile.reference import ssd_recurrence
from support import variants

INF, NAN = math.inf, math.nan

F64 = torch.float64

#: (input, bad value); "dt_raw" is dt without dt_bias / softplus, "dt" goes through them
BAD = [("x", NAN), ("x", INF), ("x", -INF), ("B", NAN), ("B", INF), ("B", -INF),
       ("C", NAN), ("C", INF), ("z", NAN), ("z", INF), ("z", -INF),
       ("dt", NAN), ("dt", INF), ("dt", -INF), ("dt_raw", NAN), ("dt_raw", INF),
       ("dt_raw", -INF)]
CPU_TOL = 1e-5
EMU_TOL = 2e-14


def where_in_chunk(Q, where):
    """The bad token: the middle, first or last token of chunk 1."""
    return {"mid": Q + Q // 2 - 3, "first": Q, "last": 2 * Q - 1}[where]


def make_problem(Q, t, seq, softplus, dtype=torch.float32, b=2, h=2, g=1, p=8, n=7, seed=0,
                 device="cpu"):
    """Inputs of a partial-last-chunk problem holding token t; seq: seq_idx resets at Q // 3
    (before t) and at t + 3 (after t, inside t's chunk when t is not its last token)."""
    l = 2 * Q + Q // 2 + 3
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    dt = r(b, l, h) * 0.5 - 1.0 if softplus else torch.rand(b, l, h, generator=gen,
                                                             dtype=F64) * 0.4 + 0.05
    args = dict(x=r(b, l, h, p), dt=dt, A=-torch.rand(h, generator=gen, dtype=F64) - 0.5,
                B=r(b, l, g, n), C=r(b, l, g, n))
    kw = dict(D=r(h) if softplus else None, z=r(b, l, h, p),
              dt_bias=r(h) * 0.3 if softplus else None, initial_states=r(b, h, p, n),
              seq_idx=None, dt_softplus=softplus, dt_limit=(0.0, math.inf))
    if seq:
        s = torch.zeros(b, l, dtype=torch.int32)
        s[:, Q // 3:] = 1
        if t + 3 < l:
            s[:, t + 3:] = 2
        kw["seq_idx"] = s
    # x, B, C, z in `dtype`; dt, A, D, dt_bias and the initial state in float32 (float64 for
    # the emulation), as a model passes them
    small = F64 if dtype == F64 else torch.float32

    def cast(k, v):
        if not isinstance(v, torch.Tensor):
            return v
        if not v.is_floating_point():
            return v.to(device)
        return v.to(device=device, dtype=dtype if k in ("x", "B", "C", "z") else small)
    return ({k: cast(k, v) for k, v in args.items()}, {k: cast(k, v) for k, v in kw.items()})


def inject(args, kw, name, t, value):
    """Copies of the inputs with one bad entry at token t of batch row 0 (head 0, channel 1,
    state index 2)."""
    args = dict(args)
    kw = dict(kw)
    key = "dt" if name == "dt_raw" else name
    src = args if key in args else kw
    bad = src[key].clone()
    if key in ("x", "z"):
        bad[0, t, 0, 1] = value
    elif key in ("B", "C"):
        bad[0, t, 0, 2] = value
    else:
        bad[0, t, 0] = value
    src[key] = bad
    return args, kw


def as_reference(d):
    """Keyword arguments for the float64 recurrence on the CPU."""
    return {k: (v.cpu().to(F64) if v.is_floating_point() else v.cpu())
            if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def rel_err_finite(got, ref):
    """max|got - ref| / max|ref| over the entries where ref is finite (got must be finite
    there too)."""
    ok = torch.isfinite(ref)
    if not ok.any():
        return 0.0
    g, r = got.to(F64)[ok], ref[ok]
    assert torch.isfinite(g).all(), "non-finite where the recurrence is finite"
    scale = r.abs().max().item() or 1.0
    return (g - r).abs().max().item() / scale


def check_contract(run, args, kw, name, value, t, Q, tol, strict_nonfinite):
    """The module docstring's contract for one bad entry; returns (error of out, of final)."""
    bad_args, bad_kw = inject(args, kw, name, t, value)
    y_clean, h_clean = run(args, kw)
    y, h = run(bad_args, bad_kw)
    assert torch.equal(y[1:], y_clean[1:]), "another batch row changed"
    assert torch.equal(y[0, :t], y_clean[0, :t]), "an output before the bad token changed"
    y_ref, h_ref, _ = ssd_recurrence(**as_reference(bad_args), **as_reference(bad_kw))
    y, h = y.cpu(), h.cpu()
    bad_ref = ~torch.isfinite(y_ref)
    if strict_nonfinite:
        assert torch.equal(~torch.isfinite(y), bad_ref), "non-finite where the recurrence is not"
    else:
        assert not torch.isfinite(y[:, t][bad_ref[:, t]]).any(), "the bad token's output is finite"
        nxt = (t // Q + 1) * Q
        assert not torch.isfinite(y[:, nxt:][bad_ref[:, nxt:]]).any(), \
            "a later chunk is finite where the recurrence is not"
    e_y = rel_err_finite(y, y_ref)
    e_h = rel_err_finite(h, h_ref)
    assert e_y <= tol, f"out error {e_y:.2e} > {tol:.0e}"
    assert e_h <= tol, f"final-state error {e_h:.2e} > {tol:.0e}"
    return e_y, e_h


def check_decay_limits(run, args, kw, tol):
    """A = -inf for head 0 (decay exactly 0 where dt > 0) and A = 0 for head 1 (decay 1):
    everything matches the recurrence, which is finite."""
    A = args["A"].clone()
    A[0], A[1] = -INF, 0.0
    args = dict(args, A=A)
    y, h = run(args, kw)
    y_ref, h_ref, _ = ssd_recurrence(**as_reference(args), **as_reference(kw))
    assert torch.isfinite(y_ref).all() and torch.isfinite(h_ref).all()
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    e_y, e_h = rel_err_finite(y.cpu(), y_ref), rel_err_finite(h.cpu(), h_ref)
    assert e_y <= tol and e_h <= tol, (e_y, e_h)
    return e_y, e_h


# ----------------------------------------------------------------------------------------------
# CPU path (reference/chunked.py through the public function)
# ----------------------------------------------------------------------------------------------

def cpu_run(Q):
    def run(args, kw):
        return mamba_chunk_scan_combined(**args, chunk_size=Q, return_final_states=True, **kw)
    return run


@pytest.mark.parametrize("where", ["mid", "first", "last"])
@pytest.mark.parametrize("seq", [False, True], ids=["no_seq", "seq_idx"])
@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_cpu_path_causal(name, value, seq, where):
    """Every bad input at chunk 64."""
    t = where_in_chunk(64, where)
    args, kw = make_problem(64, t, seq, softplus=name != "dt_raw")
    check_contract(cpu_run(64), args, kw, name, value, t, 64, CPU_TOL, strict_nonfinite=True)


CPU_LARGE_CHUNKS = [("x", NAN, "mid", True, 128), ("B", INF, "first", False, 128),
                    ("dt", NAN, "last", True, 128), ("x", INF, "last", False, 256),
                    ("B", NAN, "mid", True, 256), ("dt_raw", INF, "first", True, 256)]


@pytest.mark.parametrize("name, value, where, seq, Q", CPU_LARGE_CHUNKS,
                         ids=[f"{e[0]}={e[1]}-{e[2]}-{'seq' if e[3] else 'noseq'}-Q{e[4]}"
                              for e in CPU_LARGE_CHUNKS])
def test_cpu_path_causal_large_chunks(name, value, where, seq, Q):
    t = where_in_chunk(Q, where)
    args, kw = make_problem(Q, t, seq, softplus=name != "dt_raw")
    check_contract(cpu_run(Q), args, kw, name, value, t, Q, CPU_TOL, strict_nonfinite=True)


@pytest.mark.parametrize("Q", [64, 256])
@pytest.mark.parametrize("seq", [False, True], ids=["no_seq", "seq_idx"])
def test_cpu_path_decay_limits(seq, Q):
    args, kw = make_problem(Q, Q, seq, softplus=True)
    check_decay_limits(cpu_run(Q), args, kw, CPU_TOL)


def dt_zero_problem(**kw):
    """A = -inf and A = 0 heads with dt' = 0 at tokens 70..74 (dt_limit (0, 10) clamps the
    negative raw dt there to 0): exp(A dt') is 1 there, not NaN."""
    args, kw = make_problem(64, 64, False, softplus=False, **kw)
    args["dt"] = args["dt"].clone()
    args["dt"][:, 70:75] = -1.0
    return args, dict(kw, dt_limit=(0.0, 10.0))


def test_cpu_path_dt_zero_with_A_minus_inf():
    check_decay_limits(cpu_run(64), *dt_zero_problem(), CPU_TOL)


# ----------------------------------------------------------------------------------------------
# the kernels' source, emulated in float64 on the CPU
# ----------------------------------------------------------------------------------------------

def emulated_run(Q, block_q, causal=1, dstate_pad=8, **over):
    """The forward plan's launches on the emulated ct, with scan_causal=`causal` (None: the
    shape rule's own choice, not overridden)."""
    pytest.importorskip("cuda.tile")
    from mamba2_cutile.runtime import dt_clamp_bounds
    from mamba2_cutile.ssd import forward
    from support.emulator import emulate_launch

    def run(args, kw, launches=None):
        """The plan's launches (the first `launches` of them), emulated: (out, final)."""
        x, dt, A, B, C = (args[k] for k in ("x", "dt", "A", "B", "C"))
        b, l, h, p = x.shape
        n = B.shape[3]
        nc = -(-l // Q)
        nan = lambda *s: torch.full(s, NAN, dtype=F64)  # noqa: E731
        dt_buf, cum_buf, states = nan(b, h, nc * Q), nan(b, h, nc * Q), nan(b, h, nc, p, n)
        final, out = nan(b, h, p, n), nan(b, l, h, p)
        cfg = forward.forward_shape_config(b, h, p, n, Q, F64)
        cfg = replace(cfg, cumsum_block_h=2, state_block_p=8, state_block_n=8, scan_block_p=8,
                      dstate_pad=dstate_pad, scan_block_q=block_q,
                      scan_causal=cfg.scan_causal if causal is None else causal,
                      scan_block_n=8 if dstate_pad > 8 else 0, **over)
        mode = cfg.scan_causal
        lo, hi = dt_clamp_bounds(kw["dt_limit"])
        seq = kw["seq_idx"]
        calls = forward.forward_plan(x, dt, A, B, C, kw["z"], kw["D"], kw["dt_bias"], lo, hi,
                                     kw["dt_softplus"], kw["initial_states"],
                                     None if seq is None else seq.to(torch.int32),
                                     dt_buf, cum_buf, states, final, out, cfg)
        if seq is not None:              # the run starts are written by kernel 1: poison them
            calls[0].args[8].fill_(-(2**30))
        if mode:
            # chunk_scan's flags read "clean" unless written: a flag the first launch fails to
            # write skips its tile's fix-up, and the bad-input cases below fail (a NaN fill would
            # read "recompute" in every mode and hide it)
            for c in calls:
                if variants.kernel_name(c) == "chunk_scan":
                    c.args[-2].fill_(0.0)
        if mode in (4, 5):               # the same for chunk_state_pass's chunk flags (the
            for c in calls:              # walk's run flags)
                if variants.kernel_name(c) in ("chunk_state_pass", "chunk_scan_walk"):
                    variants.kernel_arg(c, "flags").fill_(0.0)
        for c in calls:                  # scan_cb's scratch: a block read unwritten is NaN
            if variants.kernel_name(c) == "chunk_cb":
                c.args[2].fill_(NAN)
        emulate_launch(calls[:launches])
        run.last_calls = calls
        return out, final
    return run


EMULATED = [  # (input, value, where, seq, Q, block_q): every input, place and chunk size once
    ("x", NAN, "mid", False, 64, 64), ("x", INF, "first", True, 64, 32),
    ("B", NAN, "mid", True, 64, 64), ("B", -INF, "last", False, 64, 64),
    ("C", INF, "first", False, 64, 64), ("z", NAN, "last", True, 64, 64),
    ("dt", NAN, "mid", True, 64, 64), ("dt_raw", INF, "first", False, 64, 64),
    ("x", -INF, "last", True, 128, 64), ("B", NAN, "first", True, 256, 128),
]


#: scan_causal 1, 2 and 4 on every case above; 3 (per-row sums) differs from 2 only in the
#: flags' width: every input once
EMULATED_CAUSAL = ([pytest.param(*e, c, id=f"{e[0]}={e[1]}-{e[2]}-{'seq' if e[3] else 'noseq'}"
                                 f"-Q{e[4]}-bq{e[5]}-causal{c}")
                    for c in (1, 2, 4, 5) for e in EMULATED]
                   + [pytest.param(*EMULATED[i], 3, id=f"{EMULATED[i][0]}-causal3")
                      for i in (1, 2, 4, 5, 6)])


@pytest.mark.parametrize("over", [dict(scan_cb=1), dict(state_segments=3, segment_fold=1),
                                  dict(scan_cb=1, state_segments=2, segment_fold=1),
                                  dict(scan_heads=2),
                                  dict(state_segments=3, segment_fold=1, scan_heads=2),
                                  dict(state_segments=3, state_resweep=1),
                                  dict(state_segments=2, state_resweep=1, scan_heads=2),
                                  dict(scan_walk=1), dict(scan_walk=1, state_segments=3)],
                         ids=["cb", "fold", "cb-fold", "heads", "heads-fold", "resweep",
                              "heads-resweep", "walk", "walk-segments"])
@pytest.mark.parametrize("name, value, where, seq, Q, block_q",
                         [e for e in EMULATED if e[4] == 64][:6])
def test_emulated_kernels_causal_with_scan_cb_and_fold(name, value, where, seq, Q, block_q,
                                                       over):
    """scan_cb, segment_fold, state_resweep and scan_heads (chunk_scan_group, both heads of the
    group in one program) under scan_causal=4 keep the contract: outputs before the bad token and other
    rows equal a clean run's, the rest as the recurrence."""
    t = where_in_chunk(Q, where)
    args, kw = make_problem(Q, t, seq, softplus=name != "dt_raw", dtype=F64, b=2, h=2, p=8,
                            n=7)
    check_contract(emulated_run(Q, block_q, 4, **over), args, kw, name, value, t, Q, EMU_TOL,
                   strict_nonfinite=False)


@pytest.mark.parametrize("causal", [4, 5])
@pytest.mark.parametrize("name, value, where, seq, Q, block_q",
                         [("x", -INF, "last", True, 128, 64), ("dt", NAN, "mid", True, 64, 16),
                          ("B", INF, "mid", True, 128, 32), ("x", NAN, "mid", False, 64, 16),
                          ("C", NAN, "mid", False, 128, 128)])
def test_emulated_kernels_causal_with_scan_heads(name, value, where, seq, Q, block_q, causal):
    """scan_heads=4 (chunk_scan_group: a group's 4 heads in one program, several key blocks
    per chunk) under the flagged-chunk fix-ups: the clean run sums key block by key block in
    chunk_scan's order, so the rows before a bad token of a recomputed chunk stay
    bit-identical (torch.equal) to a clean run's."""
    t = where_in_chunk(Q, where)
    args, kw = make_problem(Q, t, seq, softplus=name != "dt_raw", dtype=F64, b=2, h=4, p=8,
                            n=7)
    check_contract(emulated_run(Q, block_q, causal, scan_heads=4), args, kw, name, value, t,
                   Q, EMU_TOL, strict_nonfinite=False)


@pytest.mark.parametrize("name, value, where, seq, Q, block_q, causal", EMULATED_CAUSAL)
def test_emulated_kernels_causal(name, value, where, seq, Q, block_q, causal):
    """The forward plan's launches with scan_causal=1 to 4 (decay_cumsum, chunk_state_pass
    and chunk_scan twice) on the emulated ct: query blocks of the whole chunk and of part of
    it (the key-block loop)."""
    t = where_in_chunk(Q, where)
    args, kw = make_problem(Q, t, seq, softplus=name != "dt_raw", dtype=F64, b=2, h=2, p=8,
                            n=7)
    check_contract(emulated_run(Q, block_q, causal), args, kw, name, value, t, Q, EMU_TOL,
                   strict_nonfinite=False)


@pytest.mark.parametrize("name, value, where, seq", [("x", NAN, "mid", False),
                                                     ("B", INF, "first", True),
                                                     ("dt", NAN, "last", True)],
                         ids=["x=nan-mid", "B=inf-first-seq", "dt=nan-last-seq"])
def test_emulated_default_is_causal(name, value, where, seq):
    """The shape rule's own config, scan_causal not overridden, keeps the contract: the default
    forward plan is the causal one (the state pass writes flags, a fix-up launch follows)."""
    from mamba2_cutile.ssd import forward

    Q = 64
    t = where_in_chunk(Q, where)
    args, kw = make_problem(Q, t, seq, softplus=True, dtype=F64, b=2, h=2, p=8, n=7)
    run = emulated_run(Q, 32, causal=None)
    check_contract(run, args, kw, name, value, t, Q, EMU_TOL, strict_nonfinite=False)
    calls = run.last_calls
    assert [variants.kernel_name(c) for c in calls] == [
        "decay_cumsum", "chunk_state_pass", "chunk_scan", "chunk_scan"]
    assert variants.kernel_arg(calls[1], "FLAG") is True
    # and at the shapes users run, through the dispatcher (tuning table and seq_idx rule)
    for shape in [(4, 8, 64, 128, 128), (2, 80, 64, 128, 256), (8, 128, 64, 128, 256),
                  (1, 24, 64, 128, 256), (2, 32, 64, 256, 256), (2, 48, 128, 128, 256)]:
        for has_seq in (False, True):
            cfg = forward.forward_config(*shape, torch.bfloat16, seqlen=8192, device_index=0,
                                         has_seq=has_seq)
            assert cfg.scan_causal == 4, (shape, has_seq)


@pytest.mark.parametrize("causal", [2, 3])
@pytest.mark.parametrize("seq", [False, True], ids=["no_seq", "seq_idx"])
def test_emulated_fix_pass_spans(seq, causal):
    """scan_causal 2/3 with more tiles than one FIX_SPAN program reads (b=2, h=4, 16-token
    query blocks: 88 tiles, 2 spans, the second partial), a bad x in a tile of the second
    span (batch row 1, head 3): it is recomputed, the earlier outputs equal a clean run's, and
    the fix pass changes nothing on clean input."""
    from mamba2_cutile.kernels.chunk_scan import FIX_SPAN

    Q, block_q = 64, 16
    t = where_in_chunk(Q, "mid")
    args, kw = make_problem(Q, t, seq, softplus=True, dtype=F64, b=2, h=4, p=8, n=7)
    run = emulated_run(Q, block_q, causal)
    y_clean, h_clean = run(args, kw)
    n_q = -(-args["x"].shape[1] // block_q)
    assert FIX_SPAN < 2 * 4 * n_q < 2 * FIX_SPAN
    assert ((1 * 4 + 3) * n_q + t // block_q) // FIX_SPAN == 1     # the bad tile's span
    bad = {**args, "x": args["x"].clone()}
    bad["x"][1, t, 3, 1] = NAN
    y, h = run(bad, kw)
    assert torch.equal(y[0], y_clean[0]) and torch.equal(y[1, :, :3], y_clean[1, :, :3])
    assert torch.equal(y[1, :t], y_clean[1, :t]), "an output before the bad token changed"
    y_ref, h_ref, _ = ssd_recurrence(**as_reference(bad), **as_reference(kw))
    assert rel_err_finite(y, y_ref) <= EMU_TOL and rel_err_finite(h, h_ref) <= EMU_TOL
    # on clean input the plain launch alone already gives every output
    y_plain, _ = run(args, kw, launches=-1)
    assert torch.equal(y_plain, y_clean)


@pytest.mark.parametrize("causal", [4, 5])
@pytest.mark.parametrize("seq", [False, True], ids=["no_seq", "seq_idx"])
def test_emulated_head_flags_many_heads(seq, causal):
    """scan_causal 4 with 24 (batch, head) programs in the fix-up pass (b=2, h=12; 5: 24 x 2,
    a program per query block of a chunk): a bad x in row 1, head 11 is fixed there, nothing
    else moves, and the fix pass changes nothing on clean input."""
    Q, block_q, h = 64, 32, 12
    t = where_in_chunk(Q, "mid")
    args, kw = make_problem(Q, t, seq, softplus=True, dtype=F64, b=2, h=h, p=8, n=7)
    run = emulated_run(Q, block_q, causal)
    y_clean, _ = run(args, kw)
    assert run.last_calls[-1].grid == (2 * h, 1 if causal == 4 else Q // block_q, 1)
    bad = {**args, "x": args["x"].clone()}
    bad["x"][1, t, 11, 1] = NAN
    y, h_fin = run(bad, kw)
    assert torch.equal(y[0], y_clean[0]) and torch.equal(y[1, :, :11], y_clean[1, :, :11])
    assert torch.equal(y[1, :t], y_clean[1, :t]), "an output before the bad token changed"
    y_ref, h_ref, _ = ssd_recurrence(**as_reference(bad), **as_reference(kw))
    assert rel_err_finite(y, y_ref) <= EMU_TOL and rel_err_finite(h_fin, h_ref) <= EMU_TOL
    y_plain, _ = run(args, kw, launches=-1)
    assert torch.equal(y_plain, y_clean)


@pytest.mark.parametrize("causal", [4, 5])
@pytest.mark.parametrize("second", ["x", "B"])
def test_emulated_chunk_flags_second_bad_value(second, causal):
    """scan_causal 4 finds every chunk holding a bad input in a flagged head: after a NaN x in
    chunk 0 (channel 1, whose state entries stay NaN), a second bad value in chunk 1 (x in
    channel 2, or B, in the same state tile) gets chunk 1 recomputed too, so its rows before
    that token equal those of a run with the first bad value alone."""
    Q, block_q = 64, 32
    t1, t2 = 10, where_in_chunk(Q, "mid")
    args, kw = make_problem(Q, t2, False, softplus=True, dtype=F64, b=1, h=2, p=8, n=7)
    run = emulated_run(Q, block_q, causal)
    one = {**args, "x": args["x"].clone()}
    one["x"][0, t1, 0, 1] = NAN
    y_one, _ = run(one, kw)
    two = {**one, second: one[second].clone()}
    two[second][0, t2, 0, 2] = NAN
    y_two, _ = run(two, kw)
    torch.testing.assert_close(y_two[0, :t2], y_one[0, :t2], rtol=0, atol=0, equal_nan=True)
    assert y_two[0, :t2, 0, 2].isfinite().all() and not y_two[0, t1:, 0, 1].isfinite().any()


def twelve_chunk_problem(Q, h, p, n, seed):
    """Batch 1, one group, 11 chunks of Q tokens and a partial twelfth, no options (float64)."""
    l = 11 * Q + 20
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    args = dict(x=r(1, l, h, p), dt=torch.rand(1, l, h, generator=gen, dtype=F64) * 0.4 + 0.05,
                A=-torch.rand(h, generator=gen, dtype=F64) - 0.5, B=r(1, l, 1, n),
                C=r(1, l, 1, n))
    kw = dict(D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
              dt_softplus=False, dt_limit=(0.0, math.inf))
    return args, kw


@pytest.mark.parametrize("segments, bad_chunk", [(1, 2), (1, 11), (2, 9), (2, 3)],
                         ids=["chunk2", "last-chunk", "segment1", "segment0"])
def test_emulated_head_flags_find_the_chunk(segments, bad_chunk):
    """scan_causal 4 over 12 chunks (the last partial), with one or two state segments: a
    bad x flags only the state programs whose run holds it (one flag per program, checked
    after the chunk loop), the fix-up pass finds its chunk among the head's, and the outputs
    keep the contract."""
    Q, h = 64, 2
    args, kw = twelve_chunk_problem(Q, h, p=8, n=7, seed=4)
    l = args["x"].shape[1]
    over = dict(state_segments=segments) if segments > 1 else {}
    run = emulated_run(Q, Q, 4, **over)
    y_clean, _ = run(args, kw)
    state_flags = variants.kernel_arg(run.last_calls[1], "flags")
    assert state_flags.shape == (h, segments)     # one 8 x 8 state tile
    assert not state_flags.any(), "a clean run flagged"
    t = bad_chunk * Q + min(17, l - 1 - bad_chunk * Q)
    bad = {**args, "x": args["x"].clone()}
    bad["x"][0, t, 1, 3] = NAN
    y, h_fin = run(bad, kw)
    want = torch.zeros(h, segments)
    want[1, 0 if segments == 1 else bad_chunk // 6] = 1.0
    assert torch.equal(variants.kernel_arg(run.last_calls[1], "flags"), want)
    assert torch.equal(y[0, :, 0], y_clean[0, :, 0]) and torch.equal(y[0, :t], y_clean[0, :t])
    y_ref, h_ref, _ = ssd_recurrence(**as_reference(bad), **as_reference(kw))
    assert rel_err_finite(y, y_ref) <= EMU_TOL and rel_err_finite(h_fin, h_ref) <= EMU_TOL
    assert not torch.isfinite(y[0, t:, 1, 3]).any()


def test_emulated_head_flags_state_tiles_and_segments():
    """scan_causal 4 with 3 x 3 state tiles (headdim and dstate 20 in tiles of 8) and two state
    segments over 12 chunks: a bad B at state index 19 in segment 1 sets exactly the flags of
    the three state programs whose tile holds that index in that segment, in both heads of
    the group (column (p_tile * n_tiles + n_tile) * segments + segment), and the outputs keep
    the contract."""
    Q, h = 64, 2
    args, kw = twelve_chunk_problem(Q, h, p=20, n=20, seed=5)
    run = emulated_run(Q, Q, 4, dstate_pad=32, state_segments=2)
    y_clean, _ = run(args, kw)
    t = 9 * Q + 5
    bad = {**args, "B": args["B"].clone()}
    bad["B"][0, t, 0, 19] = NAN
    y, h_fin = run(bad, kw)
    flags = variants.kernel_arg(run.last_calls[1], "flags")
    want = torch.zeros(h, 3 * 3 * 2)
    want[:, [(pt * 3 + 2) * 2 + 1 for pt in range(3)]] = 1.0
    assert torch.equal(flags, want)
    assert torch.equal(y[0, :t], y_clean[0, :t])
    y_ref, h_ref, _ = ssd_recurrence(**as_reference(bad), **as_reference(kw))
    assert rel_err_finite(y, y_ref) <= EMU_TOL and rel_err_finite(h_fin, h_ref) <= EMU_TOL


@pytest.mark.parametrize("causal", [4, 5])
def test_emulated_chunk_flags_several_state_tiles(causal):
    """scan_causal 4 with 3 x 3 state tiles per head (headdim and dstate 20 in tiles of 8,
    dstate padded to 32: nine flag columns read as 16) and seq_idx: a bad B at one state index
    of batch row 1 is fixed there, and nothing else moves."""
    Q = 64
    t = where_in_chunk(Q, "mid")
    args, kw = make_problem(Q, t, True, softplus=True, dtype=F64, b=2, h=2, p=20, n=20)
    run = emulated_run(Q, 32, causal, dstate_pad=32)
    y_clean, _ = run(args, kw)
    bad = {**args, "B": args["B"].clone()}
    bad["B"][1, t, 0, 19] = NAN
    y, h_fin = run(bad, kw)
    assert torch.equal(y[0], y_clean[0]) and torch.equal(y[1, :t], y_clean[1, :t])
    y_ref, h_ref, _ = ssd_recurrence(**as_reference(bad), **as_reference(kw))
    assert rel_err_finite(y, y_ref) <= EMU_TOL and rel_err_finite(h_fin, h_ref) <= EMU_TOL


def test_emulated_default_not_causal():
    """With scan_causal=0 (the plain kernels) a NaN x reaches the earlier rows of its query
    block through the masked zeros of the (S X) MMA: the gap the causal modes close."""
    Q = 64
    t = where_in_chunk(Q, "mid")
    args, kw = make_problem(Q, t, False, softplus=True, dtype=F64, b=2, h=2, p=8, n=7)
    bad_args, bad_kw = inject(args, kw, "x", t, NAN)
    y, _ = emulated_run(Q, 64, causal=0)(bad_args, bad_kw)
    assert not torch.isfinite(y[0, Q:t]).all()


@pytest.mark.parametrize("causal", [0, 1, 2, 3, 4],
                         ids=["plain", "causal1", "causal2", "causal3", "causal4"])
@pytest.mark.parametrize("seq, Q, block_q", [(False, 64, 64), (True, 64, 32)])
def test_emulated_kernels_decay_limits(seq, Q, block_q, causal):
    args, kw = make_problem(Q, Q, seq, softplus=True, dtype=F64)
    check_decay_limits(emulated_run(Q, block_q, causal), args, kw, EMU_TOL)


@pytest.mark.parametrize("causal", [0, 1, 2, 3, 4],
                         ids=["plain", "causal1", "causal2", "causal3", "causal4"])
def test_emulated_kernels_dt_zero_with_A_minus_inf(causal):
    check_decay_limits(emulated_run(64, 32, causal), *dt_zero_problem(dtype=F64), EMU_TOL)


#: the walk (scan_walk, no seq_idx): every bad input at each place, one run and flags from
#: its own last state (causal 4); then runs from chunk_state_carry's entering states (a bad
#: run's NaN reaching the later ones), scan_causal 5 and chunk 128
WALK_CAUSAL = ([pytest.param(n, v, w, 64, 1, 4, id=f"{n}={v}-{w}") for n, v in BAD
                for w in ("mid", "first", "last")]
               + [pytest.param(n, v, w, Q, segs, causal,
                               id=f"{n}={v}-{w}-Q{Q}-S{segs}-c{causal}")
                  for n, v, w, Q, segs, causal in [
                      ("x", NAN, "mid", 64, 3, 4), ("B", INF, "first", 64, 3, 4),
                      ("dt", NAN, "last", 64, 3, 5), ("C", -INF, "mid", 128, 2, 4),
                      ("x", -INF, "last", 128, 3, 5), ("dt_raw", INF, "mid", 128, 1, 5),
                      ("z", NAN, "first", 64, 2, 5), ("B", NAN, "mid", 128, 3, 4)]])


def walk_contract(name, value, where, Q, causal, **config):
    """The bad-input contract of the walk (scan_walk=1 and `config`) with one bad `name` at
    `where` in chunk 1 of a 3-chunk float64 problem; returns the launches' kernel names."""
    t = where_in_chunk(Q, where)
    args, kw = make_problem(Q, t, False, softplus=name != "dt_raw", dtype=F64, b=2, h=2, p=8,
                            n=7)
    run = emulated_run(Q, Q, causal, scan_walk=1, **config)
    check_contract(run, args, kw, name, value, t, Q, EMU_TOL, strict_nonfinite=False)
    return [variants.kernel_name(c) for c in run.last_calls]


@pytest.mark.parametrize("name, value, where, Q, segments, causal", WALK_CAUSAL)
def test_emulated_walk_causal(name, value, where, Q, segments, causal):
    """scan_walk: the plain walk flags each run whose last state is non-finite, and its second
    launch recomputes the flagged runs' chunks holding a bad input causally: outputs before
    the bad token equal a clean run's bit for bit, the rest follow the recurrence. The problem
    has 3 chunks, so 3 runs put the bad token's chunk in a run of its own."""
    names = walk_contract(name, value, where, Q, causal, state_segments=segments)
    assert "chunk_scan_walk" in names


#: the walk forming its runs' entering states itself (walk_carry, 2-3 runs): a bad run's
#: NaN reaching the later ones through them
WALK_CARRY_CAUSAL = [pytest.param(n, v, w, Q, segs, causal,
                                  id=f"{n}={v}-{w}-Q{Q}-S{segs}-c{causal}")
                     for n, v, w, Q, segs, causal in [
                         ("x", NAN, "mid", 64, 3, 4), ("B", INF, "first", 64, 3, 4),
                         ("dt", NAN, "last", 64, 3, 5), ("C", -INF, "mid", 128, 2, 4),
                         ("dt_raw", INF, "mid", 128, 3, 5), ("z", NAN, "first", 64, 2, 4),
                         ("dt", -INF, "mid", 64, 3, 4)]]


@pytest.mark.parametrize("name, value, where, Q, segments, causal", WALK_CARRY_CAUSAL)
def test_emulated_walk_carry_causal(name, value, where, Q, segments, causal):
    """walk_carry: each walk program's own entering state (no chunk_state_carry launch) keeps
    the contract; the fix-up launch forms the same entering states again."""
    names = walk_contract(name, value, where, Q, causal, state_segments=segments,
                          walk_carry=1)
    assert names == ["decay_cumsum", "chunk_state_pass", "chunk_scan_walk",
                     "chunk_scan_walk"], names


#: each program walking its own flagged run again (walk_fix_inline): one run, runs from
#: chunk_state_carry's entering states and from their own (walk_carry), both causal forms
WALK_INLINE_CAUSAL = [pytest.param(n, v, w, Q, segs, carry, causal,
                                   id=f"{n}={v}-{w}-Q{Q}-S{segs}-carry{carry}-c{causal}")
                      for n, v, w, Q, segs, carry, causal in [
                          ("x", NAN, "mid", 64, 1, 0, 4), ("B", INF, "first", 64, 1, 0, 4),
                          ("dt", NAN, "last", 64, 1, 0, 5), ("C", -INF, "mid", 128, 1, 0, 4),
                          ("dt_raw", INF, "mid", 64, 1, 0, 4), ("z", NAN, "first", 64, 1, 0, 5),
                          ("x", -INF, "last", 64, 3, 1, 4), ("B", NAN, "mid", 128, 2, 1, 4),
                          ("dt", -INF, "mid", 64, 3, 1, 5), ("x", INF, "first", 64, 3, 0, 4),
                          ("dt_raw", NAN, "last", 128, 3, 0, 4)]]


@pytest.mark.parametrize("name, value, where, Q, segments, carry, causal", WALK_INLINE_CAUSAL)
def test_emulated_walk_fix_inline_causal(name, value, where, Q, segments, carry, causal):
    """walk_fix_inline: a program whose run ends in a non-finite state walks it again itself
    (no flags, no second launch) and keeps the contract."""
    names = walk_contract(name, value, where, Q, causal, state_segments=segments,
                          walk_carry=carry, walk_fix_inline=1)
    runs = ["chunk_state_pass"] + ["chunk_state_carry"] * (not carry) if segments > 1 else []
    assert names == ["decay_cumsum"] + runs + ["chunk_scan_walk"], names


@pytest.mark.parametrize("segments, carry", [(1, 0), (3, 0), (3, 1)])
def test_emulated_walk_decay_limits(segments, carry):
    run = emulated_run(64, 64, 4, scan_walk=1, state_segments=segments, walk_carry=carry)
    check_decay_limits(run, *make_problem(64, 64, False, softplus=True, dtype=F64), EMU_TOL)
    check_decay_limits(run, *dt_zero_problem(dtype=F64), EMU_TOL)
    names = [variants.kernel_name(c) for c in run.last_calls]
    assert "chunk_scan_walk" in names and "decay_cumsum" in names
    assert ("chunk_state_carry" in names) is (segments > 1 and not carry)


# ----------------------------------------------------------------------------------------------
# GPU: the kernels themselves
# ----------------------------------------------------------------------------------------------

def gpu_run(Q, causal=1, extra=""):
    """The public function under MAMBA2_CUTILE_CONFIG=scan_causal=`causal` (0: the plain
    forward; None: the shape rule's choice, 4)
    and the config fields in `extra` ("state_segments=4,...")."""
    spec = ",".join(f for f in ("" if causal is None else f"scan_causal={causal}", extra) if f)

    def run(args, kw):
        saved = os.environ.get(ENV_FORWARD)
        os.environ[ENV_FORWARD] = spec or "default"
        try:
            y, h = mamba_chunk_scan_combined(**args, chunk_size=Q, return_final_states=True,
                                             **kw)
            torch.cuda.synchronize()
        finally:
            if saved is None:
                os.environ.pop(ENV_FORWARD)
            else:
                os.environ[ENV_FORWARD] = saved
        return y, h
    return run


def _gpu_problem(Q, t, seq, softplus, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # headdim 80 and dstate 96: not multiples of the tiles
    return make_problem(Q, t, seq, softplus, dtype=dtype, b=2, h=4, g=2, p=80, n=96,
                        device="cuda")


GPU_CASES = ([pytest.param(torch.bfloat16, Q, w, id=f"bf16-Q{Q}-{w}")
              for Q in (64, 128, 256) for w in ("mid", "first", "last")]
             + [pytest.param(torch.float32, 128, "mid", id="fp32-Q128-mid")])


CAUSAL_MODES = pytest.mark.parametrize("causal", [1, 2, 3, 4, 5],
                                       ids=["causal1", "causal2", "causal3", "causal4",
                                            "causal5"])


@pytest.mark.gpu
@CAUSAL_MODES
@pytest.mark.parametrize("dtype, Q, where", GPU_CASES)
@pytest.mark.parametrize("seq", [False, True], ids=["no_seq", "seq_idx"])
@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_gpu_kernels_causal(name, value, seq, dtype, Q, where, causal):
    """Every bad input, place and chunk size in bf16; fp32 (the tf32 MMA path) at one; each
    causal form (`-k causal2` selects one)."""
    from support.gpu import log_result
    from support.tolerances import forward_tol

    t = where_in_chunk(Q, where)
    args, kw = _gpu_problem(Q, t, seq, name != "dt_raw", dtype)
    e_y, e_h = check_contract(gpu_run(Q, causal), args, kw, name, value, t, Q,
                              forward_tol(dtype), strict_nonfinite=False)
    log_result(f"out err {e_y:.2e}, final-state err {e_h:.2e} (finite entries), "
               f"tol {forward_tol(dtype):.0e}")


#: the shape rule's config where chunk_scan_group runs (long sequences at headdim <= 128):
#: computed at chunk 128, also for a chunk-256 call
GROUP_RULE = "chunk_size=128,scan_heads=16,scan_block_q=64,scan_occupancy=2"


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [False, True], ids=["no_seq", "seq_idx"])
@pytest.mark.parametrize("Q, where", [(128, "mid"), (256, "mid"), (256, "first"),
                                      (256, "last")])
@pytest.mark.parametrize("name, value", [("x", NAN), ("x", INF), ("B", INF), ("C", NAN),
                                         ("z", NAN), ("dt", INF)],
                         ids=["x=nan", "x=inf", "B=inf", "C=nan", "z=nan", "dt=inf"])
def test_gpu_group_launch_causal(name, value, Q, where, seq):
    """The group output launch (chunk_scan_group over 8 heads of a group, headdim 64, 64-token
    blocks) with the default causal form (4), computed at chunk 128 for chunk-128 and
    chunk-256 calls, as the shape rule runs long sequences: the contract of the module
    docstring (outputs before the bad token bit-identical to a clean run's)."""
    from support.gpu import log_result
    from support.tolerances import forward_tol

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    t = where_in_chunk(Q, where)
    args, kw = make_problem(Q, t, seq, True, dtype=torch.bfloat16, b=2, h=8, g=1, p=64, n=128,
                            device="cuda")
    e_y, e_h = check_contract(gpu_run(Q, None, GROUP_RULE), args, kw, name, value, t, Q,
                              forward_tol(torch.bfloat16), strict_nonfinite=False)
    log_result(f"out err {e_y:.2e}, final-state err {e_h:.2e} (finite entries), "
               f"tol {forward_tol(torch.bfloat16):.0e}")



@pytest.mark.gpu
@pytest.mark.parametrize("p", [80, 128])
@pytest.mark.parametrize("name, value", [("x", NAN), ("B", INF), ("C", NAN)],
                         ids=["x=nan", "B=inf", "C=nan"])
def test_gpu_group_launch_causal_two_p_tiles(name, value, p):
    """The group output launch over two 64-channel p-tiles (headdim 128, and 80 with a
    partial second tile), which the shape rule takes for long sequences since headdim 128
    joined it: a chunk-256 call computed at 128, one bad token mid-chunk, the same contract."""
    from support.gpu import log_result
    from support.tolerances import forward_tol

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    Q = 256
    t = where_in_chunk(Q, "mid")
    args, kw = make_problem(Q, t, False, True, dtype=torch.bfloat16, b=2, h=8, g=1, p=p,
                            n=128, device="cuda")
    e_y, e_h = check_contract(gpu_run(Q, None, GROUP_RULE), args, kw, name, value, t, Q,
                              forward_tol(torch.bfloat16), strict_nonfinite=False)
    log_result(f"headdim {p}: out err {e_y:.2e}, final-state err {e_h:.2e} (finite "
               f"entries), tol {forward_tol(torch.bfloat16):.0e}")

@pytest.mark.gpu
@pytest.mark.parametrize("Q, extra, n", [(64, "scan_block_p=64,state_segments=4", 128),
                                         (128, "scan_block_p=32", 128),
                                         (64, "scan_block_p=16,state_segments=2", 128),
                                         (64, "scan_block_p=64,state_segments=2", 128),
                                         (64, "scan_block_p=32", 256),
                                         (64, "scan_block_p=64,walk_fix_inline=1", 128),
                                         (64, "scan_block_p=16,walk_fix_inline=1", 128),
                                         (64, "scan_block_p=64,state_segments=4,walk_carry=1,"
                                              "walk_occupancy=2,walk_fix_inline=1", 128)],
                         ids=["q64-p64-seg4", "q128-p32", "q64-p16-seg2", "q64-p64-seg2",
                              "q64-p32-n256", "q64-p64-inline", "q64-p16-inline",
                              "q64-p64-seg4-carry-inline"])
@pytest.mark.parametrize("name, value, where", [("x", NAN, "mid"), ("x", INF, "first"),
                                                ("B", INF, "mid"), ("B", NAN, "last"),
                                                ("C", NAN, "mid"), ("z", INF, "mid"),
                                                ("dt", NAN, "first"), ("dt_raw", INF, "last")],
                         ids=["x=nan-mid", "x=inf-first", "B=inf-mid", "B=nan-last",
                              "C=nan-mid", "z=inf-mid", "dt=nan-first", "dt_raw=inf-last"])
def test_gpu_walk_causal(name, value, where, Q, extra, n):
    """The walk (scan_walk, bf16, headdim 64, dstate 128 or 256) under the default causal
    form (4: its runs' flags and the fix-up walk): the contract of the module docstring."""
    from support.gpu import log_result
    from support.tolerances import forward_tol

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    t = where_in_chunk(Q, where)
    args, kw = make_problem(Q, t, False, name != "dt_raw", dtype=torch.bfloat16, b=2, h=8,
                            g=1, p=64, n=n, device="cuda")
    e_y, e_h = check_contract(gpu_run(Q, None, f"chunk_size={Q},scan_walk=1,{extra}"), args,
                              kw, name, value, t, Q, forward_tol(torch.bfloat16),
                              strict_nonfinite=False)
    log_result(f"walk {extra}: out err {e_y:.2e}, final-state err {e_h:.2e} (finite "
               f"entries), tol {forward_tol(torch.bfloat16):.0e}")


MODES = pytest.mark.parametrize("causal", [0, 1, 2, 3, 4],
                                ids=["plain", "causal1", "causal2", "causal3", "causal4"])


@pytest.mark.gpu
@MODES
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("Q", [64, 128, 256])
@pytest.mark.parametrize("seq", [False, True], ids=["no_seq", "seq_idx"])
def test_gpu_kernels_decay_limits(seq, Q, dtype, causal):
    from support.gpu import log_result
    from support.tolerances import forward_tol

    args, kw = _gpu_problem(Q, Q, seq, True, dtype)
    e_y, e_h = check_decay_limits(gpu_run(Q, causal), args, kw, forward_tol(dtype))
    log_result(f"A=-inf/0 heads: out err {e_y:.2e}, final-state err {e_h:.2e}, "
               f"tol {forward_tol(dtype):.0e}")


@pytest.mark.gpu
@MODES
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_kernels_dt_zero_with_A_minus_inf(dtype, causal):
    from support.gpu import log_result
    from support.tolerances import forward_tol

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args, kw = dt_zero_problem(dtype=dtype, b=2, h=4, g=2, p=80, n=96, device="cuda")
    e_y, e_h = check_decay_limits(gpu_run(64, causal), args, kw, forward_tol(dtype))
    log_result(f"dt'=0 at A=-inf: out err {e_y:.2e}, final-state err {e_h:.2e}, "
               f"tol {forward_tol(dtype):.0e}")


@pytest.mark.gpu
@CAUSAL_MODES
def test_gpu_garbage_padding_seed_problem(causal):
    """The seed problem (B=4 T=16K H=8 P=64 N=128, chunk 128, bf16) with the last 1000 tokens
    of batch row 0 overwritten by NaN/Inf garbage in x, B, C and dt, with scan_causal 1, 2 or
    3 (the garbage starts inside a query block, where the default mode lets it reach the
    block's earlier rows): the real tokens' outputs equal a clean run's, and the clean run
    still matches the float64 recurrence. Also logs the forward time on the clean and on the
    garbage inputs (CUDA events, median of 20: eager, launch gaps included)."""
    from support.gpu import log_result, rel_err
    from support.tolerances import forward_tol

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mamba2_cutile.bench.problems import random_problem
    b, l, h, g, p, n, Q = 4, 16384, 8, 1, 64, 128, 128
    inp, kw = random_problem(b, l, h, g, p, n, torch.bfloat16, D="h", seed=0)
    cut = l - 1000
    bad = {k: v.clone() for k, v in inp.items()}
    for k in ("x", "B", "C", "dt"):
        tail = bad[k][0, cut:]
        tail.copy_(torch.where(torch.rand_like(tail, dtype=torch.float32) < 0.5,
                               torch.full_like(tail, NAN), torch.full_like(tail, INF)))

    run = gpu_run(Q, causal)

    def fwd(i):
        return run(i, kw)

    y_clean, _ = fwd(inp)
    y_bad, _ = fwd(bad)
    assert torch.equal(y_bad[1:], y_clean[1:])
    assert torch.equal(y_bad[0, :cut], y_clean[0, :cut])
    y_ref, _, _ = ssd_recurrence(**{k: v[:1, :2048] if v.dim() > 1 else v
                                    for k, v in inp.items()}, **kw)
    e = rel_err(y_clean[:1, :2048], y_ref)
    assert e <= forward_tol(torch.bfloat16), e

    def timed(i):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            fwd(i)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        return sorted(times)[len(times) // 2]

    fwd(inp)
    t_clean, t_bad = timed(inp), timed(bad)
    log_result(f"seed problem, scan_causal={causal}: clean {t_clean:.3f} ms, garbage tail "
               f"{t_bad:.3f} ms, clean err vs recurrence (first 2048 tokens of row 0) {e:.2e}")


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("segments, fold", [(1, 0), (3, 0), (6, 0), (3, 1), (6, 1)])
def test_emulated_packed_sequences_stay_apart(segments, fold, causal):
    """A NaN in one packed sequence never reaches the next one, in the default mode and with
    scan_causal: not through the chunk entry state into the rows of the chunk where the next
    sequence starts (chunk_scan selects the carried state away there: 0 * NaN would be NaN),
    nor, with state_segments, through the state entering a later run (chunk_state_carry
    selects it away where a reset zeroed the run's factor; with segment_fold chunk_scan
    selects it away likewise). 6 chunks of 16 in 3 runs of 2
    and 6 of 1 (1: the unsegmented pass); sequence 0 holds tokens 0-39 and a NaN x at token
    5; sequence 1 starts inside the second run's first chunk (token 40): every output of
    sequence 1 equals a clean run's."""
    from mamba2_cutile.ssd import forward
    from support.emulator import emulate_launch

    Q, l = 16, 96
    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    b, h, p, n = 1, 2, 8, 8
    x, B, C = r(b, l, h, p), r(b, l, 1, n), r(b, l, 1, n)
    dt = torch.rand(b, l, h, generator=gen, dtype=F64) * 0.3 + 0.05
    A = -torch.rand(h, generator=gen, dtype=F64) - 0.5
    seq = torch.zeros(b, l, dtype=torch.int32)
    seq[:, 40:] = 1

    def run(x, dt, B):
        nc = -(-l // Q)
        nan = lambda *s: torch.full(s, NAN, dtype=F64)  # noqa: E731
        out, final = nan(b, l, h, p), nan(b, h, p, n)
        cfg = forward.forward_shape_config(b, h, p, n, Q, F64)
        cfg = replace(cfg, cumsum_block_h=2, state_block_p=8, state_block_n=8, scan_block_p=8,
                      dstate_pad=8, scan_block_q=16, state_segments=segments,
                      scan_causal=causal, segment_fold=fold)
        calls = forward.forward_plan(x, dt, A, B, C, None, None, None, 0.0, math.inf, False,
                                     None, seq, nan(b, h, nc * Q), nan(b, h, nc * Q),
                                     nan(b, h, nc, p, n), final, out, cfg)
        calls[0].args[8].fill_(-(2**30))
        if causal:
            calls[-2].args[-2].fill_(0.0)      # the flags read "clean" unless written
        emulate_launch(calls)
        return out, final

    clean, clean_final = run(x, dt, B)
    bad = x.clone()
    bad[0, 5, 1, 3] = NAN
    y, final = run(bad, dt, B)
    assert torch.isfinite(clean).all()
    assert torch.equal(y[:, 40:], clean[:, 40:]), "the NaN reached the next sequence"
    assert torch.equal(final, clean_final)
    assert not torch.isfinite(y[:, 5:40, 1]).all()        # its own sequence does see it
    if causal:
        # bad B and dt in the chunk where sequence 1 starts: kept out of its rows by the
        # fix-up's selects (the default mode's masked products let the Inf B reach them);
        # the NaN dt's step enters the chunk's cumsum as -MAX_LOG2_STEP (decay_cumsum), so
        # sequence 1's G shifts by a constant: its decays equal to rounding, not bit for bit
        bad_dt, bad_b = dt.clone(), B.clone()
        bad_dt[0, 37, 0] = NAN
        bad_b[0, 38, 0, 2] = INF
        y, final = run(bad, bad_dt, bad_b)
        assert torch.isfinite(y[:, 40:]).all() and torch.isfinite(final).all()
        torch.testing.assert_close(y[:, 40:], clean[:, 40:], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(final, clean_final, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@MODES
@pytest.mark.parametrize("segments", [1, 4], ids=["one_run", "segments4"])
def test_gpu_packed_sequences_stay_apart(segments, causal):
    """On the GPU (bf16, chunk 64, 163 tokens packed as sequences of 100 / 31 / 32, NaN and
    Inf in x, B and dt of the first sequence's first chunk; also with state_segments=4 under
    state_occupancy=4): the other sequences' outputs and the final states equal a clean
    run's in every mode."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    Q = 64
    args, kw = make_problem(Q, 0, False, True, dtype=torch.bfloat16, b=2, h=4, g=2, p=80,
                            n=96, device="cuda")
    l = args["x"].shape[1]
    bounds = (0, 100, 131, l)       # starts inside chunks 1 and 2; the bad tokens in chunk 0
    seq = torch.zeros(2, l, dtype=torch.int32, device="cuda")
    for i, start in enumerate(bounds[1:-1], start=1):
        seq[:, start:] = i
    kw = {**kw, "seq_idx": seq}
    bad = {k: v.clone() for k, v in args.items()}
    for k, t, v in (("x", 11, NAN), ("B", 40, INF), ("dt", 50, NAN)):
        bad[k][:, t] = v
    run = gpu_run(Q, causal, f"state_segments={segments},state_occupancy=4"
                  if segments > 1 else "")
    y_clean, h_clean = run(args, kw)
    y_bad, h_bad = run(bad, kw)
    assert torch.isfinite(y_clean).all()
    assert torch.equal(y_bad[:, bounds[1]:], y_clean[:, bounds[1]:])
    assert torch.equal(h_bad, h_clean)
