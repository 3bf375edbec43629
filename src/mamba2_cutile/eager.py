"""Eager calls of the library's custom ops without torch.library's dispatch.

Every op (the scan, the causal conv1d and its decode update, the gated norm, the fused layer) is
a `torch.library` custom op with a fake implementation (and but for the update a registered
autograd), which is what torch.compile must see. In eager PyTorch the same
dispatch costs host time on every call (on a CPU about 0.1 ms per op call, 0.4 ms with its
generated autograd, against 0.05 ms for an autograd.Function: `scripts/plan_time.py`), and a
short eager call is host-bound. So the public functions run an eager call through an
autograd.Function with the op's own body and backward (`eager_call_ok` says when that is the
same thing), and keep the op for traced, fake and meta calls.
"""

from __future__ import annotations

import torch
from torch import Tensor


def eager_call_ok(args) -> bool:
    """Whether a call may bypass its custom op: not under torch.compile's tracing (which must
    see the op), no dispatch mode active (FakeTensorMode, FlopCounterMode, ...), and every
    tensor argument a plain tensor or parameter on the CPU or a CUDA device (not meta, fake
    or a subclass): the op's real implementation is then what the dispatcher would run."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(type(a) in (Tensor, torch.nn.Parameter) and a.device.type in ("cuda", "cpu")
               for a in args if isinstance(a, Tensor))


def wants_grad(args) -> bool:
    """Whether autograd must record the call."""
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad
                                           for a in args)


class _NoDoubleBackward(torch.autograd.Function):
    """Gradients passed through under create_graph=True where the backward built no graph
    (kernels, or an opaque op's body): differentiating them again raises, as through the
    opaque op, instead of treating them as constants."""

    @staticmethod
    def forward(ctx, what, n, *tensors):
        ctx.what = what
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"mamba2_cutile: no double backward through {ctx.what} "
                           "(create_graph=True)")


def no_double_backward(grads, deps, what: str):
    """`grads` (a sequence, None entries allowed) unchanged, or under create_graph=True tied
    to `deps` (the tensors they depend on) by a node whose backward raises naming `what`."""
    if not torch.is_grad_enabled():
        return tuple(grads)
    grads = list(grads)
    idx = [i for i, g in enumerate(grads) if g is not None]
    deps = [t for t in deps if isinstance(t, Tensor)]
    for i, g in zip(idx, _NoDoubleBackward.apply(what, len(idx), *(grads[i] for i in idx),
                                                 *deps)):
        grads[i] = g
    return tuple(grads)


def eager_function(name: str, body, setup_context, backward):
    """An autograd.Function named `name` whose forward runs an op's `body` and the op's
    `setup_context(ctx, inputs, output)`, and whose backward is `backward(ctx, *grads)`: the
    op's registered autograd, without torch.library's dispatch."""
    def forward(ctx, *args):
        out = body(*args)
        setup_context(ctx, args, out)
        return out
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})


class _Unpacked:
    """An autograd ctx whose saved tensors were unpacked once: under non-reentrant activation
    checkpointing (torch.utils.checkpoint(use_reentrant=False), transformers'
    gradient_checkpointing_enable()) a second `ctx.saved_tensors` raises."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.saved_tensors = ctx.saved_tensors

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def unpacked(ctx):
    """`ctx` with `saved_tensors` read once and kept (the same object if it already is)."""
    return ctx if isinstance(ctx, _Unpacked) else _Unpacked(ctx)


def opaque_backward(backward, what: str):
    """`backward(ctx, *grads)` run as an opaque op's body would be: building no graph, its
    gradients guarded by `no_double_backward` naming `what`."""
    def run(ctx, *grads):
        ctx = unpacked(ctx)
        with torch.no_grad():
            out = backward(ctx, *grads)
        return no_double_backward(out, (*ctx.saved_tensors, *grads), what)
    return run


def eager_dispatch(op, body, function=None):
    """The call of custom op `op` as the public functions make it: an eager call through
    `function` (an `eager_function` of the op; without a gradient, `body` alone), a traced,
    fake or meta one through `op`. Without `function` (an op with no autograd) a call that
    wants a gradient takes `op` too, which says so as the op does."""
    def call(*args):
        if not eager_call_ok(args):
            return op(*args)
        if not wants_grad(args):
            return body(*args)
        return op(*args) if function is None else function.apply(*args)
    return call
