"""What the tensor-parallel device benchmarks share: starting one process per rank, the
rank's device and attention backend, timing with CUDA events, the result header."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.run_info import run_header
from gpu.attention.base import AttentionBackend
from gpu.distributed.group import TPGroup, TPGroupSpec, init_tp_group, tcp_rendezvous
from gpu.distributed.launch import start_workers

RANK_TIMEOUT_S = 900.0


def run_ranks(target: Callable[..., Any], tp_size: int, payload: Any,
              timeout_s: float = RANK_TIMEOUT_S) -> list[Any]:
    """Run target(rank, tp_size, init_method, payload) in tp_size spawned processes."""
    with start_workers(target, tp_size, (tp_size, tcp_rendezvous(), payload)) as workers:
        return workers.wait(timeout_s)


def join_group(rank: int, tp_size: int, init_method: str, device_kind: str) -> TPGroup:
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    return init_tp_group(TPGroupSpec(rank, tp_size, init_method, device, RANK_TIMEOUT_S))


def attention_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        from gpu.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from gpu.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def usable_tp_sizes(requested: list[int], device_kind: str) -> tuple[list[int], dict[int, str]]:
    """The requested sizes this machine can run, and why the others are skipped."""
    available = torch.cuda.device_count() if device_kind == "cuda" else 64
    skipped = {n: f"needs {n} GPUs, {available} visible" for n in requested if n > available}
    return [n for n in requested if n not in skipped], skipped


class StepTimer:
    """Wall time of code that runs on the device: CUDA events there, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self.times_ms: list[float] = []
        self._pending: list[tuple[Any, Any]] = []
        self._started = 0.0

    def start(self) -> None:
        if self.is_cuda:
            self._pending.append((torch.cuda.Event(enable_timing=True),
                                  torch.cuda.Event(enable_timing=True)))
            self._pending[-1][0].record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self.is_cuda:
            self._pending[-1][1].record()
        else:
            self.times_ms.append((time.perf_counter() - self._started) * 1e3)

    def summary(self) -> dict[str, float]:
        if self.is_cuda:
            torch.cuda.synchronize()
            self.times_ms += [start.elapsed_time(end) for start, end in self._pending]
            self._pending.clear()
        ordered = sorted(self.times_ms)
        return {"num": len(ordered), "median_ms": statistics.median(ordered),
                "mean_ms": statistics.fmean(ordered),
                "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
                "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def header(benchmark: str) -> dict[str, Any]:
    return {"benchmark": benchmark, **run_header(" ".join(["python", *sys.argv])),
            "torch": torch.__version__,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
