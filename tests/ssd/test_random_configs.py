"""CPU, float64: seeded random problems, options and configs through the emulated forward and
backward plans, against the float64 references.

The other emulation tests pin each path with hand-picked tiles; here every draw takes a shape
that is not a multiple of the tiles (headdim and dstate such as 5, 20 or 33), a random set of
the scan's options (D per head or channel, z, dt_bias, softplus, dt_limit, initial states,
dfinal, seq_idx with resets inside chunks, at chunk ends, at token 1, or every few tokens) and
a random valid config (tiles, segments, the output launch's forms, the backward's fused and
split launches, side streams): 40 draws each, about 15 s on 2 cores. Draws like these found a
dstate tile loaded wholly past dstate in bwd_chunk_dx_group (dstate 20 in 8-wide tiles;
backward draw 30 fails on that code).
"""

import math
import random
from dataclasses import replace

import pytest
import torch

pytest.importorskip("cuda.tile")

from mamba2_cutile.ssd import backward  # noqa: E402
from ssd.test_backward_emulation import (assert_close, emulated_grads,  # noqa: E402
                                         reference_grads)
from ssd.test_forward_emulation import check, small_forward_config  # noqa: E402
from support.emulator import F64  # noqa: E402


def pow2s(lo, hi):
    return [1 << k for k in range(12) if lo <= 1 << k <= hi]


