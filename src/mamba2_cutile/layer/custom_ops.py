"""The fused layer as two `torch.library` custom ops with fake implementations, tied together by
a registered autograd, so `torch.compile(fullgraph=True)` traces a model that calls it.

`mamba2_cutile::split_conv1d_scan` (forward) returns (out, final_states). Its autograd saves
only zxbcdt, the weights, initial_states and seq_idx: no activation of size (batch, seqlen,
dim). `mamba2_cutile::split_conv1d_scan_backward` (opaque, like the scan's CUDA backward)
recomputes the convolution, and the scan's output where the norm or the out projection needs
it, then runs the backward of each part in reverse: out projection, SwiGLU (`parts`), gated
RMSNorm, the scan (`ssd.custom_ops.backward_impl`: the cuTile backward on CUDA,
`reference.chunked_backward` elsewhere), the convolution.

The parts run on the library's own implementations, on both devices: the convolution of
`mamba2_cutile.conv1d` (forward with SiLU and its backward), the scan of `mamba2_cutile.ssd`,
the gated RMSNorm of `mamba2_cutile.norm` (forward and backward ops): cuTile kernels for CUDA
tensors, their PyTorch paths otherwise. SwiGLU and the out projection are PyTorch (cuBLAS).
Values are rounded to zxbcdt's dtype where the kernels round: after the convolution, the
scan, the norm.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..eager import eager_dispatch, eager_function, opaque_backward
from ..reference import chunked_backward
from ..reference.layer import split_sizes
from ..ssd import custom_ops as ssd_ops
from ..norm import custom_ops as _norm_ops
from . import parts
from ..runtime import seq_ids_int32

#: inputs of split_conv1d_scan that get a gradient, in the order the backward op returns them
GRAD_INPUTS = ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "initial_states",
               "rmsnorm_weight", "outproj_weight", "outproj_bias")


def _compute_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _conv_impl(t):
    """The convolution's (forward, backward) functions of mamba2_cutile.conv1d for t's device:
    its cuTile launches on CUDA, its PyTorch path elsewhere (called directly: this op is
    already below autograd and opaque to torch.compile)."""
    if t.is_cuda:
        from ..conv1d.plan import conv1d_backward_cuda, conv1d_forward_cuda
        return conv1d_forward_cuda, conv1d_backward_cuda
    from ..conv1d.cpu import conv1d_backward, conv1d_forward
    return conv1d_forward, conv1d_backward


class Sizes:
    """The split of zxbcdt's last dimension: [zx0 (2 d_mlp) | z (dim) | xBC (conv_dim) | dt (h)]."""

    def __init__(self, zxbcdt, conv1d_weight, A, headdim, ngroups):
        self.batch, self.seqlen, d_in_proj = zxbcdt.shape
        self.nheads, self.headdim, self.ngroups = A.shape[0], headdim, ngroups
        self.dstate = (conv1d_weight.shape[0] - self.nheads * headdim) // (2 * ngroups)
        self.d_mlp, self.dim, self.conv_dim = split_sizes(d_in_proj, self.nheads, headdim,
                                                          ngroups, self.dstate)

    def split(self, zxbcdt):
        return torch.split(zxbcdt, [2 * self.d_mlp, self.dim, self.conv_dim, self.nheads], dim=-1)

    def heads(self, t):
        return t.unflatten(-1, (self.nheads, self.headdim))

    def xbc(self, xBC):
        """x (b, l, h, p), B and C (b, l, g, n): views into the convolution's output."""
        x, B, C = torch.split(xBC, [self.dim, self.ngroups * self.dstate,
                                    self.ngroups * self.dstate], dim=-1)
        gn = (self.ngroups, self.dstate)
        return self.heads(x), B.unflatten(-1, gn), C.unflatten(-1, gn)


def conv_act(xBC, weight, bias, seq_idx, silu):
    """act(conv(xBC)) (b, l, conv_dim) contiguous, in xBC's dtype."""
    forward, _ = _conv_impl(xBC)
    out, _ = forward(xBC.transpose(1, 2), weight, bias, seq_ids_int32(seq_idx), None, silu, False)
    return out.transpose(1, 2).contiguous()     # no copy on CUDA: its output is channel-last


