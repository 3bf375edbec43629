"""CPU: the decode kernel's own source (`kernels/state_update.py`) run on the float64 emulation
of `ct` (tests/support/emulator.py), with the launch the GPU path plans
(`decode.plan.decode_plan`), against the float64 step-by-step definition
(`reference.selective_state_update_ref`).

Seeded random draws of shape (headdim and dstate not multiples of the tiles, groups, k steps),
layout (per-head stride-0 expansions or full tensors for dt, A, D and dt_bias, D and dt_bias of
shape (h,), strided views of x, B, C and z), options (z, D, dt_bias with softplus, slots with
padding rows and slots past the state, out_states) and config (every `DecodeConfig` field:
channel tiles, dstate slices, persistent and flat grids, TMA choices, bounds checks dropped),
including the 64-bit-index variant. The emulation zero-fills padded elements only under
PaddingMode.ZERO (NaN otherwise), fails on an unchecked access past an array, on a tile wholly
outside one, and on two programs writing one element: so a tile that needs bounds checks
without them, or a race between programs, fails here before any GPU time is spent.
"""

import math
import random

import pytest
import torch

from mamba2_cutile.decode import plan as decode_plan_mod
from mamba2_cutile.decode.plan import DecodeConfig, decode_plan
from mamba2_cutile.reference import selective_state_update_ref
from support import emulator

F64 = torch.float64
SENTINEL = 7.0        # out_states' fill: rows the kernel must not write keep it

#: the largest difference from the definition, relative to the largest element of each output,
#: over 3000 draws (seeds 0-2999): 1.4e-15 (y), 4.9e-16 (state), 6.2e-16 (out_states)
TOL = 4e-15


def _pow2_at_most(rng, cap, lo=1):
    return rng.choice([v for v in (1, 2, 4, 8, 16, 32, 64, 128, 256) if lo <= v <= cap])


def _view(rng, t):
    """`t`'s values, either contiguous or as a slice of a wider tensor (a strided view, as a
    slice of one projection's output)."""
    if rng.random() < 0.5:
        return t.clone()
    pad = rng.randint(1, 3)
    wide = torch.full((*t.shape[:-1], t.shape[-1] + pad), float("nan"), dtype=t.dtype)
    lo = rng.randint(0, pad)
    wide[..., lo:lo + t.shape[-1]] = t
    return wide[..., lo:lo + t.shape[-1]]


