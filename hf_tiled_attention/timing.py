"""Median wall time of a callable: CUDA events on the GPU, a host clock on the CPU; and the GPU
time of calls replayed from a CUDA graph (no host work between them, as a server replays them).

Shared by the autotuner and the eval scripts so that every number is taken the same way.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


def median_ms(fn: Callable, arg_sets: Sequence[tuple] = ((),), *, cuda: bool, warmup: int = 10,
              reps: int = 50) -> float:
    """Median milliseconds of ``fn(*args)`` over ``reps`` calls after ``warmup`` calls, cycling
    through ``arg_sets`` (several input sets keep repeated calls from timing the L2 cache)."""
    if not arg_sets or reps < 1 or warmup < 0:
        raise ValueError("median_ms needs at least one argument set, reps >= 1 and warmup >= 0")
    for i in range(warmup):
        fn(*arg_sets[i % len(arg_sets)])
    if cuda:
        torch.cuda.synchronize()
    times = []
    for i in range(reps):
        args = arg_sets[i % len(arg_sets)]
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def back_to_back_ms(fn: Callable, arg_sets: Sequence[tuple] = ((),), *,
                    warmup: int = 1, reps: int = 20, rounds: int = 5) -> float:
    """Milliseconds per call with calls queued back to back (GPU only): after ``warmup`` calls,
    the median over ``rounds`` of the time of ``reps`` calls between two CUDA events, divided
    by ``reps``. The GPU stays busy, so the host's launch work per call is hidden unless it is
    slower than the kernel: this is the kernel's throughput, where :func:`median_ms` (one call
    from an idle GPU) is one call's latency, host work included."""
    if not arg_sets or reps < 1 or rounds < 1 or warmup < 0:
        raise ValueError("back_to_back_ms needs at least one argument set, reps >= 1, "
                         "rounds >= 1 and warmup >= 0")
    for i in range(warmup):
        fn(*arg_sets[i % len(arg_sets)])
    torch.cuda.synchronize()

    def queue_calls():
        for i in range(reps):
            fn(*arg_sets[i % len(arg_sets)])
    return _median_round_ms(queue_calls, rounds) / reps


def graph_replay_ms(fn: Callable, *, warmup: int = 3, calls: int = 20, rounds: int = 5) -> float:
    """Milliseconds per call of ``fn()`` replayed from a CUDA graph (GPU only): ``warmup`` calls
    on a side stream (compiles, caches), then ``calls`` calls captured into one graph, then the
    median over ``rounds`` replays of the replay's time divided by ``calls``. The host does no
    work between the calls, so a short call's time is the GPU's alone, launch gaps included:
    what a server that captures its steps in graphs (transformers' continuous batching does)
    gets, where :func:`back_to_back_ms` times the host instead once it is the slower side."""
    if calls < 1 or rounds < 1 or warmup < 0:
        raise ValueError("graph_replay_ms needs calls >= 1, rounds >= 1 and warmup >= 0")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture's rule: first calls off the default stream
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return _median_round_ms(graph.replay, rounds) / calls


def _median_round_ms(run: Callable, rounds: int) -> float:
    """Median over ``rounds`` of the milliseconds between CUDA events around ``run()``."""
    times = []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
