"""Helpers shared by the kernels: the sigmoid, MMA operand dtypes, the state passes' segments
and 64-bit kernel variants."""

import types

import cuda.tile as ct

LOG2E = 1.4426950408889634


def sigmoid(p, APPROX: ct.Constant[bool]):
    """1 / (1 + exp(-p)) of a float32 tile. APPROX: through the approximate exp2 and
    reciprocal (two MUFU operations, relative error ~2^-21; for 16-bit inputs and outputs,
    whose rounding is 2^-8 .. 2^-11), where the IEEE division and expf cost ~15 instructions
    more per element. Both give 0 for p -> -inf, 1 for p -> +inf, NaN for NaN."""
    if APPROX:
        e = ct.exp2(p * -LOG2E, flush_to_zero=True)
        s = ct.truediv(1.0, 1.0 + e, rounding_mode=ct.RoundingMode.APPROX, flush_to_zero=True)
    else:
        s = 1.0 / (1.0 + ct.exp(-p))
    return s


def mma_operand(tile, like):
    """Cast `tile` to the tensor-core operand type for inputs of dtype `like`.

    fp16/bf16 inputs use their own type; fp32 inputs use tf32, because fp32 x fp32 ``ct.mma``
    runs on the FMA units on Hopper.
    """
    if like == ct.float32:
        return tile.astype(ct.tfloat32)
    return tile.astype(like)


def state_segment(n, BLOCK_N: ct.Constant[int], num_chunks, SEGMENTS: ct.Constant[int]):
    """(n_tile, segment, first chunk, end chunk) of a program of the segmented state passes
    (chunk_state_pass, bwd_state_pass, chunk_state_carry): grid axis 2 holds the n-tiles of
    dstate n times the segments, and segment s holds chunks floor(C s / S) .. floor(C (s + 1)
    / S), runs of equal length to one chunk."""
    n_tiles = ct.cdiv(n, BLOCK_N)
    seg = ct.bid(2) // n_tiles
    return (ct.bid(2) % n_tiles, seg, seg * num_chunks // SEGMENTS,
            (seg + 1) * num_chunks // SEGMENTS)


def int64_variant(fn, array_params):
    """A copy of kernel function `fn` whose `array_params` use 64-bit shapes and strides.

    Needed when one of those tensors has 2**31 elements or more: with 32-bit indexing the
    address arithmetic would wrap. The default variant stays 32-bit because it is cheaper.
    """
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                               fn.__closure__)
    clone.__qualname__ = fn.__qualname__
    clone.__module__ = fn.__module__
    clone.__doc__ = fn.__doc__
    clone.__annotations__ = {**fn.__annotations__, **{p: ct.IndexedWithInt64 for p in array_params}}
    return clone
