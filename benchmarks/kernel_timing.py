"""How the kernel benchmarks time one call: on CUDA with `triton.testing.do_bench` (device
events, the median), eagerly and as replays of a CUDA graph of the call (the device time,
as the runner's graphs run it); on the CPU, where the torch references run, with the host
clock (a check that the benchmark runs, not a figure to compare)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

PEAK_BYTES_PER_S = 4.26e12
"""The H200's measured device-to-device copy bandwidth (bytes read + written per second)."""


def time_call(call: Callable[[], Any], device: str, repeats: int = 5) -> dict[str, float]:
    """Median milliseconds of `call`: `median_ms` (eager) and, on CUDA, `graph_median_ms`."""
    if device != "cuda":
        call()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        return {"median_ms": 1e3 * statistics.median(times)}
    import triton.testing

    eager_ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        call()
    graph_ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return {"median_ms": eager_ms, "graph_median_ms": graph_ms}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
