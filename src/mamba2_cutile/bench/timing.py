"""Kernel timing: a call captured in a CUDA graph, replayed after warm-up, L2 flushed between
replays (so every replay reads from HBM), timed with CUDA events; plus eager wall time."""

from __future__ import annotations

import statistics
import time

import torch


def _stats(samples_ms):
    return {"median_ms": statistics.median(samples_ms), "min_ms": min(samples_ms),
            "max_ms": max(samples_ms), "n": len(samples_ms)}


def _reps_within(budget_ms, one_ms, reps, min_reps=10):
    """`reps`, or fewer (not under min_reps) when reps calls of one_ms exceed budget_ms."""
    if budget_ms is None or one_ms <= 0:
        return reps
    return max(min(reps, min_reps), min(reps, int(budget_ms / one_ms)))


def time_graph(fn, reps=50, warmup=3, flush_l2=True, stream=None, budget_ms=None):
    """Median/min/max milliseconds of `fn` replayed as a CUDA graph.

    `stream`: warm up and capture on this stream (default: a new side stream for the warm-up
    and torch's capture stream). Pass the stream a backward's forward ran on, so that
    autograd issues the backward kernels on the capturing stream.
    `budget_ms`: fewer replays (at least 10) for calls so slow that `reps` of them would take
    longer than this; the stats' "n" says how many ran.
    """
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if flush_l2 else None
    s = stream if stream is not None else torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        start.record()
        graph.replay()
        end.record()
    end.synchronize()
    if warmup:
        reps = _reps_within(budget_ms, start.elapsed_time(end), reps)
    samples = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    del graph
    return _stats(samples)


def time_eager(fn, reps=30, warmup=3, budget_ms=None):
    """Median wall milliseconds of `fn` called from Python (launch overhead included);
    `budget_ms` as in time_graph."""
    one_ms = 0.0
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        one_ms = (time.perf_counter() - t0) * 1e3
    reps = _reps_within(budget_ms, one_ms, reps)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _stats(samples)


def time_eager_stream(fn, calls=50, rounds=7, warmup=3):
    """Median host milliseconds per call of `fn` called `calls` times back to back, then one
    synchronize (over `rounds` rounds): the per-call cost a Python loop of short kernels sees
    (Python, argument checks, launch), without the wake-up noise of a synchronize per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return _stats(samples)


def time_first_call(fn):
    """Seconds of the first call (compile and any tuning included)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def peak_memory_mib(fn):
    """MiB of torch.cuda.max_memory_allocated above what was allocated before one call of
    `fn` (its outputs included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20
