"""The implementations the benchmark compares.

Two interfaces:

- `ours(inp, chunk)`, `mamba_ssm(inp, chunk)`, `tilegym(inp, chunk)` (and `IMPLS`): a forward
  closure over the common inputs returning (out, final_state), or None when the
  implementation is not importable or cannot run the shape. Used by the demo.
- `build(name, inp, shape, mode, grads, stream)`: what the benchmark runner times. Returns a
  closure `() -> dict[str, Tensor]` of named outputs (forward: out, final; backward: dx,
  ddt, dA, dB, dC, dD, dinit, ...; fwdbwd: both), so that results of different
  implementations can be cross-checked by name. Raises `Skip(status)` when the
  implementation is missing or cannot run the case; the status goes into the table.

Implementations (`ORDER`): mamba2-cutile (ours), mamba_ssm (Triton), tilegym (cuTile) and
reference (`reference.ssd_chunked` in float32, PyTorch; small problems only).
"""

from __future__ import annotations

import contextlib
import os

import torch

OURS = "mamba2-cutile"
ORDER = (OURS, "mamba_ssm", "tilegym", "reference")
LABELS = {OURS: "mamba2-cutile", "mamba_ssm": "mamba_ssm", "tilegym": "TileGym",
          "reference": "PyTorch ref"}
#: the PyTorch reference runs only on problems of at most this many batch*seqlen*heads
REFERENCE_MAX_TOKEN_HEADS = 2**20
NO_BACKWARD = "n/a (no backward yet)"


class Skip(Exception):
    """This implementation does not run this case; str(exc) is the status for the table."""


# --------------------------------------------------------------------------- demo interface

def ours(inp, chunk):
    from mamba2_cutile import mamba_chunk_scan_combined

    def fwd():
        return mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                                         chunk, D=inp["D"], initial_states=inp["initial_states"],
                                         return_final_states=True)
    return fwd


def mamba_ssm(inp, chunk):
    try:
        f = _mamba_ssm_fn()
    except Skip:
        return None

    def fwd():
        return f(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, D=inp["D"],
                 initial_states=inp["initial_states"], return_final_states=True)
    return fwd


