"""Hugging Face transformers' Mamba-2 models on mamba2-cutile's kernels: `enable()`.

transformers (>= 5.17, < 6) defines, in each of six model families
(`transformers.models.{mamba2, bamba, falcon_h1, granitemoehybrid, nemotron_h,
zamba2}.modeling_*`), the same five module-level functions, resolved once at import against
`mamba_ssm` / `causal_conv1d` with a PyTorch fallback, and looked up by the mixers at call time:

    causal_conv1d_fn                    prefill / training conv, x (b, d, l)
    causal_conv1d_update                decode conv step, x (b, d, 1), conv_state (b, d, w) in place
    mamba2_split_conv1d_scan_combined   the fused training layer (conv, scan, gated norm, out proj);
                                        the PyTorch fallback returns None: the unfused path runs
    mamba2_selective_state_update       decode scan step, state (b, h, p, n) in place
    mamba2_chunk_scan                   the chunked scan (training without the fused layer, prefill)

`enable()` rebinds those five names in every installed family to the adapters below, which run
mamba2-cutile (cuTile kernels on CUDA tensors, the library's PyTorch paths on CPU tensors);
`disable()` puts back exactly the objects that were there. Modules imported after `enable()`
are patched as they are imported (an import hook). A module in which the five names are not all
found raises `IntegrationError` naming the module and the missing names; nothing is patched then.

The adapters take what the mixers pass: keyword names, positional D in decode, the per-head
dt, A, D, dt_bias of decode as stride-0 expansions (read without copies), the cache's state
dtype, `norm_before_gate=False`, `dt_limit`, `rmsnorm_eps=None` (falcon_h1 without the gated
norm), and the model's forwarded keyword arguments, of which they use the packing ones:

    seq_idx (b, l) int          sequence id of each token: the conv and the scan restart where
                                it changes (DataCollatorWithFlattening(return_seq_idx=True))
    cu_seq_lens_q (s + 1,) int  cumulative sequence lengths of the packed tokens (the
                                flash-attention kwargs), used when seq_idx is absent;
                                `cu_seqlens` is an alias

and ignore the rest (position_ids, max_length_q/k, cu_seq_lens_k, ...). With cu_seq_lens_q,
token t of a packed row of L tokens gets the id of the sequence holding packed position
cu[-1] - L + t (positions counted from the end, so a conv input that the cache prefixed with
left context still lines up: the context belongs to the first sequence); without a cache
L = cu[-1] and this is plain `searchsorted`. A seq_idx shorter than the conv input (the cache
left-pads a prompt shorter than the kernel) is padded on the left with its first id. All of
this is tensor arithmetic: no host synchronization, nothing that breaks a torch.compile graph.

falcon_h1's fused call passes norm_before_gate=False whatever its config's
`mamba_norm_before_gate` (default True, which transformers' PyTorch path honours): with the
gated norm on (`mamba_rms_norm=True`) its fused name returns None and training runs the
unfused path on our conv and scan, so the result stays the PyTorch path's.

Chunk sizes other than 64, 128 or 256 (the scan's tiles) run at the nearest of those: the scan's
result does not depend on the chunk size except for rounding.

Known difference from transformers' PyTorch path, shared with mamba_ssm: in training the fused
layer sees no attention mask (the mixers zero padding tokens before `in_proj` only), while the
unfused path zeroes them again after the conv. `enable(fused=False)` keeps the unfused path
(our conv and scan, both masks applied) for training on padded batches.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import inspect
import re
import sys
import threading

import torch

from .. import mamba_chunk_scan_combined as _scan
from .. import selective_state_update as _state_update
from ..conv1d import causal_conv1d_fn as _conv1d_fn
from ..conv1d import causal_conv1d_update as _conv1d_update
from ..layer.fused import split_conv1d_scan_norm_groups as _split_conv1d_scan
from ..ssd.forward import SUPPORTED_CHUNK_SIZES

#: the transformers model families that define the five names
FAMILIES = ("mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2")
#: their modeling modules, the ones `enable()` patches
MODULES = tuple(f"transformers.models.{f}.modeling_{f}" for f in FAMILIES)
#: the module-level names each of them must define
NAMES = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_split_conv1d_scan_combined",
         "mamba2_selective_state_update", "mamba2_chunk_scan")
#: supported transformers versions: [MIN_VERSION, MAX_VERSION)
MIN_VERSION, MAX_VERSION = (5, 17), (6, 0)

#: activations the conv computes itself (causal-conv1d's); others are applied afterwards
_CONV_ACTIVATIONS = (None, "silu", "swish")


class IntegrationError(RuntimeError):
    """transformers is missing, of an unsupported version, or a modeling module lacks one of
    the names `enable()` rebinds."""


# --------------------------------------------------------------------------------------------
# packing: seq_idx from the forwarded keyword arguments
# --------------------------------------------------------------------------------------------

def packed_seq_idx(kwargs, batch, length, device):
    """The (batch, length) int32 sequence ids for a conv or scan input of `length` tokens, from
    the mixer's forwarded kwargs (`seq_idx`, else `cu_seq_lens_q` or `cu_seqlens`), or None
    when the batch is not packed. See the module docstring for the alignment rules."""
    seq_idx = kwargs.get("seq_idx")
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor):
            raise TypeError(f"seq_idx must be a torch.Tensor, got {type(seq_idx).__name__}")
        if seq_idx.dim() == 1:
            seq_idx = seq_idx.unsqueeze(0)
        if seq_idx.dim() != 2 or seq_idx.shape[-1] > length:
            raise ValueError(f"seq_idx must have shape (batch, seqlen) with seqlen <= {length} "
                             f"(the tokens of this call), got {tuple(seq_idx.shape)}")
        short = length - seq_idx.shape[-1]
        if short:
            seq_idx = torch.cat([seq_idx[:, :1].expand(-1, short), seq_idx], dim=1)
        return seq_idx.to(device=device, dtype=torch.int32)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        cu = kwargs.get("cu_seqlens")
    if cu is None:
        return None
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError("cu_seq_lens_q must be a 1-D tensor of num_seqs + 1 >= 2 cumulative "
                         f"lengths, got {cu!r:.80}")
    cu = cu.to(device=device, dtype=torch.int64)
    tokens = batch * length
    positions = torch.arange(tokens, device=device, dtype=torch.int64) + (cu[-1] - tokens)
    ids = torch.searchsorted(cu, positions, right=True) - 1
    return ids.clamp(min=0).to(torch.int32).view(batch, length)


def _scan_chunk(chunk_size):
    """The scan's chunk for transformers' `config.chunk_size`: itself when supported, else the
    nearest supported size (same result up to rounding)."""
    chunk_size = int(chunk_size)
    if chunk_size in SUPPORTED_CHUNK_SIZES:
        return chunk_size
    return min(SUPPORTED_CHUNK_SIZES, key=lambda c: (abs(c - chunk_size), c))


def _activation_after(activation):
    """transformers' activation function for an activation the conv does not take, else None."""
    if activation in _CONV_ACTIVATIONS:
        return None
    from transformers.activations import ACT2FN
    return ACT2FN[activation]