def conv_backward(d_act, xBC, weight, bias, seq_idx, silu):
    """(dxBC (b, l, conv_dim), dweight, dbias or None) for the cotangent d_act of conv_act."""
    _, backward = _conv_impl(xBC)
    dx, dw, db, _ = backward(xBC.transpose(1, 2), weight, bias, seq_ids_int32(seq_idx), None,
                             d_act.transpose(1, 2), None, silu)
    return dx.transpose(1, 2), dw, db


def gated_norm(y, weight, z, eps, group_size, norm_before_gate):
    """The gated RMSNorm of y (b, l, dim) with z: (out in y's dtype, rstd), by the norm op's
    body (the cuTile kernel on CUDA, PyTorch on the CPU; called directly: this op is already
    below autograd and opaque to torch.compile)."""
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 - views of zxbcdt's slices
    out, rstd = _norm_ops.forward_body(rows(y), weight, None, rows(z), eps, group_size,
                                       norm_before_gate)
    return out.view(y.shape), rstd


def _scan(sz, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_lo,
          dt_hi):
    """The scan (the scan op's body, below autograd here): (y (b, l, dim), final_states)."""
    y, final, _ = ssd_ops._forward_impl(
        x, dt, A, B, C, chunk_size, D, None if z is None else sz.heads(z), dt_bias,
        initial_states, seq_idx, None, True, dt_lo, dt_hi, C.dtype)
    return y.flatten(-2), final


def _linear_input(sz, zx0, y):
    """What the out projection reads: [silu(zx0 a) * zx0 b | y] (or y when d_mlp = 0)."""
    if sz.d_mlp == 0:
        return y
    cd = _compute_dtype(y)
    return torch.cat([parts.swiglu_forward(zx0.to(cd)).to(y.dtype), y], dim=-1)


def _forward_body(zxbcdt: Tensor, conv1d_weight: Tensor, conv1d_bias: Optional[Tensor],
                  dt_bias: Optional[Tensor], A: Tensor, D: Optional[Tensor],
                  initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
                  rmsnorm_weight: Optional[Tensor], outproj_weight: Optional[Tensor],
                  outproj_bias: Optional[Tensor], chunk_size: int, headdim: int,
                  ngroups: int, norm_group_size: int, rmsnorm_eps: float,
                  norm_before_gate: bool, silu: bool, dt_lo: float,
                  dt_hi: float) -> tuple[Tensor, Tensor]:
    """(out (b, l, out_dim) in zxbcdt's dtype, final_states (b, h, p, n) float32); arguments
    validated by `fused.mamba_split_conv1d_scan_combined`. The gated norm normalises groups of
    `norm_group_size` channels (mamba_ssm's dim // ngroups unless a caller asks otherwise)."""
    sz = Sizes(zxbcdt, conv1d_weight, A, headdim, ngroups)
    zx0, z, xBC, dt = sz.split(zxbcdt)
    x, B, C = sz.xbc(conv_act(xBC, conv1d_weight, conv1d_bias, seq_idx, silu))
    has_norm = rmsnorm_weight is not None
    y, final = _scan(sz, x, dt, A, B, C, chunk_size, D, None if has_norm else z, dt_bias,
                     initial_states, seq_idx, dt_lo, dt_hi)
    if has_norm:
        y, _ = gated_norm(y.to(zxbcdt.dtype), rmsnorm_weight, z, rmsnorm_eps,
                          norm_group_size, norm_before_gate)
    y = _linear_input(sz, zx0, y.to(zxbcdt.dtype))
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight.to(y.dtype),
                     None if outproj_bias is None else outproj_bias.to(y.dtype))
    return y.contiguous(), final.contiguous()


split_conv1d_scan = torch.library.custom_op("mamba2_cutile::split_conv1d_scan", _forward_body,
                                            mutates_args=())


@split_conv1d_scan.register_fake
def _(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, seq_idx,
      rmsnorm_weight, outproj_weight, outproj_bias, chunk_size, headdim, ngroups, norm_group_size,
      rmsnorm_eps, norm_before_gate, silu, dt_lo, dt_hi):
    sz = Sizes(zxbcdt, conv1d_weight, A, headdim, ngroups)
    width = outproj_weight.shape[0] if outproj_weight is not None else sz.d_mlp + sz.dim
    out = zxbcdt.new_empty((sz.batch, sz.seqlen, width))
    final = zxbcdt.new_empty((sz.batch, sz.nheads, headdim, sz.dstate), dtype=torch.float32)
    return out, final