def random_seq_idx(rng, b, l, Q):
    """Non-decreasing ids per row from a random base, with resets drawn in one of four ways."""
    seq = torch.zeros(b, l, dtype=torch.int64)
    for r in range(b):
        mode = rng.choice(["random", "chunk_ends", "token1", "every_few"])
        if mode == "random":
            cuts = {rng.randint(1, l - 1) for _ in range(rng.randint(1, 4))}
        elif mode == "chunk_ends":
            cuts = {m * Q + rng.choice([-1, 0, 1]) for m in range(1, l // Q + 1)}
        elif mode == "token1":
            cuts = {1, rng.randint(1, l - 1)}
        else:
            cuts, pos = set(), 0
            while pos < l:
                pos += rng.randint(2, 5)
                cuts.add(pos)
        cur = rng.choice([0, 3, -1])
        seq[r] = cur
        for c in sorted(c for c in cuts if 0 < c < l):
            cur += rng.choice([1, 2, 5])
            seq[r, c:] = cur
    return seq


def random_problem(seed):
    """(args, kw, dout, dfinal, Q, headdim, dstate) of draw `seed`."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    Q = rng.choice([16, 32])
    l = rng.choice([rng.randint(4, 90), Q * rng.randint(1, 3) + rng.choice([-1, 1])])
    b = rng.choice([1, 2])
    g = rng.choice([1, 2])
    h = g * rng.choice([1, 2, 4])
    p = rng.choice([5, 8, 17, 20, 33])
    n = rng.choice([5, 7, 16, 20, 33])
    args = dict(x=r(b, l, h, p), dt=r(b, l, h) * 0.5 + 0.3,
                A=-(torch.rand(h, generator=gen, dtype=F64) * rng.choice([0.2, 1.0, 3.0])
                    + 0.05),
                B=r(b, l, g, n), C=r(b, l, g, n))
    kw = dict(D=rng.choice([None, r(h), r(h, p)]),
              z=r(b, l, h, p) if rng.random() < 0.4 else None,
              dt_bias=r(h) * 0.3 if rng.random() < 0.4 else None,
              dt_softplus=rng.random() < 0.5,
              dt_limit=rng.choice([(0.0, math.inf), (0.0, math.inf), (0.7, 1.1), (0.1, 0.6)]),
              initial_states=r(b, h, p, n) if rng.random() < 0.4 else None,
              seq_idx=random_seq_idx(rng, b, l, Q) if rng.random() < 0.5 else None)
    dout = r(b, l, h, p)
    dfinal = r(b, h, p, n) if rng.random() < 0.7 else None
    return rng, (args, kw, dout, dfinal, Q, p, n)


def random_forward_overrides(rng, Q, n):
    npad = max(16, 1 << (n - 1).bit_length())
    over = dict(scan_block_q=rng.choice(pow2s(8, Q)), scan_block_p=rng.choice([8, 16, 32]),
                scan_block_n=rng.choice([0] + pow2s(8, npad)),
                state_block_p=rng.choice([8, 16, 32]), state_block_n=rng.choice(pow2s(8, npad)),
                cumsum_block_h=rng.choice([1, 2, 4]), state_scale_x=rng.choice([-1, 0, 1]),
                state_fresh_acc=rng.choice([0, 1]), scan_causal=rng.choice([0, 4, 5]),
                scan_heads=rng.choice([1, 2, 4]), state_segments=rng.choice([1, 2, 3]))
    if over["state_segments"] > 1:
        mode = rng.choice(["plain", "fold", "resweep"])
        over.update(segment_fold=int(mode == "fold"), state_resweep=int(mode == "resweep"))
    # drawn last, so the draws above stay those of every earlier seed (the walk runs where
    # seq_idx is off)
    over["scan_walk"] = int(rng.random() < 0.4)
    return over


def random_backward_overrides(rng, Q, n):
    npad = max(16, 1 << (n - 1).bit_length())
    fused = rng.choice([0, 1, 2])
    over = dict(dx_block_q=rng.choice(pow2s(8, Q)), bc_block_q=rng.choice(pow2s(8, Q)),
                dx_block_p=rng.choice([8, 16, 32]), bc_block_p=rng.choice([8, 16, 32]),
                bc_block_n=rng.choice(pow2s(8, npad)), bstate_block_p=rng.choice([8, 16, 32]),
                bstate_block_n=rng.choice(pow2s(8, npad)), state_block_p=rng.choice([8, 16]),
                state_block_n=rng.choice(pow2s(8, npad)), cumsum_block_h=rng.choice([1, 2, 4]),
                bc_fused=fused, da_mode=rng.choice({0: [0, 1], 1: [0, 1, 2], 2: [0, 1, 3]}[fused]),
                lowp=rng.choice([0, 1]), dx_lowp=rng.choice([0, 1]),
                state_segments=rng.choice([1, 2, 3]), bstate_segments=rng.choice([1, 2, 3]),
                side_streams=rng.choice([0, 1, 2]))
    if fused == 1:
        over["bc_head_split"] = rng.choice([1, 2, 3])
    if fused == 2:
        over["dcb_head_split"] = rng.choice([1, 2, 3])
    if over["da_mode"] == 3:
        over.update(dx_heads=rng.choice([1, 2, 4]), dx_block_n=rng.choice([0] + pow2s(8, npad)))
    return over


@pytest.mark.parametrize("seed", range(40))
def test_random_forward(seed):
    rng, (args, kw, _, _, Q, _, n) = random_problem(seed)
    over = random_forward_overrides(rng, Q, n)
    # measured at most 7.7e-16 of the largest element over the 40 draws (11 of them the walk)
    check(args, kw, Q, small_forward_config(Q, n, chunk_size=Q, **over), tol=1e-14)


#: draws emulated by default (5-8 s each on 2 cores); all 40 with MAMBA2_TEST_SLOW=1
DEFAULT_BACKWARD_DRAWS = 8


@pytest.mark.parametrize("seed", [pytest.param(s, marks=() if s < DEFAULT_BACKWARD_DRAWS
                                               else pytest.mark.slow) for s in range(40)])
def test_random_backward(seed):
    rng, (args, kw, dout, dfinal, Q, p, n) = random_problem(seed)
    over = random_backward_overrides(rng, Q, n)
    # every tile drawn in one replace (the rule's own tiles need not divide a 16-token chunk)
    cfg = replace(backward.backward_config(2, 4, 2, p, n, Q, F64),
                  dstate_pad=max(16, 1 << (n - 1).bit_length()), **over)
    # measured at most 6.3e-15 of each gradient's largest element over the 40 draws
    assert_close(emulated_grads(args, kw, Q, dout, dfinal, cfg),
                 reference_grads(args, kw, Q, dout, dfinal), tol=5e-14)
