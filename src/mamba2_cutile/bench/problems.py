"""One registry of benchmark shapes, and the inputs every implementation gets.

Registry keys (`REGISTRY`, selected with `mamba2-cutile bench --shapes KEY[,KEY...]`):

- `seed`     the seed problem: B=4 T=16K H=8 G=1 P=64 N=128, chunk 128, bf16
- `sweep`    the seed problem over T in 1K..256K and N in 64/128/256
- `models`   what people train: the Mamba-2 130M..2.7B layers (24..80 heads, P=64 N=128 G=1,
             chunk 256) at 8K-64K tokens per step in several batch/length splits, 7B-class
             layers (128 heads, 8 groups) at chunk 256 and 128, dstate 256, headdim 128, short
             sequences (512-2K tokens) and one long sequence (64K tokens at batch 1)
- `options`  option-heavy problems (z, dt_bias + softplus, seq_idx, and all together) and a
             partial last chunk: mamba2-cutile against mamba_ssm only
- `default`  a few of the above, chosen to finish in under two minutes on an H200
- `all`      every shape above

A single shape can also be selected by its name (e.g. `seed-T64K-N128`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..runtime import dtype_tag

#: options a Shape may carry (all on top of the common problem of `make_inputs`)
OPTIONS = ("z", "dt_bias", "seq_idx")

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
           "float32": torch.float32, "float": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use bf16, fp16 or fp32") from None


def dtype_name(dtype: torch.dtype) -> str:
    return dtype_tag(dtype)


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
    options: tuple = ()            # subset of OPTIONS

    def dims(self):
        return (self.batch, self.seqlen, self.nheads, self.ngroups, self.headdim, self.dstate)

    @property
    def token_heads(self) -> int:
        return self.batch * self.seqlen * self.nheads

    @property
    def series(self) -> str:
        """Everything but the sequence length: shapes of one series differ only in T."""
        opts = "+".join(self.options) or "plain"
        return (f"B{self.batch} H{self.nheads} G{self.ngroups} P{self.headdim} N{self.dstate} "
                f"Q{self.chunk} {dtype_name(self.dtype)} {opts}")

    def describe(self) -> str:
        b, l, h, g, p, n = self.dims()
        opts = f" +{'+'.join(self.options)}" if self.options else ""
        return f"B={b} T={l} H={h} G={g} P={p} N={n} Q={self.chunk} {dtype_name(self.dtype)}{opts}"


SEED = Shape("seed", 4, 16384, 8, 1, 64, 128, 128)


def _k(t: int) -> str:
    return f"{t // 1024}K" if t % 1024 == 0 else str(t)


def seed_sweep(seqlens=(1024, 4096, 16384, 65536, 262144), dstates=(64, 128, 256)):
    out = []
    for n in dstates:
        for t in seqlens:
            out.append(Shape(f"seed-T{_k(t)}-N{n}", 4, t, 8, 1, 64, n, 128))
    return out


MODEL_CONFIGS = (("mamba2-130m", 24, 1), ("mamba2-370m", 32, 1), ("mamba2-780m", 48, 1),
                 ("mamba2-1.3b", 64, 1), ("mamba2-2.7b", 80, 1), ("7b-class", 128, 8))


def model_shapes(seqlen=8192, batch=2):
    """Each model's layer at one batch and length (B=2 T=8K by default), chunk 256."""
    return [Shape(f"{name}-T{_k(seqlen)}", batch, seqlen, h, g, 64, 128, 256)
            for name, h, g in MODEL_CONFIGS]


def training_shapes():
    """The `models` set: every model at B=2 T=8K, then other batch/length splits, the
    7B-class layer at chunk 128, dstate 256, headdim 128, short and long sequences."""
    out = model_shapes()
    out += [
        Shape("mamba2-2.7b-B8-T4K", 8, 4096, 80, 1, 64, 128, 256),
        Shape("mamba2-780m-B4-T16K", 4, 16384, 48, 1, 64, 128, 256),
        Shape("7b-class-Q128-T8K", 2, 8192, 128, 8, 64, 128, 128),
        Shape("dstate256-T8K", 2, 8192, 32, 1, 64, 256, 256),
        Shape("headdim128-T8K", 2, 8192, 48, 1, 128, 128, 256),
        Shape("mamba2-130m-T512", 1, 512, 24, 1, 64, 128, 256),
        Shape("mamba2-1.3b-T2K", 1, 2048, 64, 1, 64, 128, 256),
        Shape("mamba2-1.3b-B1-T64K", 1, 65536, 64, 1, 64, 128, 256),
    ]
    return out


