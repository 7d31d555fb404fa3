"""Timing helpers shared by the benchmarks (and the one-off experiments in ``benchmarks/``). CUDA only, except
``copy_gbs``'s CPU form.

``event_median_s`` times single calls with CUDA events (for calls short enough that a launch matters);
``do_bench_ms`` is Triton's ``do_bench`` median (warm-up and repetitions by time budget); ``graph_ms`` times
``calls`` back-to-back calls captured in one CUDA graph (device time per call, no launch cost: a few-microsecond
kernel as a captured decode step runs it).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable


def event_median_s(fn: Callable[[], object], reps: int = 30, device_only: bool = False) -> float:
    """Median seconds of ``fn`` over ``reps`` runs timed with CUDA events (after a warm-up). ``device_only``: before
    each timed call a ~1 ms spin kernel holds the stream, so the call is enqueued behind it and the start event
    does not count the host's launch cost (device time alone)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if device_only:
            torch.cuda._sleep(2_000_000)  # ~1 ms of clock cycles
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def do_bench_ms(fn: Callable[[], object], rep_ms: int = 60, warmup_ms: int = 10) -> float:
    """Median milliseconds of ``fn()`` over about ``rep_ms`` ms (``triton.testing.do_bench``)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


FLUSH_BYTES = 256 << 20  # more than the H200's 50 MB L2: writing it evicts whatever a call left there


def graph_ms(fn: Callable[[], object], calls: int = 20, rep_ms: int = 60, flush: bool = False) -> float:
    """Milliseconds per call of ``fn``: ``calls`` calls captured in one CUDA graph (after two eager warm-up calls
    on a side stream), the replay timed by ``do_bench_ms`` and divided by ``calls``. ``fn`` must be capturable
    (no host sync, no allocation that outlives the capture); the graph and its pool go after. ``flush``: each call
    follows a write of FLUSH_BYTES (as a decode layer finds its rows: not in L2), and a graph of those writes alone,
    timed alike, is subtracted."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush else None

    def capture(with_fn: bool) -> "torch.cuda.CUDAGraph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                if cache is not None:
                    cache.zero_()
                if with_fn:
                    fn()
        return graph

    graphs = [capture(True)] + ([capture(False)] if flush else [])
    try:
        ms = [do_bench_ms(g.replay, rep_ms, warmup_ms=10) for g in graphs]
        return (ms[0] - (ms[1] if flush else 0.0)) / calls
    finally:
        del graphs


def copy_gbs(nbytes: int | None = None, device: str = "cuda") -> float:
    """GB/s (bytes read + written) of a ``copy_`` of ``nbytes`` bytes: on CUDA device to device (``do_bench_ms``,
    default 1 GiB, the memory given back after), on the CPU by the host clock over five copies (default 64 MiB)."""
    import torch

    if device != "cuda":
        src = torch.empty(nbytes or 64 << 20, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        dst.copy_(src)
        t = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        return 2 * src.numel() * 5 / (time.perf_counter() - t) / 1e9
    nbytes = nbytes or 1 << 30
    src = torch.empty(nbytes, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src), 200, warmup_ms=25)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / ms / 1e6