# --------------------------------------------------------------------------------------------
# the adapters: transformers' call conventions -> the library's strict signatures
# --------------------------------------------------------------------------------------------

def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' `causal_conv1d_fn(x (b, d, l), weight (d, w), bias, activation, **kwargs)`
    on `mamba2_cutile.conv1d.causal_conv1d_fn`, with the packing kwargs as seq_idx.

        out[b, c, t] = act(bias[c] + sum_k weight[c, k] x[b, c, t - w + 1 + k]),
    taps before the start of t's sequence (or of the row) read zero."""
    b, _, l = hidden_states.shape
    seq_idx = packed_seq_idx(kwargs, b, l, hidden_states.device)
    after = _activation_after(activation)
    out = _conv1d_fn(hidden_states, weight, bias, seq_idx=seq_idx,
                     activation=None if after is not None else activation)
    return out if after is None else after(out)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None,
                         **kwargs):
    """transformers' decode conv step `causal_conv1d_update(x (b, d, k), conv_state (b, d, w),
    weight, bias, activation)` on `mamba2_cutile.conv1d.causal_conv1d_update`: conv_state is
    shifted left by k and x appended (in place); the output is the conv over [state, x]."""
    after = _activation_after(activation)
    out = _conv1d_update(hidden_states, conv_state, weight, bias,
                         activation=None if after is not None else activation,
                         cache_seqlens=kwargs.get("cache_seqlens"),
                         conv_state_indices=kwargs.get("conv_state_indices"))
    return out if after is None else after(out)


