"""One registry of benchmark shapes, and the inputs every implementation gets."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seqlen: int
    nheads: int
    ngroups: int
    headdim: int
    dstate: int
    chunk: int
    dtype: torch.dtype = torch.bfloat16

    def dims(self):
        return (self.batch, self.seqlen, self.nheads, self.ngroups, self.headdim, self.dstate)


SEED = Shape("seed", 4, 16384, 8, 1, 64, 128, 128)


def seed_sweep():
    out = []
    for n in (64, 128, 256):
        for t in (1024, 4096, 16384, 65536, 262144):
            out.append(Shape(f"seed-T{t // 1024}K-N{n}", 4, t, 8, 1, 64, n, 128))
    return out


def model_shapes(seqlen=8192, batch=2):
    cfgs = [("mamba2-130m", 24, 1), ("mamba2-370m", 32, 1), ("mamba2-780m", 48, 1),
            ("mamba2-1.3b", 64, 1), ("mamba2-2.7b", 80, 1), ("7b-class", 128, 8)]
    return [Shape(f"{name}-T{seqlen // 1024}K", batch, seqlen, h, g, 64, 128, 256)
            for name, h, g in cfgs]


REGISTRY = {"seed": [SEED], "sweep": seed_sweep(), "models": model_shapes()}


def make_inputs(shape: Shape, device="cuda", seed=0):
    """The common problem every implementation can run: dt already positive (softplus applied
    when made), D per head, zero initial state, final state returned."""
    b, l, h, g, p, n = shape.dims()
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, device=device)  # noqa: E731
    dt = torch.exp(u(b, l, h) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return dict(
        x=r(b, l, h, p).to(shape.dtype), dt=dt, A=-torch.exp(u(h) * math.log(16.0)),
        B=r(b, l, g, n).to(shape.dtype), C=r(b, l, g, n).to(shape.dtype), D=r(h),
        initial_states=torch.zeros(b, h, p, n, device=device),
    )
