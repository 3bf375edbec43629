"""`causal_conv1d_fn` and `causal_conv1d_update`: causal-conv1d 1.7.0's public functions.

Arguments are validated here (shapes, dtypes, devices; values only on CPU inputs or with
MAMBA2_CUTILE_CHECK=1, so the GPU path never synchronizes), then the custom ops of
`custom_ops` run: cuTile kernels for CUDA tensors, PyTorch for CPU tensors.
"""

from __future__ import annotations

import torch

from . import custom_ops
from ..checks import (FLOATS, INTS, check_gpu_dtypes, check_not_expanded, check_same_device,
                      check_tensor, expect_shape, shape_of, value_checks_enabled)
from .plan import MAX_WIDTH
from ..runtime import seq_ids_int32


class UnsupportedActivation(ValueError, NotImplementedError):
    """An activation other than None, "silu" or "swish" (a ValueError, and the
    NotImplementedError causal-conv1d raises)."""


def _silu(activation) -> bool:
    if activation not in (None, "silu", "swish"):
        raise UnsupportedActivation(
            f"activation must be None, 'silu' or 'swish', got {activation!r}")
    return activation is not None


def _check_int32(name, t, on_cuda):
    """t, its values refused where they are checked if they do not fit int32."""
    if t is not None and t.dtype != torch.int32 and value_checks_enabled(on_cuda) and \
            t.numel() and (int(t.min()) < -2**31 or int(t.max()) >= 2**31):
        raise ValueError(f"{name} values must fit in int32")
    return t


def _int32(name, t, on_cuda):
    """An index argument as int32; unchecked (on the GPU, under torch.compile) a value past
    int32 saturates rather than wraps onto another value."""
    t = _check_int32(name, t, on_cuda)
    if t is None or t.dtype == torch.int32:
        return t
    if t.dtype == torch.int64:
        t = t.clamp(-2**31, 2**31 - 1)
    return t.to(torch.int32)


