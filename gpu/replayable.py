"""A captured function, replayed: the one place tandem captures CUDA graphs (the step
graphs of gpu/cuda_graphs.py and the speculative ones of gpu/spec_decode/)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """Python's cycle collector held off for the block. A dead reference cycle that holds an
    earlier CUDA graph (an engine dropped before this one was built), collected in the
    middle of a capture, resets that graph: a CUDA call that a capture forbids, which
    invalidates the capture ("operation failed due to a previous error during capture").
    torch stopped collecting before each capture (torch.compiler.config.force_cudagraph_gc)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Replayable:
    """One captured function: a CUDA graph replaying its kernels (and returning the same
    output tensor every time), or off CUDA the function itself."""

    def __init__(
        self,
        fn: Callable[[], torch.Tensor | None],
        device: torch.device,
        pool: tuple[int, int] | None,
    ) -> None:
        self._fn = fn
        self._graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        if device.type != "cuda":
            return
        side = torch.cuda.Stream()  # warm up: Triton compiles, cuBLAS picks its kernels
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with cycle_collection_paused(), torch.cuda.graph(self._graph, pool=pool):
            self.output = fn()

    def __call__(self) -> torch.Tensor | None:
        if self._graph is None:
            return self._fn()
        self._graph.replay()
        return self.output
