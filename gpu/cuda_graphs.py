"""Full CUDA graphs of the decode step: the model forward for a batch of one-token requests,
padded to one of a few captured batch sizes.

A decode step of a small model is hundreds of tiny kernels; launching them one by one costs
more CPU time than the GPU spends running them. A graph replays all of them with one
launch. Graphs read the persistent `InputBuffers` in place, so a step writes its inputs
there (prepare_inputs, slot mapping, block-table gather: eager, before the replay) and
replays the graph of the smallest captured size >= its request count. Padding rows have
sequence length 0 and slot -1: they attend to nothing and write nothing. Steps with a
prefill chunk, or more requests than the largest graph, run eagerly. Logits and sampling
stay outside the graph (their cost does not depend on launch count, and a per-size logits
output would hold B x vocab floats per graph).

All graphs share one memory pool and are captured largest first, so the smaller ones reuse
the largest one's activation memory.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

import numpy as np
import structlog
import torch

from gpu.attention.base import AttentionMetadata
from gpu.input_buffers import InputBuffers

log = structlog.get_logger("tandem.cuda_graphs")

SMALL_SIZES = (1, 2, 4, 8, 16, 32)
STEP_UP_TO_256 = 32
STEP_ABOVE_256 = 64

Forward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int, max_num_tokens: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 32, then every 32 up to 256, then every 64,
    up to min(max_num_seqs, max_num_tokens), which is always included."""
    limit = min(max_num_seqs, max_num_tokens)
    sizes = [s for s in SMALL_SIZES if s <= limit]
    size = SMALL_SIZES[-1]
    while True:
        size += STEP_UP_TO_256 if size < 256 else STEP_ABOVE_256
        if size > limit:
            break
        sizes.append(size)
    if limit >= 1 and sizes[-1] != limit:
        sizes.append(limit)
    return tuple(sizes)


def padded_batch_size(sizes: Sequence[int], num_reqs: int) -> int | None:
    """The smallest captured size that holds num_reqs requests, or None (run eagerly)."""
    index = bisect.bisect_left(sizes, num_reqs)
    return sizes[index] if index < len(sizes) else None


def decode_metadata(buffers: InputBuffers, num_reqs_padded: int, max_seq_len: int,
                    query_start_loc_np: np.ndarray, seq_lens_np: np.ndarray) -> AttentionMetadata:
    """Attention metadata of a padded decode batch, viewing the persistent buffers.

    max_seq_len only picks the attention kernel's context split at capture time; the kernel
    reads the real lengths from seq_lens at replay."""
    return AttentionMetadata(
        num_actual_tokens=num_reqs_padded,
        num_reqs=num_reqs_padded,
        max_query_len=1,
        max_seq_len=max_seq_len,
        query_start_loc=buffers.query_start_loc[: num_reqs_padded + 1],
        seq_lens=buffers.seq_lens[:num_reqs_padded],
        slot_mapping=buffers.slot_mapping[:num_reqs_padded],
        block_table=buffers.block_table[:num_reqs_padded],
        query_start_loc_cpu=query_start_loc_np,
        seq_lens_cpu=seq_lens_np,
    )