def _check_weight(weight, bias, dim):
    check_tensor("weight", weight, 2, FLOATS)
    if weight.shape[0] != dim:
        raise ValueError(f"weight must have shape (dim, width) with dim={dim} (from x), "
                         f"got {shape_of(weight)}")
    width = weight.shape[1]
    if not 2 <= width <= MAX_WIDTH:
        raise ValueError(f"width (weight.shape[1]) must be in 2..{MAX_WIDTH}, got {width}")
    check_tensor("bias", bias, 1, FLOATS, optional=True)
    if bias is not None:
        expect_shape("bias", bias, (dim,), "(dim,)")
    return width


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None):
    """Depthwise causal conv1d over the tokens, with optional bias and SiLU.

    x: (batch, dim, seqlen), fp32/bf16/fp16 (fp64 on CPU); contiguous, or channel-last
    (x.stride(1) == 1: the transpose of a (batch, seqlen, dim) tensor, e.g.
    ``proj[..., a:b].transpose(1, 2)``), read without a copy. weight: (dim, width), width 2..8.
    bias: (dim,). seq_idx: (batch, seqlen) integer ids of packed sequences: a tap reading a
    token of another sequence contributes zero, and tokens with a negative id (padding) output
    0. initial_states: (batch, dim, width - 1), the inputs before token 0, belonging to each
    row's first sequence (seq_idx[:, 0]). activation: None, "silu" or "swish".

    out[b, c, t] = act(bias[c] + sum_k weight[c, k] * e[b, c, t - (width-1) + k]) with e the
    input extended by the initial states (zero without); `reference.conv1d` has the full
    definition. Returns out (batch, dim, seqlen) in x's dtype, in x's layout family
    (channel-last x gives a channel-last out), or (out, final_states) with
    return_final_states: final_states (batch, dim, width - 1) are the last width-1 inputs of
    the row (the initial states shifted in when seqlen < width-1), written into
    final_states_out when given. With seq_idx (which causal-conv1d refuses here) they are the
    last width-1 inputs of the row's last sequence, zero where that sequence is shorter. Any
    layout of x may return final states (causal-conv1d only channel-last).

    Differentiable in x, weight, bias and initial_states (deterministic on the GPU).
    """
    silu = _silu(activation)
    check_tensor("x", x, 3, FLOATS)
    b, d, l = x.shape
    if l < 1:
        raise ValueError(f"seqlen (x.shape[2]) must be at least 1, got {l}")
    width = _check_weight(weight, bias, d)
    check_tensor("seq_idx", seq_idx, 2, INTS, optional=True)
    if seq_idx is not None:
        expect_shape("seq_idx", seq_idx, (b, l), "(batch, seqlen)")
    check_tensor("initial_states", initial_states, 3, FLOATS, optional=True)
    if initial_states is not None:
        expect_shape("initial_states", initial_states, (b, d, width - 1),
                     "(batch, dim, width - 1)")
    if final_states_out is not None and return_final_states:
        check_tensor("final_states_out", final_states_out, 3, FLOATS)
        check_not_expanded("final_states_out", final_states_out)
        expect_shape("final_states_out", final_states_out, (b, d, width - 1),
                     "(batch, dim, width - 1)")
    tensors = dict(x=x, weight=weight, bias=bias, seq_idx=seq_idx,
                   initial_states=initial_states,
                   final_states_out=final_states_out if return_final_states else None)
    check_same_device(tensors)
    check_gpu_dtypes({k: v for k, v in tensors.items() if k != "seq_idx"})
    # int64 ids past int32 keep which tokens share a sequence (`seq_ids_int32`: each row's
    # ids by rank), as the scan takes them
    seq_idx = seq_ids_int32(seq_idx)
    if seq_idx is not None:
        seq_idx = seq_idx.contiguous()
    out, final = custom_ops.conv1d_call(x, weight, bias, seq_idx, initial_states, silu,
                                        bool(return_final_states))
    if not return_final_states:
        return out
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """One decode step of k new tokens against a rolling conv state, in place (no autograd).

    x: (batch, dim) or (batch, dim, k). conv_state: (nslots, dim, state_len) with
    state_len >= width - 1, updated in place; nslots == batch without conv_state_indices.
    weight: (dim, width), width 2..8; bias: (dim,). cache_seqlens: (batch,) non-negative ints:
    conv_state is then a circular buffer, the tokens written at cache_seqlens % state_len
    onwards (with k > state_len the later tokens win) and the window read from the width-1
    entries before it; without, the state shifts left by k and the tokens enter at its end.
    conv_state_indices: (batch,) ints, each row's slot; a negative slot is a padding row
    (out 0, no state change). Slots must be below nslots (checked on CPU inputs in eager
    mode and with MAMBA2_CUTILE_CHECK=1; unchecked, on the GPU or under torch.compile, a slot
    past the state is a padding row) and distinct (repeated slots are not supported).
    Returns out shaped like x, in x's dtype.
    """
    silu = _silu(activation)
    check_tensor("x", x, (2, 3), FLOATS)
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    b, d, k = x3.shape
    if k < 1:
        raise ValueError(f"x must hold at least one token (x.shape[2] >= 1), got "
                         f"{shape_of(x)}")
    width = _check_weight(weight, bias, d)
    check_tensor("conv_state", conv_state, 3, FLOATS)
    check_not_expanded("conv_state", conv_state)
    nslots, sd, state_len = conv_state.shape
    if sd != d or state_len < width - 1:
        raise ValueError(f"conv_state must have shape (nslots, dim, state_len) with dim={d} "
                         f"and state_len >= width - 1 = {width - 1}, got {shape_of(conv_state)}")
    check_tensor("cache_seqlens", cache_seqlens, 1, INTS, optional=True)
    if cache_seqlens is not None:
        expect_shape("cache_seqlens", cache_seqlens, (b,), "(batch,)")
    check_tensor("conv_state_indices", conv_state_indices, 1, INTS, optional=True)
    if conv_state_indices is not None:
        expect_shape("conv_state_indices", conv_state_indices, (b,), "(batch,)")
    elif nslots != b:
        raise ValueError(f"conv_state must have batch ({b}) slots without conv_state_indices, "
                         f"got shape {shape_of(conv_state)}")
    tensors = dict(x=x, conv_state=conv_state, weight=weight, bias=bias,
                   cache_seqlens=cache_seqlens, conv_state_indices=conv_state_indices)
    check_same_device(tensors)
    check_gpu_dtypes(dict(x=x, conv_state=conv_state, weight=weight, bias=bias))
    if value_checks_enabled(x.is_cuda):
        if cache_seqlens is not None and b and int(cache_seqlens.min()) < 0:
            raise ValueError("cache_seqlens must be non-negative")
        if conv_state_indices is not None and b:
            live = conv_state_indices[conv_state_indices >= 0]
            if live.numel() and int(live.max()) >= nslots:
                raise ValueError(f"conv_state_indices must be below nslots ({nslots}), got "
                                 f"{int(live.max())}")
            if live.numel() != live.unique().numel():
                raise ValueError("conv_state_indices must be distinct (negative entries "
                                 "excepted)")
    cache_seqlens = _int32("cache_seqlens", cache_seqlens, x.is_cuda)
    conv_state_indices = _int32("conv_state_indices", conv_state_indices, x.is_cuda)
    if b == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    # a decode step has no gradient (as causal-conv1d's): its output never asks for one
    with torch.no_grad():
        out = custom_ops.conv1d_update_call(x3, conv_state, weight, bias, silu, cache_seqlens,
                                            conv_state_indices)
    return out.squeeze(-1) if x.dim() == 2 else out