def draw(seed):
    """A random decode problem and config: (inputs, kwargs, cfg, force_int64, description)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=F64)  # noqa: E731
    b = rng.randint(1, 4)
    k = rng.choice([None, 1, 2, 3])
    g = rng.choice([1, 2])
    h = g * rng.choice([1, 2, 3])
    p = rng.choice([1, 3, 8, 13, 16, 20, 33])
    n = rng.choice([1, 5, 16, 20, 31, 32, 40])
    lead = (b,) if k is None else (b, k)
    kk = 1 if k is None else k
    nslots = b + rng.randint(0, 3)
    per_head = {name: rng.random() < 0.5 for name in ("dt", "A", "D", "bias")}

    if per_head["A"]:
        A = (-torch.exp(u(h) * math.log(16.0)))[:, None, None].expand(h, p, n)
    else:
        A = -torch.exp(u(h, p, n) * math.log(16.0))
    has_bias = rng.random() < 0.6
    shift = -1.5 if has_bias else 0.0      # softplus(dt + dt_bias) small, as in a real model
    if per_head["dt"]:
        dt = (u(*lead, h) * 0.3 + shift)[..., None].expand(*lead, h, p)
    else:
        dt = _view(rng, u(*lead, h, p) * 0.3 + shift)
    inp = dict(state=r(nslots, h, p, n), x=_view(rng, r(*lead, h, p)), dt=dt, A=A,
               B=_view(rng, r(*lead, g, n)), C=_view(rng, r(*lead, g, n)))
    kw = {}
    opts = []
    if rng.random() < 0.7:
        opts.append("D")
        kw["D"] = (r(h) if rng.random() < 0.5 else r(h)[:, None].expand(h, p)) \
            if per_head["D"] else r(h, p)
    if rng.random() < 0.5:
        opts.append("z")
        kw["z"] = _view(rng, r(*lead, h, p) * 2)
    if has_bias:
        opts.append("dt_bias")
        kw["dt_bias"] = ((0.5 * r(h) if rng.random() < 0.5 else (0.5 * r(h))[:, None]
                          .expand(h, p)) if per_head["bias"] else 0.5 * r(h, p))
        kw["dt_softplus"] = True
    elif rng.random() < 0.3:
        kw["dt_softplus"] = True
    if rng.random() < 0.6:
        opts.append("slots")
        # distinct slots, some rows padding (-1 or -5) or past the state (a padding row too on
        # the GPU, where the slots' values are not checked)
        slots = rng.sample(range(nslots), b)
        for row in range(b):
            v = rng.random()
            slots[row] = -1 if v < 0.15 else -5 if v < 0.2 else nslots + row if v < 0.3 \
                else slots[row]
        kw["state_batch_indices"] = torch.tensor(slots, dtype=torch.int32)
    if rng.random() < 0.5:
        opts.append("out_states")
        shape = (b, h, p, n) if k is None else (b, kk, h, p, n)
        kw["out_states"] = torch.full(shape, SENTINEL, dtype=F64)

    np_ = max(16, 1 << (n - 1).bit_length())
    cfg = dict(block_p=_pow2_at_most(rng, 64), dstate_pad=np_)
    if rng.random() < 0.5:
        cfg["block_n"] = _pow2_at_most(rng, np_, lo=4)
    grid = rng.choice(["plain", "persistent", "flat"])
    if grid == "persistent":
        cfg["persistent"] = rng.choice([1, 2])
    elif grid == "flat":
        cfg["flat"] = 1
    cfg.update(latency=rng.choice([0, 0, 2, 8]), tma=rng.choice([0, 1, 2]),
               tma_vec=rng.choice([0, 1]), unchecked=rng.choice([0, 1]),
               occupancy=rng.choice([0, 2, 4]), warps=rng.choice([0, 4, 8]))
    force_int64 = rng.random() < 0.2
    desc = (f"b={b} k={k} h={h} g={g} p={p} n={n} nslots={nslots} "
            f"per_head={[k_ for k_, v in per_head.items() if v]} opts={opts} cfg={cfg} "
            f"int64={force_int64}")
    return inp, kw, DecodeConfig(**cfg), force_int64, desc


def emulated_update(inp, kw, cfg, sms=4):
    """The planned launch run on the emulation: (y, new state, out_states or None)."""
    state = inp["state"].clone()
    x = inp["x"]
    y = torch.full(x.shape, float("nan"), dtype=F64)
    out_states = kw.get("out_states")
    out_states = None if out_states is None else out_states.clone()
    calls = decode_plan(state, x, inp["dt"], inp["A"], inp["B"], inp["C"], kw.get("D"),
                        kw.get("z"), kw.get("dt_bias"), kw.get("dt_softplus", False),
                        kw.get("state_batch_indices"), out_states, y, cfg)
    assert len(calls) == 1
    emulator.emulate_launch(calls)
    return y, state, out_states


def expected(inp, kw):
    """The definition, with the GPU's reading of slots past the state (padding rows)."""
    nslots = inp["state"].shape[0]
    ref_kw = {key: v for key, v in kw.items() if key != "out_states"}
    idx = kw.get("state_batch_indices")
    if idx is not None:
        ref_kw["state_batch_indices"] = torch.where(idx >= nslots, -1, idx)
    y, new, per_step = selective_state_update_ref(**inp, **ref_kw)
    return y, new, per_step, (None if idx is None else ref_kw["state_batch_indices"])


def _rel(a, b):
    if b.numel() == 0:
        return 0.0
    scale = b.abs().max().clamp_min(1e-300)
    return float((a - b).abs().max() / scale)


@pytest.mark.parametrize("seed", range(60))
def test_random_draw(seed, monkeypatch):
    inp, kw, cfg, force_int64, desc = draw(seed)
    # bounds checks may be dropped where the tiles divide the state whatever tileiras is here
    monkeypatch.setattr(decode_plan_mod, "_unchecked_supported", lambda: True)
    if force_int64:
        monkeypatch.setattr(decode_plan_mod, "needs_int64", lambda *ts: True)
    decode_plan_mod._PLAN_CACHE.clear()
    y, state, out_states = emulated_update(inp, kw, cfg)
    y_ref, new_ref, per_step, slots = expected(inp, kw)
    assert not y.isnan().any(), desc
    assert _rel(y, y_ref) <= TOL, (desc, _rel(y, y_ref))
    assert _rel(state, new_ref) <= TOL, (desc, _rel(state, new_ref))
    # slots no active row uses, padding rows' slots included, keep their values exactly
    used = set(range(inp["x"].shape[0])) if slots is None else \
        {int(s) for s in slots if s >= 0}
    for s in range(state.shape[0]):
        if s not in used:
            assert torch.equal(state[s], inp["state"][s]), (desc, s)
    if out_states is not None:
        steps = out_states if out_states.dim() == 5 else out_states.unsqueeze(1)
        active = torch.ones(steps.shape[0], dtype=torch.bool) if slots is None else slots >= 0
        assert _rel(steps[active], per_step[active]) <= TOL, desc
        assert (steps[~active] == SENTINEL).all(), desc      # padding rows: never written
