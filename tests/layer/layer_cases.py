"""Inputs of the fused layer function for the CPU and GPU tests, and the float64 definition's
outputs and gradients on them."""

from dataclasses import dataclass

import torch

from mamba2_cutile.reference.layer import mamba_split_conv1d_scan_ref

#: the differentiable tensor arguments, in the function's order
TENSORS = ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "initial_states",
           "rmsnorm_weight", "outproj_weight", "outproj_bias")


@dataclass(frozen=True)
class Case:
    """One problem: sizes and which options are on."""
    b: int = 2
    l: int = 37
    h: int = 4
    p: int = 3
    g: int = 1
    n: int = 5
    width: int = 4
    d_mlp: int = 0
    out_dim: int = 6            # 0: no out projection
    norm: bool = True
    norm_before_gate: bool = True
    D_per_channel: bool = False
    seq: bool = False
    init: bool = False
    dt_limit: tuple = (0.0, float("inf"))
    conv_bias: bool = True
    proj_bias: bool = False
    activation: str = "silu"
    chunk_size: int = 64

    @property
    def dim(self):
        return self.h * self.p


def make_inputs(c: Case, dtype=torch.float64, device="cpu", seed=0):
    """Tensors of TENSORS (None where the option is off) in dtype (A and D float32 for half
    dtypes) plus seq_idx."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    conv_dim = c.dim + 2 * c.g * c.n
    d_in = 2 * c.d_mlp + c.dim + conv_dim + c.h
    t = dict(
        zxbcdt=r(c.b, c.l, d_in),
        conv1d_weight=r(conv_dim, c.width) * 0.5,
        conv1d_bias=r(conv_dim) * 0.3 if c.conv_bias else None,
        dt_bias=r(c.h) * 0.5 - 1.0,
        A=-torch.rand(c.h, generator=gen, dtype=torch.float64) * 2 - 0.3,
        D=r(c.h, c.p) if c.D_per_channel else r(c.h),
        initial_states=r(c.b, c.h, c.p, c.n) if c.init else None,
        rmsnorm_weight=1 + 0.2 * r(c.dim) if c.norm else None,
        outproj_weight=r(c.out_dim, c.d_mlp + c.dim) / (c.d_mlp + c.dim) ** 0.5
        if c.out_dim else None,
        outproj_bias=r(c.out_dim) if (c.out_dim and c.proj_bias) else None,
    )
    # A and D stay float32 beside half-precision activations, as Mamba2 passes them
    small = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    t = {k: None if v is None else v.to(device=device, dtype=small if k in ("A", "D") else dtype)
         for k, v in t.items()}
    seq_idx = None
    if c.seq:
        seq_idx = torch.zeros(c.b, c.l, dtype=torch.int32)
        for row in range(c.b):                   # restarts at different tokens per row
            seq_idx[row, (c.l // 3 + 2 * row):] = 1
            seq_idx[row, (2 * c.l // 3 + row):] = 2
        seq_idx = seq_idx.to(device)
    return t, seq_idx


def kwargs_of(c: Case, t, seq_idx):
    return dict(initial_states=t["initial_states"], seq_idx=seq_idx, dt_limit=c.dt_limit,
                activation=c.activation, rmsnorm_weight=t["rmsnorm_weight"],
                rmsnorm_eps=1e-5, outproj_weight=t["outproj_weight"],
                outproj_bias=t["outproj_bias"], headdim=None if c.D_per_channel else c.p,
                ngroups=c.g, norm_before_gate=c.norm_before_gate)


def call(fn, c: Case, t, seq_idx, **extra):
    return fn(t["zxbcdt"], t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"],
              **kwargs_of(c, t, seq_idx), **extra)


def leaves(t):
    return {k: None if v is None else v.detach().clone().requires_grad_(True)
            for k, v in t.items()}


def cotangents(out_shape, final_shape, seed=1, device="cpu"):
    """dout (float64) and dfinal (float32-representable values in float64: the function's
    final states are float32, so both sides see the same cotangent)."""
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(out_shape, generator=gen, dtype=torch.float64)
    dfin = torch.randn(final_shape, generator=gen).double()
    return dout.to(device), dfin.to(device)


def reference(c: Case, t, seq_idx, dout=None, dfin=None):
    """The float64 definition's (out, final, {name: gradient}) on t (cast to float64, on t's
    device)."""
    ref = leaves({k: None if v is None else v.double() for k, v in t.items()})
    seq = seq_idx
    kw = kwargs_of(c, ref, seq)
    kw.pop("initial_states")
    out, final = mamba_split_conv1d_scan_ref(
        ref["zxbcdt"], ref["conv1d_weight"], ref["conv1d_bias"], ref["dt_bias"], ref["A"],
        ref["D"], initial_states=ref["initial_states"], **kw)
    grads = {}
    if dout is not None:
        names = [k for k in TENSORS if ref[k] is not None]
        gs = torch.autograd.grad([out, final], [ref[k] for k in names],
                                 [dout.double(), dfin.double()])
        grads = dict(zip(names, gs))
    return out.detach(), final.detach(), grads