class DecodeGraphs:
    """Captured decode graphs, one per size; `run(num_reqs)` replays the padded one.

    `forward` is the model's forward (input_ids, positions, kv_caches, metadata) -> hidden.
    """

    def __init__(self, forward: Forward, kv_caches: list[torch.Tensor], buffers: InputBuffers,
                 sizes: Sequence[int], max_model_len: int) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[-1] > buffers.max_num_reqs:
            raise ValueError(f"capture sizes must be increasing and at most max_num_reqs "
                             f"{buffers.max_num_reqs}, got {tuple(sizes)}")
        self.sizes = tuple(sizes)
        self._forward = forward
        self._kv_caches = kv_caches
        self._buffers = buffers
        self._max_model_len = max_model_len
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # size -> the graph's output [size, hidden]
        # Off CUDA nothing can be captured: the step a graph would hold runs eagerly, on the
        # same padded buffers and capture-time metadata (this keeps the path testable on CPU).
        self._eager_steps: dict[int, Callable[[], torch.Tensor]] = {}
        self.capture_time_s = 0.0

    @property
    def num_captured(self) -> int:
        return len(self._graphs) + len(self._eager_steps)

    def padded_size(self, num_reqs: int) -> int | None:
        return padded_batch_size(self.sizes, num_reqs)

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> float:
        """Capture every size, largest first, into `pool` (a fresh one by default); returns
        the seconds it took. The KV cache is never written (every slot is -1). Off CUDA the
        steps are only recorded, to run eagerly."""
        started = time.perf_counter()
        is_cuda = self._buffers.device.type == "cuda"
        if pool is None and is_cuda:
            pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            self.capture_size(size, pool)
        if is_cuda:
            torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - started
        return self.capture_time_s

    def run(self, num_reqs: int) -> torch.Tensor:  # [num_reqs, hidden_size]
        """Replay the graph of the padded size; the inputs must already be in the buffers
        with the padding rows cleared (prepare_inputs and the slot mapping do that)."""
        size = self.padded_size(num_reqs)
        if size in self._eager_steps:
            return self._eager_steps[size]()[:num_reqs]
        if size is None or size not in self._graphs:
            raise ValueError(f"no captured graph holds {num_reqs} requests (sizes {self.sizes})")
        self._graphs[size].replay()
        return self._hidden[size][:num_reqs]

    def release(self) -> None:
        self._graphs.clear()
        self._hidden.clear()
        self._eager_steps.clear()

    @torch.inference_mode()
    def capture_size(self, size: int, pool: tuple[int, int] | None) -> None:
        """Capture the graph of one batch size into `pool`."""
        buffers = self._buffers
        # A dummy batch: every request one token at position 0 of its own (empty) context.
        buffers.input_ids[:size].zero_()
        buffers.positions[:size].zero_()
        buffers.seq_lens[:size].fill_(1)
        buffers.slot_mapping[:size].fill_(-1)
        buffers.block_table[:size].zero_()
        buffers.query_start_loc[: size + 1].copy_(
            torch.arange(size + 1, dtype=torch.int32, device=buffers.device))
        query_start_loc_np = np.arange(size + 1, dtype=np.int32)
        metadata = decode_metadata(buffers, size, self._max_model_len, query_start_loc_np,
                                   np.ones(size, dtype=np.int32))

        def step() -> torch.Tensor:
            return self._forward(buffers.input_ids[:size], buffers.positions[:size],
                                 self._kv_caches, metadata)

        if buffers.device.type != "cuda":
            self._eager_steps[size] = step
            return
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels and workspace).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._hidden[size] = step()
        self._graphs[size] = graph


def measure_graph_memory(graphs: DecodeGraphs, num_graphs: int) -> tuple[int, dict[str, int]]:
    """Estimate the device memory `num_graphs` graphs will take, before the KV cache exists.

    As vLLM does: capture only the two largest sizes of `graphs` into one throwaway pool,
    measure what the device lost with each, and extrapolate first + (n - 1) * max(second,
    1 MiB); then release them. Returns (estimated bytes, the measured terms for the log).
    """
    largest = sorted(graphs.sizes, reverse=True)[:2]
    pool = torch.cuda.graph_pool_handle()
    measured: list[int] = []
    for size in largest:
        # Capturing empties the allocator's cache; empty it first, so that the difference
        # is the graph's own memory and not cached blocks handed back to the device.
        free_before = _free_after_emptying_cache()
        graphs.capture_size(size, pool)
        measured.append(free_before - _free_after_emptying_cache())
    graphs.release()
    del pool
    _free_after_emptying_cache()
    first = measured[0]
    second = measured[1] if len(measured) > 1 else 0
    estimate = first + (num_graphs - 1) * max(second, 1 << 20)
    return estimate, {"graph_first_bytes": first, "graph_second_bytes": second,
                      "graph_count": num_graphs}


def _free_after_emptying_cache() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]
