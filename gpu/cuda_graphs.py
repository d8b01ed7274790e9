"""CUDA graphs of the whole V2 step, so that a step costs one upload and a few replays.

A decode step of a small model is hundreds of tiny kernels: launched one by one from
Python they cost more CPU time than the GPU spends running them, and the GPU waits in
between. So every part of a step that can be captured is, in three kinds of graph that
replay back to back on the persistent buffers (gpu/input_buffers.py, V2StepState):

- forward (per shape, see gpu/runner_v2/step_plan.py): input prep (prepare_inputs,
  block-table gather, slot mapping), the model, the final hidden states into
  `V2StepState.hidden`. Decode graphs per padded request count; mixed graphs (prefill
  chunks next to decodes) per padded token count, covering min(tokens, max_num_reqs)
  request rows. The prep kernels read the real counts from `InputBuffers.step_counts`
  and the attention kernel reads every length from the device, so one graph serves any
  batch its shape holds: padding tokens have slot -1 and padding requests no context.
  Graphs over whole steps rather than pieces around attention: a piecewise step would
  still launch attention eagerly in every layer (28 launches and 29 replays per step for
  qwen3), the CPU cost the graphs are there to remove.
- head (per padded request count): each request's last hidden state through the LM head
  into `V2StepState.logits` (float32).
- sample (per padded request count, with and without the min-p / top-k / top-p threshold
  kernels): the seeded Gumbel draw, post_update. Batches with logit bias, penalties or
  logprobs sample eagerly on the head graph's logits instead.

A speculative step's tail (head over K + 1 rows per request, sampling, acceptance,
post-update, drafting) has graphs of its own, built on these: gpu/spec_decode/spec_graphs.py.

All graphs share one memory pool and are captured largest first, so the smaller ones
reuse the larger ones' activation memory. Capture runs every kernel once with zero real
requests (step_counts = 0): nothing is read from or written to the KV cache or the rows.
Off CUDA nothing is captured: each graph's function runs eagerly on the same buffers,
which keeps the padding logic testable on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import structlog
import torch

from gpu.attention.base import AttentionMetadata
from gpu.input_buffers import InputBuffers
from gpu.replayable import Replayable
from gpu.runner_v2.step_plan import ForwardShape, GraphSizes, padded_batch_size
from gpu.runner_v2.step_state import V2StepState
from kernels.post_update import post_update
from kernels.prepare_inputs import prepare_inputs
from kernels.slot_mapping import compute_slot_mapping, gather_block_table

log = structlog.get_logger("tandem.cuda_graphs")

SMALL_SIZES = (1, 2, 4, 8, 16, 32)
STEP_UP_TO_256 = 32
STEP_ABOVE_256 = 64
MIXED_SIZES = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
"""Token counts of the mixed graphs; larger mixed steps are compute-bound enough that
launching them eagerly costs little."""
MIXED_DECODE_TILE_MAX_TOKENS = 512
"""Mixed graphs of up to this many tokens are mostly decodes beside a short prefill chunk:
their attention uses decode-sized query tiles (16 rows), which read the KV cache at the
decode kernel's bandwidth; larger ones keep the prefill tiles (64 rows), which re-read a
long chunk's keys a quarter as often."""

__all__ = [
    "StepGraphs",
    "capture_sizes",
    "mixed_capture_sizes",
    "padded_batch_size",
    "decode_metadata",
    "measure_graph_memory",
]


def capture_sizes(max_num_seqs: int, max_num_tokens: int) -> tuple[int, ...]:
    """Request counts to capture: 1, 2, 4, 8, 16, 32, then every 32 up to 256, then every
    64, up to min(max_num_seqs, max_num_tokens), which is always included."""
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


def mixed_capture_sizes(max_num_seqs: int, max_num_tokens: int) -> tuple[int, ...]:
    """Token counts of the mixed graphs: MIXED_SIZES, plus max_num_seqs + 64 and + 128 (a
    full decode batch next to a short prefill chunk), within max_num_tokens."""
    sizes = set(MIXED_SIZES) | {max_num_seqs + 64, max_num_seqs + 128}
    return tuple(sorted(s for s in sizes if s <= max_num_tokens))


def decode_metadata(
    buffers: InputBuffers, num_reqs_padded: int, max_seq_len: int
) -> AttentionMetadata:
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
        query_start_loc_cpu=np.arange(num_reqs_padded + 1, dtype=np.int32),
        seq_lens_cpu=np.ones(num_reqs_padded, dtype=np.int32),
    )


