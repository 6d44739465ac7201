"""How twell's benchmarks time things on a GPU: eager, inside CUDA graphs, host time, peak memory.

- :func:`eager_ms`: median of ``triton.testing.do_bench`` (CUDA events around each call, L2
  flushed before each, so weights come from HBM as they would after another layer ran). When the
  host is slower than the GPU (small batches), the events also catch the GPU waiting for it: that
  is what a user's eager loop sees.
- :func:`graph_ms`: the same call captured once in a CUDA graph (after warm-up on a side stream,
  as ``torch.cuda.graph`` wants) and its replays timed the same way: the GPU time alone.
- :func:`chain_graph_ms`: several layers with their own weights captured back to back in one CUDA
  graph, the time per layer, no flush: each layer's weights were evicted from L2 by the other
  layers' reads, as in a model. (The flush above zeroes a 256 MB buffer, which leaves L2 full of
  dirty lines that a cold read must first write back: on the H200 that made a 23 MB gate product
  take 13.8 us where it takes 8.7 us in a chain of eight layers.)
- :func:`host_us`: CPU time to issue one call, from the wall time of issuing a burst of calls
  without synchronising (short enough that the launch queue never fills and blocks).
- :func:`peak_bytes`: the largest ``torch.cuda.max_memory_allocated`` over one call.
- :func:`reset_peak`: start a peak-memory window from the same state for every variant.
- :func:`alternating`: any of these for two or more callables in alternating rounds, the median
  per callable: where the host is the bottleneck (eager small batches) its speed drifts over
  seconds, and timing one side after the other turns that drift into a ratio.
- :func:`interleaved_ms`: eager times of two or more callables taken call by call in turn (a, b,
  a, b, ...), so that both sides of a ratio see the same host, microseconds apart.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["eager_ms", "graph_ms", "chain_graph_ms", "host_us", "peak_bytes", "reset_peak", "capture", "alternating", "interleaved_ms"]


def reset_peak() -> None:
    """Synchronise, free PyTorch's cuBLAS workspaces and reset the peak-memory statistics.

    PyTorch keeps one cuBLAS workspace (32 MiB on the H200) per stream that ever ran a cuBLAS
    call, and counts it as allocated memory: every capture's warm-up on a new side stream adds
    one. A variant measured after another would carry the first one's workspaces into its peak
    (the 2b decode records read 166 MiB above dense so: five workspaces and the decode
    accumulators). Freed here, each variant's window counts the workspaces it makes itself.
    """
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent from CPU builds
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def eager_ms(fn: Callable[[], object], rep: int = 100, min_reps: int = 10) -> float:
    from .inference import bench_ms

    return bench_ms(fn, rep=rep, min_reps=min_reps)


def capture(fn: Callable[[], object], warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``fn`` warmed up on a side stream, then captured in a CUDA graph (returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def graph_ms(fn: Callable[[], object], rep: int = 100, warmup: int = 3) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph."""
    graph = capture(fn, warmup)
    try:
        return eager_ms(graph.replay, rep=rep)
    finally:
        del graph


def chain_graph_ms(fns: "list[Callable[[], object]]", reps: int = 100, warmup: int = 5) -> float:
    """Median milliseconds per callable of replays of all ``fns`` captured in turn in one CUDA
    graph (one per layer, each with its own weights), replayed back to back without a flush."""
    graph = capture(lambda: [fn() for fn in fns])
    try:
        for _ in range(warmup):
            graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / len(fns)
    finally:
        del graph


def host_us(fn: Callable[[], object], calls: int = 20, rounds: int = 7) -> float:
    """Median over ``rounds`` of the microseconds per call spent issuing ``calls`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on the current device while ``fn`` runs (weights included), from
    the state :func:`reset_peak` leaves."""
    reset_peak()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def alternating(measure: Callable[[Callable[[], object]], float], fns: "list[Callable[[], object]]", rounds: int = 3) -> "list[float]":
    """``measure(fn)`` for each of ``fns`` in ``rounds`` alternating rounds (a, b, a, b, ...);
    the median per callable, in the order of ``fns``."""
    values: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            values[i].append(measure(fn))
    return [statistics.median(v) for v in values]


def interleaved_ms(fns: "list[Callable[[], object]]", calls: int = 200, warmup: int = 10) -> "list[float]":
    """Median milliseconds per call of each of ``fns``, timed call by call in turn (a, b, a, b,
    ...): CUDA events around each call, L2 flushed before each (as ``triton.testing.do_bench``
    does), one synchronisation at the end. Eager small batches are bound by the host, whose
    speed drifts over seconds (on the H200 machine here a dense call took 43 to 118 us from one
    record to the next); rounds of 100 ms per side still caught different phases of that drift,
    where calls microseconds apart see the same host. Without CUDA: wall time per call, no flush
    (for tests)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    if not torch.cuda.is_available():
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(calls):
            for j, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                samples[j].append((time.perf_counter() - t0) * 1e3)
        return [statistics.median(v) for v in samples]
    torch.cuda.synchronize()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)] for _ in fns]
    for i in range(calls):
        for j, fn in enumerate(fns):
            flush.zero_()
            start, end = events[j][i]
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in ev) for ev in events]