def mamba2_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                      chunk_size, initial_states=None,
                                      dt_limit=(0.0, float("inf")), return_final_states=False,
                                      activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6,
                                      outproj_weight=None, outproj_bias=None, headdim=None,
                                      ngroups=1, norm_before_gate=True, *, _norm_whole=False,
                                      **kwargs):
    """transformers' fused training layer on `mamba2_cutile.layer.mamba_split_conv1d_scan_combined`
    (mamba_ssm's semantics: zxbcdt = [z, xBC, dt] -> conv + silu on xBC -> SSD scan with D,
    dt_bias, softplus, dt_limit -> gated RMSNorm per group (or y * silu(z) without a norm
    weight) -> out proj), with the packing kwargs as seq_idx. Returns None (transformers then
    runs its unfused path, on our conv and scan) for an activation the layer does not take.
    `_norm_whole`: the family's own gated norm normalises all of dim at once (transformers
    before 5.18 for Mamba-2, Bamba and GraniteMoeHybrid, `_norm_is_whole`), so ours does too:
    the model computes what its PyTorch path computes."""
    if activation not in _CONV_ACTIVATIONS:
        return None
    b, l = zxbcdt.shape[:2]
    seq_idx = packed_seq_idx(kwargs, b, l, zxbcdt.device)
    return _split_conv1d_scan(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, _scan_chunk(chunk_size),
        initial_states=initial_states, seq_idx=seq_idx, dt_limit=tuple(dt_limit),
        return_final_states=return_final_states, activation=activation,
        rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=1e-6 if rmsnorm_eps is None else rmsnorm_eps,
        outproj_weight=outproj_weight, outproj_bias=outproj_bias, headdim=headdim,
        ngroups=ngroups, norm_before_gate=norm_before_gate,
        norm_groups=1 if _norm_whole else ngroups)


def falcon_h1_split_conv1d_scan_combined(*args, rmsnorm_weight=None, **kwargs):
    """falcon_h1's fused training layer: ours without the gated norm; with it (config
    `mamba_rms_norm=True`) None, so the mixer runs its unfused path. transformers' falcon_h1
    mixer passes norm_before_gate=False to the fused function whatever its config's
    `mamba_norm_before_gate` (default True), which its own PyTorch path honours: the unfused
    path keeps the PyTorch path's result."""
    if rmsnorm_weight is not None:
        return None
    return mamba2_split_conv1d_scan_combined(*args, rmsnorm_weight=None, **kwargs)


def whole_norm_split_conv1d_scan_combined(*args, **kwargs):
    """The fused training layer for a family whose gated norm normalises all of dim at once
    (`_norm_is_whole`): ours with one norm group whatever `ngroups` (the B/C groups) is; None
    (transformers' unfused path, on our conv and scan) where the GPU norm cannot take all of
    dim as one group."""
    from ..norm.plan import MAX_GROUP_SIZE
    zxbcdt = args[0] if args else kwargs["zxbcdt"]
    rmsnorm_weight = kwargs.get("rmsnorm_weight", args[11] if len(args) > 11 else None)
    if zxbcdt.is_cuda and rmsnorm_weight is not None and rmsnorm_weight.numel() > MAX_GROUP_SIZE:
        return None
    return mamba2_split_conv1d_scan_combined(*args, _norm_whole=True, **kwargs)