def _scan_backward(x, dt, A, B, C, chunk_size, dy, dfinal, D, z, dt_bias, initial_states,
                   seq_idx, dt_lo, dt_hi):
    """The scan's gradients as a dict (x, dt, A, B, C, D, z, dt_bias, initial_states)."""
    if ssd_ops.backward_impl(x) == "cutile":
        from ..ssd.backward import ssd_backward_cuda
        return ssd_backward_cuda(x, dt, A, B, C, chunk_size, dy, dfinal, D=D, z=z,
                                 dt_bias=dt_bias, initial_states=initial_states,
                                 seq_idx=seq_idx, dt_softplus=True, dt_limit=(dt_lo, dt_hi))
    return chunked_backward.ssd_chunked_backward(
        x, dt, A, B, C, chunk_size, dy, dfinal, D=D, z=z, dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True,
        dt_limit=(dt_lo, dt_hi), dtype=_compute_dtype(x))


def _backward_body(
        dout: Optional[Tensor], dfinal: Optional[Tensor], zxbcdt: Tensor, conv1d_weight: Tensor,
        conv1d_bias: Optional[Tensor], dt_bias: Optional[Tensor], A: Tensor, D: Optional[Tensor],
        initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
        rmsnorm_weight: Optional[Tensor], outproj_weight: Optional[Tensor],
        outproj_bias: Optional[Tensor], chunk_size: int, headdim: int, ngroups: int,
        norm_group_size: int, rmsnorm_eps: float, norm_before_gate: bool, silu: bool,
        dt_lo: float, dt_hi: float) -> list[Tensor]:
    """The gradients of GRAD_INPUTS in order (each in its input's dtype), an empty tensor for
    each absent input. dout / dfinal None: zero cotangents."""
    # Peak memory: each (batch, seqlen, dim) intermediate is dropped as soon as its last use
    # is past, and the gradient of zxbcdt is filled slice by slice, so what is alive at once
    # stays near zxbcdt, its gradient and the scan backward's own buffers.
    sz = Sizes(zxbcdt, conv1d_weight, A, headdim, ngroups)
    dtype, cd = zxbcdt.dtype, _compute_dtype(zxbcdt)
    zx0, z, xBC, dt = sz.split(zxbcdt)
    has_norm, has_proj = rmsnorm_weight is not None, outproj_weight is not None
    dzxbcdt = torch.empty_like(zxbcdt, memory_format=torch.contiguous_format)
    dzx0_out, dz_out, dxBC_out, ddt_out = sz.split(dzxbcdt)
    # The forward's rounding points: x, B, C in zxbcdt's dtype, from the same convolution.
    act = conv_act(xBC, conv1d_weight, conv1d_bias, seq_idx, silu)
    x, B, C = sz.xbc(act)
    del act
    scan_z = None if has_norm else z
    scan_args = (chunk_size, D, scan_z, dt_bias, initial_states, seq_idx, dt_lo, dt_hi)
    y_scan = None
    if has_norm or has_proj:
        y_scan, _ = _scan(sz, x, dt, A, B, C, *scan_args)
        y_scan = y_scan.to(dtype)
    if dout is None:
        width = outproj_weight.shape[0] if has_proj else sz.d_mlp + sz.dim
        dout = zxbcdt.new_zeros((sz.batch, sz.seqlen, width))

    group_size = norm_group_size
    y, rstd = y_scan, None
    if has_norm:
        y, rstd = gated_norm(y_scan, rmsnorm_weight, z, rmsnorm_eps, group_size,
                             norm_before_gate)
    d_proj_w = d_proj_b = None
    if has_proj:
        y_in = _linear_input(sz, zx0, y)
        del y
        dout2 = dout.reshape(-1, dout.shape[-1]).to(dtype)
        d_proj_w = (dout2.t() @ y_in.reshape(-1, y_in.shape[-1])).to(outproj_weight.dtype)
        del y_in
        if outproj_bias is not None:
            d_proj_b = dout2.to(cd).sum(dim=0).to(outproj_bias.dtype)
        dy = (dout2 @ outproj_weight.to(dtype)).reshape(sz.batch, sz.seqlen, sz.d_mlp + sz.dim)
        del dout2
    else:
        del y
        dy = dout.to(dtype)
    del dout
    if sz.d_mlp:
        dzx0_out.copy_(parts.swiglu_backward(dy[..., :sz.d_mlp].to(cd), zx0.to(cd)))
    dy = dy[..., sz.d_mlp:]
    d_norm_w = None
    if has_norm:
        rows = lambda t: t.reshape(-1, sz.dim)  # noqa: E731
        dy, d_norm_w, _, dz = _norm_ops.backward_body(
            rows(dy), rows(y_scan), rmsnorm_weight, None, rows(z), rstd, group_size,
            norm_before_gate)
        dy = dy.view(sz.batch, sz.seqlen, sz.dim)
        dz_out.copy_(dz.view(sz.batch, sz.seqlen, sz.dim))
        del dz
    del y_scan
    g = _scan_backward(x, dt, A, B, C, chunk_size, sz.heads(dy.to(x.dtype)), dfinal, D,
                       None if scan_z is None else sz.heads(scan_z), dt_bias, initial_states,
                       seq_idx, dt_lo, dt_hi)
    del dy, x, B, C
    if not has_norm:
        dz_out.copy_(g.pop("z").flatten(-2))
    ddt_out.copy_(g.pop("dt"))
    d_act = torch.cat([g.pop("x").flatten(-2), g.pop("B").flatten(-2),
                       g.pop("C").flatten(-2)], dim=-1).to(dtype)
    dxBC, d_conv_w, d_conv_b = conv_backward(d_act, xBC, conv1d_weight, conv1d_bias, seq_idx,
                                             silu)
    del d_act
    dxBC_out.copy_(dxBC)
    del dxBC
    grads = dict(zxbcdt=dzxbcdt, conv1d_weight=d_conv_w.to(conv1d_weight.dtype),
                 conv1d_bias=None if d_conv_b is None else d_conv_b.to(conv1d_bias.dtype),
                 dt_bias=g["dt_bias"], A=g["A"], D=g["D"], initial_states=g["initial_states"],
                 rmsnorm_weight=d_norm_w, outproj_weight=d_proj_w, outproj_bias=d_proj_b)
    return [zxbcdt.new_empty((0,)) if grads[k] is None else grads[k].contiguous()
            for k in GRAD_INPUTS]