def tilegym(inp, chunk):
    try:
        f = _tilegym_fns()[0]
    except Skip:
        return None
    if inp["x"].shape[1] % chunk:
        return None                       # TileGym needs T divisible by the chunk size

    def fwd():
        return f(inp["x"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt"],
                 inp["initial_states"], chunk_size=chunk)
    return fwd


IMPLS = {OURS: ours, "mamba_ssm": mamba_ssm, "tilegym": tilegym}


# --------------------------------------------------------------------------- imports

def _mamba_ssm_fn():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as f
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        raise Skip("missing") from e
    return f


def _tilegym_fns():
    try:
        from tilegym.ops.cutile.mamba2 import mamba2_chunk_forward as fwd
    except Exception as e:  # noqa: BLE001
        raise Skip("missing") from e
    try:
        from tilegym.ops.cutile.mamba2 import mamba2_chunk_backward as bwd
    except Exception:  # noqa: BLE001 - older TileGym: forward only
        bwd = None
    return fwd, bwd


def available(name) -> bool:
    try:
        if name == "mamba_ssm":
            _mamba_ssm_fn()
        elif name == "tilegym":
            _tilegym_fns()
    except Skip:
        return False
    return True


def tilegym_tuning() -> str:
    """Whether TileGym autotunes: 'untuned (...=1)' or 'tuned (exhaustive search ...)'.

    TileGym 1.5 reads DISABLE_AUTOTUNE=1; later versions read TILEGYM_DISABLE_AUTOTUNE.
    """
    truthy = ("1", "true", "yes", "on")
    for var in ("DISABLE_AUTOTUNE", "TILEGYM_DISABLE_AUTOTUNE"):
        if os.environ.get(var, "").strip().lower() in truthy:
            return f"untuned ({var}={os.environ[var]})"
    try:
        from tilegym.autotune import is_autotune_disabled
        if is_autotune_disabled():
            return "untuned (tilegym.autotune.is_autotune_disabled)"
    except Exception:  # noqa: BLE001 - older TileGym or not installed
        pass
    return "tuned (exhaustive search at the first call of each shape)"


@contextlib.contextmanager
def tilegym_search_slice(index: int, count: int):
    """TileGym's autotune search spaces cut to every `count`-th candidate from `index`.

    TileGym compiles each candidate serially at the first call of a shape (about 120 at the
    seed problem, minutes of compiling). `count` processes, each searching its own slice, put
    every candidate's cubin into cuTile's disk cache in parallel; the timing process then runs
    TileGym's full, unchanged search, which finds them compiled. Only the `*_configs` search
    spaces are cut (not `*_base_configs`, which the spaces build on); a slice that would be
    empty keeps the first candidate, since TileGym refuses an empty space. TileGym's
    in-memory choices (`*_tune_cache` dicts) are emptied on the way in and out: a worker
    process that searched another slice of the same shape would otherwise reuse its choice
    and search (compile) nothing. Not covered: a kernel whose compile-time constants follow
    an earlier search's choice (TileGym's backward: the partial-sum count from its state
    pass's tile) is compiled here for the slice's choice, and where the full search chooses
    otherwise, by the timing process.
    """
    try:
        import tilegym.ops.cutile.mamba2 as module
    except Exception as e:  # noqa: BLE001
        raise Skip("missing") from e
    saved = {name: getattr(module, name) for name in dir(module)
             if name.endswith("_configs") and not name.endswith("_base_configs")
             and callable(getattr(module, name))}

    def cut(space):
        def sliced(*args, **kwargs):
            candidates = list(space(*args, **kwargs))
            return iter(candidates[index::count] or candidates[:1])
        return sliced

    def forget():
        for name in dir(module):
            if name.endswith("_tune_cache") and isinstance(getattr(module, name), dict):
                getattr(module, name).clear()

    try:
        forget()
        for name, space in saved.items():
            setattr(module, name, cut(space))
        yield sorted(saved)
    finally:
        for name, space in saved.items():
            setattr(module, name, space)
        forget()


# --------------------------------------------------------------------------- runner interface

#: gradient names of mamba_ssm's differentiable arguments
GRAD_NAMES = {"x": "dx", "dt": "ddt", "A": "dA", "B": "dB", "C": "dC", "D": "dD",
              "initial_states": "dinit", "z": "dz", "dt_bias": "ddt_bias"}
_OPTION_KEYS = ("z", "dt_bias", "dt_softplus", "seq_idx")


def _call_kwargs(inp):
    return {k: v for k, v in inp.items() if k not in ("x", "dt", "A", "B", "C")}


def _ours_forward(chunk):
    from mamba2_cutile import mamba_chunk_scan_combined

    def f(inp):
        out, final = mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"],
                                               inp["C"], chunk, return_final_states=True,
                                               **_call_kwargs(inp))
        return out, final
    return f


def _mamba_ssm_forward(chunk):
    fn = _mamba_ssm_fn()

    def f(inp):
        out, final = fn(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk,
                        return_final_states=True, **_call_kwargs(inp))
        return out, final
    return f


def _reference_forward(chunk):
    from mamba2_cutile import reference

    def f(inp):
        out, final, _ = reference.ssd_chunked(inp["x"], inp["dt"], inp["A"], inp["B"],
                                              inp["C"], chunk, dtype=torch.float32,
                                              **_call_kwargs(inp))
        return out, final
    return f