def option_shapes():
    """Options mamba_ssm has and TileGym lacks (TileGym: n/a), at the seed size."""
    b, l, h, g, p, n, q = 4, 16384, 8, 1, 64, 128, 128
    return [
        Shape("opt-z", b, l, h, g, p, n, q, options=("z",)),
        Shape("opt-dt_bias-softplus", b, l, h, g, p, n, q, options=("dt_bias",)),
        Shape("opt-seq_idx", b, l, h, g, p, n, q, options=("seq_idx",)),
        Shape("opt-all", b, l, h, g, p, n, q, options=OPTIONS),
        Shape("opt-partial-chunk", b, l - 100, h, g, p, n, q),
        Shape("opt-all-130m", 2, 8192, 24, 1, 64, 128, 256, options=OPTIONS),
    ]


def _registry():
    sweep, models = seed_sweep(), training_shapes()
    by_name = {s.name: s for s in [SEED] + sweep + models}
    default = [SEED, by_name["seed-T4K-N128"], by_name["seed-T64K-N128"],
               by_name["mamba2-130m-T8K"], by_name["mamba2-2.7b-T8K"], by_name["7b-class-T8K"]]
    opts = option_shapes()
    every = []
    for s in [SEED] + sweep + models + opts:
        if s not in every:
            every.append(s)
    return {"default": default, "seed": [SEED], "sweep": sweep, "models": models,
            "options": opts, "all": every}


REGISTRY = _registry()


def all_shapes():
    return list(REGISTRY["all"])


def compile_match(pattern: str):
    """--match's regular expression, a bad one refused as a ValueError naming it."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--match {pattern!r} is not a regular expression: {e}") from None


def parse_custom(spec: str) -> Shape:
    """'B,T,H,G,P,N,Q[,dtype]' -> a Shape named 'custom-...'."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (7, 8):
        raise ValueError(f"--custom wants B,T,H,G,P,N,chunk[,dtype], got {spec!r}")
    b, l, h, g, p, n, q = (int(v) for v in parts[:7])
    if q not in (64, 128, 256):
        raise ValueError(f"--custom: the chunk must be 64, 128 or 256, got {q} (in {spec!r})")
    if min(b, l, h, g, p, n) < 1 or h % g:
        raise ValueError(f"--custom: B, T, H, G, P, N must be >= 1 with G dividing H, got "
                         f"{spec!r}")
    dtype = parse_dtype(parts[7]) if len(parts) == 8 else torch.bfloat16
    return Shape(f"custom-{b}x{l}x{h}x{g}x{p}x{n}-Q{q}", b, l, h, g, p, n, q, dtype)


def _parse_size(v: str) -> int:
    v = v.strip().upper()
    mult = 1
    if v.endswith("K"):
        mult, v = 1024, v[:-1]
    elif v.endswith("M"):
        mult, v = 1024 * 1024, v[:-1]
    return int(float(v) * mult)


def parse_sizes(spec: str | None):
    """'1K,4K,16384' -> {1024, 4096, 16384}; None/'' -> None (no filter)."""
    if not spec:
        return None
    return {_parse_size(v) for v in spec.split(",") if v.strip()}


def select(keys="default", custom=(), seqlens=None, dstates=None, match=None, dtype=None,
           chunk=None):
    """Shapes from registry keys or shape names (comma-separated), plus custom specs, then
    filtered by sequence length, dstate and a name regex; `dtype` replaces every dtype and
    `chunk` every chunk size (renamed with a -Q suffix where it changes; then a shape equal
    to an earlier one, other than in name, is dropped)."""
    from dataclasses import replace

    by_name = {s.name: s for s in all_shapes()}
    out = []
    for key in (k.strip() for k in (keys or "").split(",")):
        if not key:
            continue
        if key in REGISTRY:
            new = REGISTRY[key]
        elif key in by_name:
            new = [by_name[key]]
        else:
            raise ValueError(f"unknown shape set or shape {key!r}; sets: "
                             f"{', '.join(REGISTRY)} (see --list)")
        out += [s for s in new if s not in out]
    out += [parse_custom(c) for c in custom]
    sl, ds = parse_sizes(seqlens) if isinstance(seqlens, str) else seqlens, \
        parse_sizes(dstates) if isinstance(dstates, str) else dstates
    if sl:
        out = [s for s in out if s.seqlen in sl]
    if ds:
        out = [s for s in out if s.dstate in ds]
    if match:
        out = [s for s in out if compile_match(match).search(s.name)]
    if dtype is not None:
        out = [replace(s, dtype=dtype, name=f"{s.name}-{dtype_name(dtype)}")
               if s.dtype != dtype else s for s in out]
    if chunk is not None:
        if chunk not in (64, 128, 256):
            raise ValueError(f"--chunk must be 64, 128 or 256, got {chunk}")
        out = [replace(s, chunk=chunk, name=f"{s.name}-Q{chunk}") if s.chunk != chunk else s
               for s in out]
        # a set that already holds a shape at two chunk sizes (the models set's 7B-class
        # layer) would time the same problem twice: the first of each keeps its place
        seen, kept = set(), []
        for s in out:
            if replace(s, name="") not in seen:
                seen.add(replace(s, name=""))
                kept.append(s)
        out = kept
    return out