split_conv1d_scan_backward = torch.library.custom_op("mamba2_cutile::split_conv1d_scan_backward",
                                                     _backward_body, mutates_args=())


@split_conv1d_scan_backward.register_fake
def _(dout, dfinal, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, seq_idx,
      rmsnorm_weight, outproj_weight, outproj_bias, chunk_size, headdim, ngroups, norm_group_size,
      rmsnorm_eps, norm_before_gate, silu, dt_lo, dt_hi):
    inputs = (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight,
              outproj_weight, outproj_bias)
    return [zxbcdt.new_empty((0,)) if t is None else torch.empty_like(
        t, memory_format=torch.contiguous_format) for t in inputs]


_SAVED = ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "initial_states",
          "seq_idx", "rmsnorm_weight", "outproj_weight", "outproj_bias")
_SCALARS = ("chunk_size", "headdim", "ngroups", "norm_group_size", "rmsnorm_eps",
            "norm_before_gate", "silu", "dt_lo", "dt_hi")


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:len(_SAVED)])
    ctx.scalars = inputs[len(_SAVED):]


def _backward(ctx, g_out, g_final, bwd=None):
    """`bwd`: how the backward is called, the opaque op by default (what torch.compile must
    see), its body in eager calls."""
    saved = ctx.saved_tensors
    grads = (bwd or split_conv1d_scan_backward)(g_out, g_final, *saved, *ctx.scalars)
    by_name = dict(zip(_SAVED, saved))
    g = [None if by_name[k] is None else d for k, d in zip(GRAD_INPUTS, grads)]
    # inputs: zxbcdt conv_w conv_b dt_bias A D initial_states seq_idx norm_w proj_w proj_b,
    #         then the scalars
    return (g[0], g[1], g[2], g[3], g[4], g[5], g[6], None, g[7], g[8], g[9]) + \
        (None,) * len(_SCALARS)


torch.library.register_autograd("mamba2_cutile::split_conv1d_scan", _backward,
                                setup_context=_setup_context)


_EagerLayer = eager_function(
    "_EagerLayer", _forward_body, _setup_context,
    opaque_backward(lambda ctx, g_out, g_final: _backward(ctx, g_out, g_final, _backward_body),
                    "the fused layer's backward"))

#: `torch.ops.mamba2_cutile.split_conv1d_scan(*args)` with its autograd, eager calls without
#: the dispatch (`mamba2_cutile.eager`)
split_conv1d_scan_call = eager_dispatch(split_conv1d_scan, _forward_body, _EagerLayer)