def _autograd_closure(forward, inp, mode, grads, stream):
    """fwd / bwd / fwdbwd closures for an autograd-differentiable forward(inp)."""
    if mode == "fwd":
        def run():
            out, final = forward(inp)
            return {"out": out, "final": final}
        return run
    dout, dfinal = grads
    names = [k for k, v in inp.items()
             if isinstance(v, torch.Tensor) and v.is_floating_point() and k in GRAD_NAMES]
    leaves = dict(inp)
    for k in names:
        leaves[k] = inp[k].detach().clone().requires_grad_(True)
    params = [leaves[k] for k in names]

    def grad_dict(gs):
        return {GRAD_NAMES[k]: g for k, g in zip(names, gs) if g is not None}

    if mode == "fwdbwd":
        def run():
            out, final = forward(leaves)
            gs = torch.autograd.grad((out, final), params, (dout, dfinal), allow_unused=True)
            return {"out": out.detach(), "final": final.detach(), **grad_dict(gs)}
        return run
    # bwd: the forward runs once here, on `stream`, whose backward is then timed alone
    ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
    with ctx:
        out, final = forward(leaves)

    def run():
        gs = torch.autograd.grad((out, final), params, (dout, dfinal), retain_graph=True,
                                 allow_unused=True)
        return grad_dict(gs)
    return run


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _tilegym_closure(inp, shape, mode, grads):
    fwd, bwd = _tilegym_fns()
    opts = [k for k in _OPTION_KEYS if k in inp]
    if opts:
        raise Skip("n/a (no z/dt_bias/seq_idx)")
    b, l, h, g, p, n = shape.dims()
    if l % shape.chunk:
        raise Skip("n/a (T % chunk != 0)")
    if p & (p - 1) or n & (n - 1):
        raise Skip("n/a (headdim/dstate not powers of two)")
    if inp["D"] is not None and inp["D"].dim() != 1:
        raise Skip("n/a (D per channel)")
    if mode != "fwd" and bwd is None:
        raise Skip("n/a (this TileGym has no backward)")
    Q = shape.chunk
    args = (inp["x"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt"], inp["initial_states"])

    def run_fwd():
        out, final = fwd(*args, chunk_size=Q)
        return {"out": out, "final": final}

    def run_bwd():
        dx, da, db, dc, dd, ddt, dinit = bwd(*args, grads[0], grads[1], chunk_size=Q)
        return {"dx": dx, "dA": da, "dB": db, "dC": dc, "dD": dd, "ddt": ddt, "dinit": dinit}

    if mode == "fwd":
        return run_fwd
    if mode == "bwd":
        return run_bwd

    def run_both():
        return {**run_fwd(), **run_bwd()}
    return run_both


def build(name, inp, shape, mode="fwd", grads=None, stream=None):
    """A closure running implementation `name` on `inp` (see the module docstring)."""
    if mode not in ("fwd", "bwd", "fwdbwd"):
        raise ValueError(f"mode must be fwd, bwd or fwdbwd, got {mode!r}")
    if mode != "fwd" and grads is None:
        raise ValueError("backward modes need grads=(dout, dfinal)")
    chunk = shape.chunk
    if name == OURS:
        return _autograd_closure(_ours_forward(chunk), inp, mode, grads, stream)
    if name == "mamba_ssm":
        return _autograd_closure(_mamba_ssm_forward(chunk), inp, mode, grads, stream)
    if name == "tilegym":
        return _tilegym_closure(inp, shape, mode, grads)
    if name == "reference":
        if shape.options:
            raise Skip("n/a (option set: ours vs mamba_ssm only)")
        if shape.token_heads > REFERENCE_MAX_TOKEN_HEADS:
            raise Skip("skipped (> 2^20 token-heads)")
        return _autograd_closure(_reference_forward(chunk), inp, mode, grads, stream)
    if name in EXTRA:
        return EXTRA[name](inp, shape, mode, grads, stream)
    raise ValueError(f"unknown implementation {name!r}; known: {', '.join(known())}")


#: further implementations: name -> builder(inp, shape, mode, grads, stream) (tests use it)
EXTRA: dict = {}


def known():
    return list(ORDER) + list(EXTRA)


def versions():
    import platform

    v = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import cuda.tile as ct
        v["cuda-tile"] = ct.__version__
    except Exception:  # noqa: BLE001
        v["cuda-tile"] = None
    try:
        from ..runtime import tileiras_version
        v["tileiras"] = tileiras_version()
    except Exception:  # noqa: BLE001
        v["tileiras"] = None
    from importlib.metadata import PackageNotFoundError, version

    for key in ("triton", "mamba_ssm", "tilegym"):
        try:
            module = __import__(key)
        except Exception:  # noqa: BLE001 - not installed: reported as None
            v[key] = None
            continue
        found = getattr(module, "__version__", None)
        if found is None:
            try:
                found = version(key)
            except PackageNotFoundError:
                # e.g. a vendored source copy without package metadata: say where it came from
                found = f"unversioned copy at {getattr(module, '__path__', ['?'])[0]}"
        v[key] = found
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
        v["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        v["cuda"] = torch.version.cuda
    return v