def _unfused(*args, **kwargs):
    """The fused layer's stand-in under `enable(fused=False)`: None, so the mixer runs its
    unfused path (our conv and scan, with both padding masks)."""
    return None


def mamba2_selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None,
                                  dt_softplus=False, z=None, **kwargs):
    """transformers' decode scan step on `mamba2_cutile.selective_state_update`: state
    (b, h, p, n) in the cache's dtype, updated in place; x (b, h, p); dt, A, D, dt_bias as the
    mixers' stride-0 expansions of per-head values (read in place, never materialised).

        dt' = softplus?(dt + dt_bias);  state = exp(A dt') state + dt' x B;  y = state C + D x"""
    return _state_update(state, hidden_states, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                         dt_softplus=bool(dt_softplus),
                         state_batch_indices=kwargs.get("state_batch_indices"))


def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None,
                      initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                      return_final_states=False, z=None, **kwargs):
    """transformers' chunked scan on `mamba2_cutile.mamba_chunk_scan_combined` (x (b, l, h, p),
    dt (b, l, h), A (h,), B, C (b, l, g, n), D (h,), initial_states from the cache), with the
    packing kwargs as seq_idx. Returns y, or (y, final_state float32) with return_final_states."""
    b, l = hidden_states.shape[:2]
    seq_idx = packed_seq_idx(kwargs, b, l, hidden_states.device)
    return _scan(hidden_states, dt, A, B, C, _scan_chunk(chunk_size), D=D, z=z, dt_bias=dt_bias,
                 initial_states=initial_states, seq_idx=seq_idx, dt_softplus=bool(dt_softplus),
                 dt_limit=tuple(dt_limit), return_final_states=bool(return_final_states))


def _norm_is_whole(module):
    """Whether the module's gated RMSNorm normalises all of its input at once rather than per
    group: its `*RMSNormGated` class takes neither `group_size` nor `n_groups` (transformers
    5.17's Mamba-2, Bamba and GraniteMoeHybrid; grouped from 5.18, as in mamba_ssm)."""
    classes = [v for k, v in vars(module).items()
               if k.endswith("RMSNormGated") and inspect.isclass(v)]
    if len(classes) != 1:
        return False
    try:
        params = inspect.signature(classes[0].__init__).parameters
    except (TypeError, ValueError):
        return False
    return not ({"group_size", "n_groups"} & set(params))


def _adapters(fused, module):
    module_name = module.__name__
    fused_fn = mamba2_split_conv1d_scan_combined
    if module_name.endswith(".modeling_falcon_h1"):
        fused_fn = falcon_h1_split_conv1d_scan_combined
    elif _norm_is_whole(module):
        fused_fn = whole_norm_split_conv1d_scan_combined
    return {
        "causal_conv1d_fn": causal_conv1d_fn,
        "causal_conv1d_update": causal_conv1d_update,
        "mamba2_split_conv1d_scan_combined": fused_fn if fused else _unfused,
        "mamba2_selective_state_update": mamba2_selective_state_update,
        "mamba2_chunk_scan": mamba2_chunk_scan,
    }


# --------------------------------------------------------------------------------------------
# enable / disable
# --------------------------------------------------------------------------------------------

_lock = threading.RLock()
#: module name -> [(module object, {name: the object transformers had bound}), ...]: by object,
#: so that a module imported again while enabled is restored too (and its originals are its own)
_saved: dict = {}
_active: dict | None = None  # {"fused": bool} while enabled
_finder = None
#: inside `torch_path()`: per covered module, the bindings that come back after the block;
#: enable() and disable() called in the block change these, not the block's PyTorch path
_shadow: dict = {}


def _bound(module, name):
    """What `name` is bound to in `module` outside any torch_path() block."""
    return _shadow.get(module.__name__, module.__dict__)[name]


def _bind(module, name, obj):
    """Bind `name` in `module`, or, inside a torch_path() block covering it, after the block."""
    if module.__name__ in _shadow:
        _shadow[module.__name__][name] = obj
    else:
        setattr(module, name, obj)