def random_problem(b, l, h, g, p, n, dtype=torch.bfloat16, *, D=None, z=False, dt_bias=False,
                   dt_limit=None, init=False, seq_cuts=None, device="cuda", seed=0, gen=None):
    """Random inputs of mamba_chunk_scan_combined in realistic Mamba-2 ranges (A in [-16, -1],
    dt' in [1e-3, 1e-1]), as (inputs, keyword options) with mamba_ssm's argument names.

    D: None, "h" (per head) or "hp" (per channel). dt_bias: adds dt_bias with softplus, dt then
    holding pre-softplus values so softplus(dt + dt_bias) stays in range. seq_cuts: token
    positions where every row but the last (which stays one sequence) starts a new sequence.
    `gen` lets a caller keep drawing from the same generator afterwards.
    """
    gen = gen or torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, device=device)  # noqa: E731
    A = -torch.exp(u(h) * math.log(16.0))
    dt = torch.exp(u(b, l, h) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    kw = {}
    if dt_bias:
        bias = torch.log(torch.expm1(torch.full((h,), 0.01, device=device))) + 0.5 * r(h)
        kw.update(dt_bias=bias, dt_softplus=True)
        dt = torch.log(torch.expm1(dt)) - bias
    if dt_limit is not None:
        kw["dt_limit"] = dt_limit
    inp = dict(x=r(b, l, h, p).to(dtype), dt=dt, A=A, B=r(b, l, g, n).to(dtype),
               C=r(b, l, g, n).to(dtype))
    if D == "h":
        kw["D"] = r(h)
    if D == "hp":
        kw["D"] = r(h, p)
    if z:
        kw["z"] = r(b, l, h, p).to(dtype)
    if init:
        kw["initial_states"] = r(b, h, p, n)
    if seq_cuts is not None:
        seq = torch.zeros(b, l, dtype=torch.int32, device=device)
        for cut in seq_cuts:
            if 0 < cut < l:
                seq[:, cut:] += 1
        if b > 1:
            seq[-1] = 0
        kw["seq_idx"] = seq
    return inp, kw


def default_seq_cuts(l):
    """Resets inside chunks and one token apart."""
    return (l // 5, l // 5 + 1, l // 2, (3 * l) // 4)


def make_inputs(shape: Shape, device="cuda", seed=0):
    """The common problem every implementation can run: dt already positive (softplus applied
    when made), D per head, zero initial state, final state returned. Options add z,
    dt_bias with dt_softplus=True (dt then holds pre-softplus values, so that
    softplus(dt + dt_bias) lies in the same range), and seq_idx (4 sequences per row).

    The keys are mamba_ssm's argument names, so `f(**inputs, chunk_size=...)` calls
    mamba_chunk_scan_combined (ours or mamba_ssm's) and `reference.ssd_*`.
    """
    b, l, h, g, p, n = shape.dims()
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, device=device)  # noqa: E731
    dt = torch.exp(u(b, l, h) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    inp = dict(
        x=r(b, l, h, p).to(shape.dtype), dt=dt, A=-torch.exp(u(h) * math.log(16.0)),
        B=r(b, l, g, n).to(shape.dtype), C=r(b, l, g, n).to(shape.dtype), D=r(h),
        initial_states=torch.zeros(b, h, p, n, device=device),
    )
    if "z" in shape.options:
        inp["z"] = r(b, l, h, p).to(shape.dtype)
    if "dt_bias" in shape.options:
        bias = torch.log(torch.expm1(torch.full((h,), 0.01, device=device))) + 0.5 * r(h)
        inp["dt_bias"] = bias
        inp["dt_softplus"] = True
        inp["dt"] = torch.log(torch.expm1(dt)) - bias
    if "seq_idx" in shape.options:
        seq = torch.zeros(b, l, dtype=torch.int32, device=device)
        for cut in (l // 5, l // 2, (3 * l) // 4):
            if 0 < cut < l:
                seq[:, cut:] += 1
        inp["seq_idx"] = seq
    return inp


def make_grad_outputs(shape: Shape, device="cuda", seed=1):
    """dout (like x) and dfinal_states (float32), the same for every implementation."""
    b, l, h, g, p, n = shape.dims()
    gen = torch.Generator(device=device).manual_seed(seed)
    dout = torch.randn(b, l, h, p, generator=gen, device=device).to(shape.dtype)
    dfinal = torch.randn(b, h, p, n, generator=gen, device=device) * 0.1
    return dout, dfinal