def _mixed_metadata(
    buffers: InputBuffers, shape: ForwardShape, max_seq_len: int
) -> AttentionMetadata:
    # max_query_len = the token count: the kernel's multi-tile search, which any split of
    # the tokens into requests can use; the CPU arrays are never read (Triton backend).
    decode_tiles = shape.num_tokens <= MIXED_DECODE_TILE_MAX_TOKENS
    return AttentionMetadata(
        num_actual_tokens=shape.num_tokens,
        num_reqs=shape.num_reqs,
        max_query_len=shape.num_tokens,
        max_seq_len=max_seq_len,
        query_start_loc=buffers.query_start_loc[: shape.num_reqs + 1],
        seq_lens=buffers.seq_lens[: shape.num_reqs],
        slot_mapping=buffers.slot_mapping[: shape.num_tokens],
        block_table=buffers.block_table[: shape.num_reqs],
        query_start_loc_cpu=np.zeros(shape.num_reqs + 1, dtype=np.int32),
        seq_lens_cpu=np.zeros(shape.num_reqs, dtype=np.int32),
        query_tile=16 if decode_tiles else None,
    )


class StepGraphs:
    """The forward, head and sample graphs of every captured shape (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        step_state: V2StepState,
        sizes: GraphSizes,
        block_size: int,
        max_model_len: int,
    ) -> None:
        buffers = step_state.buffers
        for name, values, limit in (
            ("decode", sizes.decode, buffers.max_num_reqs),
            ("mixed", sizes.mixed, buffers.max_num_tokens),
        ):
            if list(values) != sorted(set(values)) or (values and values[-1] > limit):
                raise ValueError(
                    f"{name} capture sizes must be increasing and at most {limit}, "
                    f"got {tuple(values)}"
                )
        if step_state.hidden is None or step_state.logits is None:
            raise ValueError("the step state has no graph outputs (built with_graph_outputs=False)")
        self.sizes = sizes
        self.model = model
        self.kv_caches = kv_caches
        self._state = step_state
        self.buffers = buffers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._forward: dict[ForwardShape, Replayable] = {}
        self._head: dict[int, Replayable] = {}
        self._sample: dict[tuple[int, bool], Replayable] = {}
        self.capture_time_s = 0.0

    @property
    def num_captured(self) -> int:
        return len(self._forward) + len(self._head) + len(self._sample)

    def forward_shapes(self) -> list[ForwardShape]:
        decode = [ForwardShape(True, n, n) for n in self.sizes.decode]
        mixed = [ForwardShape(False, t, self.sizes.mixed_num_reqs(t)) for t in self.sizes.mixed]
        return decode + mixed

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> float:
        """Capture every graph, largest first, into `pool` (a fresh one by default);
        returns the seconds it took."""
        started = time.perf_counter()
        is_cuda = self.buffers.device.type == "cuda"
        if pool is None and is_cuda:
            pool = torch.cuda.graph_pool_handle()
        for shape in sorted(self.forward_shapes(), key=lambda s: -s.num_tokens):
            self.capture_forward(shape, pool)
        for size in sorted(self.sizes.decode, reverse=True):
            self.capture_head(size, pool)
            self.capture_sample((size, True), pool)
            self.capture_sample((size, False), pool)
        if is_cuda:
            torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - started
        return self.capture_time_s

    def run_forward(self, shape: ForwardShape) -> None:
        """Input prep and model for the step in the buffers; hidden states land in
        V2StepState.hidden."""
        self._forward[shape]()

    def run_head(self, num_rows: int) -> torch.Tensor:  # [num_rows, vocab_size] float32
        return self._head[num_rows]()

    def run_sample(self, num_rows: int, filters: bool) -> torch.Tensor:
        """[num_rows] int64 sampled ids, in a tensor the next replay overwrites."""
        return self._sample[num_rows, filters]()

    def release(self) -> None:
        self._forward.clear()
        self._head.clear()
        self._sample.clear()

    def capture_forward(self, shape: ForwardShape, pool: tuple[int, int] | None) -> None:
        buffers = self.buffers
        self.zero_counts(decode_rows=shape.num_reqs if shape.is_decode else 0)
        metadata = (
            decode_metadata(buffers, shape.num_reqs, self.max_model_len)
            if shape.is_decode
            else _mixed_metadata(buffers, shape, self.max_model_len)
        )
        num_tokens = shape.num_tokens

        def forward() -> None:
            self.prepare(shape)
            hidden = self.model(
                buffers.input_ids[:num_tokens],
                buffers.positions[:num_tokens],
                self.kv_caches,
                metadata,
            )
            self._state.hidden[:num_tokens].copy_(hidden)

        self._forward[shape] = Replayable(forward, buffers.device, pool)

    def capture_head(self, num_rows: int, pool: tuple[int, int] | None) -> None:
        buffers, state = self.buffers, self._state
        self.zero_counts(decode_rows=num_rows)  # last-token rows 0..num_rows-1

        def head() -> torch.Tensor:
            rows = buffers.query_start_loc[1 : num_rows + 1].long() - 1
            return self.model.compute_logits(
                state.hidden.index_select(0, rows), out=state.logits[:num_rows]
            )

        self._head[num_rows] = Replayable(head, buffers.device, pool)

    def capture_sample(self, key: tuple[int, bool], pool: tuple[int, int] | None) -> None:
        """The sampling graph of key = (num_rows, whether it runs the threshold kernels)."""
        num_rows, filters = key
        buffers, state = self.buffers, self._state
        rows_state = state.states
        self.zero_counts(decode_rows=num_rows)
        state.sampling_state.flush_to_device()

        def sample() -> torch.Tensor:
            idx_mapping = buffers.idx_mapping[:num_rows]
            sampled = state.sampler.sample_graphable(
                state.logits[:num_rows], idx_mapping, buffers.seq_lens[:num_rows].long(), filters
            )
            post_update(
                idx_mapping,
                buffers.query_start_loc[: num_rows + 1],
                sampled,
                rows_state.num_computed_gpu,
                rows_state.total_len_gpu,
                rows_state.token_ids_gpu,
                rows_state.last_sampled_gpu,
                num_reqs=num_rows,
                step_counts=buffers.step_counts,
            )
            return sampled

        self._sample[key] = Replayable(sample, buffers.device, pool)

    def prepare(self, shape: ForwardShape) -> None:
        """Input prep of a step of `shape` on the buffers (the forward graphs', and the
        uniform speculative steps': gpu/spec_decode/uniform_graphs.py)."""
        buffers, rows_state = self.buffers, self._state.states
        num_reqs, num_tokens, counts = shape.num_reqs, shape.num_tokens, buffers.step_counts
        idx_mapping = buffers.idx_mapping[:num_reqs]
        query_start_loc = buffers.query_start_loc[: num_reqs + 1]
        prepare_inputs(
            idx_mapping,
            query_start_loc,
            rows_state.token_ids_gpu,
            rows_state.num_computed_gpu,
            buffers.input_ids[:num_tokens],
            buffers.positions[:num_tokens],
            buffers.seq_lens[:num_reqs],
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            step_counts=counts,
        )
        gather_block_table(
            idx_mapping,
            rows_state.block_table_gpu,
            buffers.block_table[:num_reqs],
            num_reqs=num_reqs,
            step_counts=counts,
        )
        compute_slot_mapping(
            query_start_loc,
            buffers.positions[:num_tokens],
            buffers.block_table[:num_reqs],
            self.block_size,
            buffers.slot_mapping[:num_tokens],
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            step_counts=counts,
        )

    def zero_counts(self, decode_rows: int) -> None:
        """A capture step: no real request (nothing read from or written to the KV cache or
        the rows); query_start_loc one token per row for the first decode_rows rows (decode
        padding, valid last-token rows), no tokens after them."""
        buffers = self.buffers
        buffers.step_counts.zero_()
        buffers.idx_mapping.zero_()
        starts = torch.arange(
            buffers.query_start_loc.shape[0], dtype=torch.int32, device=buffers.device
        )
        buffers.query_start_loc.copy_(starts.clamp(max=decode_rows))


def measure_graph_memory(graphs: StepGraphs) -> tuple[int, dict[str, int]]:
    """Estimate the device memory all of `graphs` will take, before the KV cache exists.

    As vLLM does, per kind of graph: capture only its two largest shapes into one
    throwaway pool, measure what the device lost with each, extrapolate first + (n - 1) *
    max(second, 1 MiB); then release them. Returns (estimated bytes, the terms for the log).
    """
    families: dict[str, tuple[list, Callable]] = {
        "decode": (
            sorted(
                (s for s in graphs.forward_shapes() if s.is_decode), key=lambda s: -s.num_tokens
            ),
            graphs.capture_forward,
        ),
        "mixed": (
            sorted(
                (s for s in graphs.forward_shapes() if not s.is_decode), key=lambda s: -s.num_tokens
            ),
            graphs.capture_forward,
        ),
        "head": (sorted(graphs.sizes.decode, reverse=True), graphs.capture_head),
        "sample": (
            [(n, f) for n in sorted(graphs.sizes.decode, reverse=True) for f in (True, False)],
            graphs.capture_sample,
        ),
    }
    pool = torch.cuda.graph_pool_handle()
    estimate, terms = 0, {}
    for name, (shapes, capture) in families.items():
        measured = []
        for shape in shapes[:2]:
            # Capturing empties the allocator's cache; empty it first, so that the
            # difference is the graph's own memory and not cached blocks handed back.
            free_before = _free_after_emptying_cache()
            capture(shape, pool)
            measured.append(free_before - _free_after_emptying_cache())
        if measured:
            second = measured[1] if len(measured) > 1 else 0
            estimate += measured[0] + (len(shapes) - 1) * max(second, 1 << 20)
            terms[f"{name}_first_bytes"], terms[f"{name}_count"] = measured[0], len(shapes)
    graphs.release()
    del pool
    _free_after_emptying_cache()
    return estimate, terms


def _free_after_emptying_cache() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]