def _version_tuple(text):
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_transformers_version():
    """The installed transformers' version string; IntegrationError if it is missing or not
    in [5.17, 6)."""
    try:
        import transformers
    except ImportError as e:
        raise IntegrationError("transformers is not installed: pip install "
                               "'mamba2-cutile[transformers]' (transformers>=5.17,<6)") from e
    version = getattr(transformers, "__version__", "?")
    vt = _version_tuple(version)
    if vt is None or not MIN_VERSION <= vt < MAX_VERSION:
        raise IntegrationError(f"transformers {version} is not supported: the integration needs "
                               "transformers>=5.17,<6")
    return version


def _missing(module):
    return [n for n in NAMES if not callable(module.__dict__.get(n))]


def _check_module(module):
    missing = _missing(module)
    if missing:
        raise IntegrationError(
            f"{module.__name__} does not define {', '.join(missing)} (of the five functions "
            f"{', '.join(NAMES)}): this transformers version's Mamba-2 mixer is not the one "
            "mamba2-cutile adapts to; nothing was patched")


def _originals(module):
    """What transformers had bound in this module object, or None if it is not patched."""
    for obj, originals in _saved.get(module.__name__, ()):
        if obj is module:
            return originals
    return None


def _patch(module, fused, fresh=False):
    """Rebind the five names of an already-checked module, keeping its originals once (a
    re-patch keeps the first ones; `fresh`: the module has just been executed again, so what
    it binds now are the originals)."""
    entries = _saved.setdefault(module.__name__, [])
    if fresh:
        entries[:] = [(m, o) for m, o in entries if m is not module]
    if _originals(module) is None:
        entries.append((module, {n: _bound(module, n) for n in NAMES}))
    for n, fn in _adapters(fused, module).items():
        _bind(module, n, fn)


