"""The config contract of every kernel family (forward, backward, decode).

A config is a frozen dataclass of ints (`ssd.forward.ForwardConfig`, `ssd.backward.BackwardConfig`,
`decode.plan.DecodeConfig`) that validates itself in `__post_init__`: a bad value raises
`ValueError` naming the field, whichever source it came from. Fields listed in the class's
`FIXED` are set by the problem (the padded dstate) and no override may change them.

Where a launch's config comes from, lowest precedence first (this is the one place that says
so; the dispatchers follow it):

1. the dispatcher's rule, from the shape alone (`forward_shape_config`, `backward_config`,
   `decode_config`; no search, no synchronization). The backward's rule computes a chunk-256
   call at chunk 128 (`BackwardConfig.chunk_size`: any chunk length is exact), and so does
   the forward's for long sequences at headdim <= 128 and dstate <= 128 in 16 bits
   (`ForwardConfig.chunk_size`, `ssd.forward.uses_group_scan`); an override of `chunk_size`
   picks the chunk a call is computed with (the tuning table never does);
2. forward only: the tuning table's overrides for the shape's bucket on this GPU (the user
   cache written by `mamba2-cutile tune`, then the table shipped with the package;
   `MAMBA2_CUTILE_TUNING=0` skips both); then, with seq_idx, chunk_scan's query block is cut
   to 64 (`forward_config`), because the table's entries are measured without seq_idx; then,
   without seq_idx, the walk rule (`ssd.forward.walk_form`: the state carried through
   the chunks in registers where its grid fills the SMs' waves);
3. the environment, one variable per family: `MAMBA2_CUTILE_CONFIG` (forward),
   `MAMBA2_CUTILE_BWD_CONFIG` (backward), `MAMBA2_CUTILE_DECODE_CONFIG` (decode), as
   "field=value,field=value";
4. a config passed explicitly to a launcher (`config=`) replaces all of the above.

Each variable reaches its own family only. The backward recomputes the forward's first two
kernels (dt' and the chunk states) with the backward config's `cumsum_block_h`,
`state_block_p`, `state_block_n`, `state_occupancy` and `state_segments` on the forward's
shape rule: neither `MAMBA2_CUTILE_CONFIG` nor the tuning table changes that recompute.
"""

from __future__ import annotations

import os
from dataclasses import fields, replace

ENV_FORWARD = "MAMBA2_CUTILE_CONFIG"
ENV_BACKWARD = "MAMBA2_CUTILE_BWD_CONFIG"
ENV_DECODE = "MAMBA2_CUTILE_DECODE_CONFIG"


def field_names(cls) -> set:
    return {f.name for f in fields(cls)}


def parse_overrides(cls, spec: str, source: str) -> dict:
    """"field=value,..." -> {field: int} for config class `cls`; `source` names where the text
    came from in errors. Unknown, fixed or non-integer fields raise ValueError."""
    out = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in field_names(cls):
            raise ValueError(f"{source}: unknown field {key!r} (fields of {cls.__name__}: "
                             f"{', '.join(sorted(field_names(cls) - set(cls.FIXED)))})")
        if key in cls.FIXED:
            raise ValueError(f"{source}: {key} is set by the problem and cannot be overridden")
        try:
            out[key] = int(value)
        except ValueError:
            raise ValueError(f"{source}: {key}={value.strip()!r} is not an integer") from None
    return out


def split_passes(text: str, source: str) -> tuple:
    """"fwd:a=1,b=2;bwd:c=3;..." -> (forward specs, backward specs), each "field=value,..."
    text for `parse_overrides` ("fwd:" alone is the default config); `source` names where the
    text came from in errors."""
    fwd, bwd = [], []
    for item in filter(None, (i.strip() for i in text.split(";"))):
        kind, sep, spec = item.partition(":")
        if not sep or kind not in ("fwd", "bwd"):
            raise ValueError(f"{source}: {item!r} is not fwd:<fields> or bwd:<fields>")
        (fwd if kind == "fwd" else bwd).append(spec.strip())
    return fwd, bwd


def apply_overrides(cfg, overrides: dict, source: str):
    """`cfg` with `overrides` applied (through the config's `paired_overrides`, where it has
    one: fields that must change together); the result validates itself. Errors name
    `source`."""
    if not overrides:
        return cfg
    if hasattr(cfg, "paired_overrides"):
        overrides = cfg.paired_overrides(overrides)
    bad = [k for k in overrides if k not in field_names(type(cfg)) or k in type(cfg).FIXED]
    if bad:
        raise ValueError(f"{source}: cannot override {bad} of {type(cfg).__name__}")
    try:
        return replace(cfg, **overrides)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


_env_memo: dict = {}


def with_env(cfg, env_var: str):
    """`cfg` with the overrides of `env_var` ("field=value,..."; unset, empty or "default":
    none). The variable is read on every call; the parse and the validated result are
    memoized per (config, text), since they run on every launch's hot path."""
    spec = os.environ.get(env_var, "").strip()
    if not spec or spec == "default":
        return cfg
    key = (cfg, env_var, spec)
    hit = _env_memo.get(key)
    if hit is None:
        hit = apply_overrides(cfg, parse_overrides(type(cfg), spec, env_var), env_var)
        if len(_env_memo) > 4096:
            _env_memo.clear()
        _env_memo[key] = hit
    return hit


# ------------------------------------------------------------------------- checks for __post_init__

def check_pow2(cfg, *names, allow_zero=False):
    for name in names:
        v = getattr(cfg, name)
        if allow_zero and v == 0:
            continue
        if not isinstance(v, int) or v < 1 or v & (v - 1) or v > 256:
            raise ValueError(f"{type(cfg).__name__}: {name}={v!r} is not a power of two "
                             f"in 1..256{' (or 0)' if allow_zero else ''}")


def check_range(cfg, name, lo, hi):
    v = getattr(cfg, name)
    if not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{type(cfg).__name__}: {name}={v!r} is not in {lo}..{hi}")


def check_choice(cfg, name, choices):
    v = getattr(cfg, name)
    if v not in choices:
        raise ValueError(f"{type(cfg).__name__}: {name}={v!r} is not one of {choices}")