class _PatchingLoader(importlib.abc.Loader):
    """Wraps a target module's loader: runs the module, then checks and patches it."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _lock:
            if _active is not None:
                _check_module(module)
                _patch(module, _active["fused"], fresh=True)

    def __getattr__(self, name):        # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the target modules that are imported while the integration is enabled."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            raise IntegrationError(f"cannot patch {fullname} on import: its loader "
                                   f"{spec.loader!r} has no exec_module")
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def enable(*, fused=True):
    """Run transformers' Mamba-2 model families on mamba2-cutile.

    Rebinds the five functions (module docstring) in every family module already imported
    and installs an import hook that patches the others when they are imported. `fused=False`
    binds the fused training layer to a function returning None, so training runs the
    unfused path (our conv + scan; it applies the padding mask after the conv too).
    Calling it again switches `fused` and keeps the originals of the first call.
    Returns the names of the modules patched now. Raises IntegrationError (transformers
    missing or not >=5.17,<6, a loaded module lacking a name) with nothing patched."""
    global _active, _finder
    check_transformers_version()
    with _lock:
        loaded = [sys.modules[m] for m in MODULES if sys.modules.get(m) is not None]
        for module in loaded:                 # check all before patching any
            if _originals(module) is None:
                _check_module(module)
        for module in loaded:
            _patch(module, fused)
        _active = {"fused": bool(fused)}
        if _finder is None:
            _finder = _PatchOnImport()
            sys.meta_path.insert(0, _finder)
        return [m.__name__ for m in loaded]


def disable():
    """Put back exactly the objects transformers had bound, in every patched module, and
    remove the import hook. A no-op when not enabled."""
    global _active, _finder
    with _lock:
        for name, entries in list(_saved.items()):
            for module, originals in entries:
                for n, obj in originals.items():
                    _bind(module, n, obj)
            del _saved[name]
        _active = None
        if _finder is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_finder)
            _finder = None


def is_enabled():
    return _active is not None


@contextlib.contextmanager
def enabled(*, fused=True):
    """`with enabled(): ...` runs the block with the integration enabled, then restores the
    previous state (disabled, or enabled as it was)."""
    with _lock:
        before = None if _active is None else _active["fused"]
    enable(fused=fused)
    try:
        yield
    finally:
        if before is None:
            disable()
        else:
            enable(fused=before)


def status():
    """{module: "patched" | "patched on import" | "not patched" | "not installed"} for the six
    family modules."""
    out = {}
    for m in MODULES:
        module = sys.modules.get(m)
        if module is not None:
            out[m] = "patched" if _originals(module) is not None else "not patched"
        else:
            try:
                found = importlib.util.find_spec(m) is not None
            except (ImportError, ValueError):
                found = False
            out[m] = ("patched on import" if _active is not None else "not patched") \
                if found else "not installed"
    return out


# --------------------------------------------------------------------------------------------
# which implementation runs; transformers' own PyTorch path for comparisons
# --------------------------------------------------------------------------------------------

def _describe_obj(module, obj):
    here = sys.modules[__name__]
    if getattr(obj, "__module__", None) == here.__name__:
        return "mamba2_cutile" + ("" if obj is not _unfused else " (unfused)")
    obj = _hub_function(obj)
    inner = inspect.unwrap(obj)
    impl = _closure_var(obj, "implementation")
    if impl is not None and impl is not inner:
        return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"
    if getattr(inner, "__module__", None) == module.__name__:
        return "transformers (PyTorch)"
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', '?')}"


def describe(module_name="transformers.models.mamba2.modeling_mamba2"):
    """{name: what it runs} for one family module (imported if needed): "mamba2_cutile",
    "transformers (PyTorch)", or the module.function transformers resolved (mamba_ssm's, ...)."""
    module = importlib.import_module(module_name)
    return {n: _describe_obj(module, module.__dict__.get(n)) for n in NAMES}


def _closure_var(obj, var):
    with contextlib.suppress(TypeError, ValueError):
        return inspect.getclosurevars(obj).nonlocals.get(var)
    return None


def _hub_function(obj):
    """The function behind a `kernels` function layer: with the `kernels` package installed
    (a dependency of transformers from 5.25), transformers' hub decorator turns each decorated
    function into an `nn.Module` instance whose forward calls the function (its closure's
    `func`); anything else is returned as it is."""
    if isinstance(obj, torch.nn.Module):
        return _closure_var(type(obj).forward, "func") or obj
    return obj


def _torch_definition(module, name):
    obj = _hub_function((_originals(module) or {}).get(name, module.__dict__.get(name)))
    fn = inspect.unwrap(obj)
    if getattr(fn, "__module__", None) != module.__name__:
        # a wrapper without __wrapped__ (another decorator on top): the fallback's closure
        fn = _closure_var(obj, "torch_function") or fn
    if getattr(fn, "__module__", None) != module.__name__:
        raise IntegrationError(f"cannot find transformers' PyTorch definition of {name} in "
                               f"{module.__name__} (found {fn!r})")
    return fn


@contextlib.contextmanager
def torch_path(module_names=MODULES):
    """Within the block, the five names of every loaded family module (of `module_names`) run
    transformers' own PyTorch definitions (`inspect.unwrap` of what transformers bound: the
    functions its modeling file defines), whatever was resolved (mamba_ssm) or enabled; the
    previous bindings come back afterwards, as enable() or disable() called inside the block
    left them. For comparisons and benchmarks: this is the path transformers runs without
    mamba_ssm and causal-conv1d (packing kwargs are ignored there)."""
    with _lock:
        # every module checked and resolved before any is rebound: a failure changes nothing
        todo = []
        for m in module_names:
            module = sys.modules.get(m)
            if module is None or m in _shadow:      # not loaded, or an outer block has it
                continue
            _check_module(module)
            todo.append((module, {n: _torch_definition(module, n) for n in NAMES}))
        covered = []
        for module, defs in todo:
            _shadow[module.__name__] = {n: module.__dict__[n] for n in NAMES}
            covered.append(module)
            for n, fn in defs.items():
                setattr(module, n, fn)
    try:
        yield
    finally:
        with _lock:
            for module in covered:
                for n, obj in _shadow.pop(module.__name__).items():
                    setattr(module, n, obj)
