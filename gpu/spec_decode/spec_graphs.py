"""CUDA graphs of a speculative step's tail: head, sampling, acceptance, post-update, drafts.

Launched eagerly from Python, the tail of a speculative V2 step (the LM head over the
logit rows, the sampler, accept_draft_prefix, spec_post_update, the ngram proposer) is
dozens of small kernels, and on a small model the device waits on that CPU time. So the
tail is captured too, per padded request count P (the decode sizes, up to
MAX_SPEC_GRAPH_LOGIT_ROWS logit rows) and with or without the min-p / top-k / top-p
threshold kernels, in one fixed shape:

- logit rows: P * (K + 1), request b owning rows b * (K + 1) .. b * (K + 1) + K. Row j of
  a request with s draft slots reads the token at index end_b - 1 - s + min(j, s): rows
  j <= s are exactly those of the variable layout (spec_step.spec_layout); the rows past
  s repeat row s and are never accepted, because the drafts compared with them are masked
  to -1 (accept_draft_prefix stops at the first -1).
- padding requests (b >= the step's count, which the kernels read from
  InputBuffers.step_counts) have no tokens and no slots and name the step's first request
  row: spec_post_update skips them, and every write the proposer makes for them (draft
  table, history past the known tokens) repeats that row's own write with the same
  values, since the drafts are a function of the row's history alone.
- sampling is Sampler.sample_graphable (temperature, min-p / top-k / top-p, the seeded
  Gumbel draw keyed on the position): at every real logit row the token the ordinary
  sampler draws. Steps that need logit bias, min_tokens, penalties or logprobs keep the
  eager tail (gpu/spec_decode/spec_step.py), as do steps larger than the largest graph.

A proposal alone (DeviceDrafts.propose over the padded rows) is captured per P as well:
a speculative step after plain ones proposes before its forward, and launched eagerly
those dozen small launches cost the CPU more than the device.

Per step the CPU uploads num_draft_slots [P] beside the runner's step metadata; nothing
else. `spec_tail` (gpu/spec_decode/spec_tail.py) is the one function both ways run: the
graph captures it, and off CUDA it runs eagerly on the same buffers (which is how the
tests check it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from actors.protocol.speculative_config import SpeculativeConfig
from gpu.cuda_graphs import StepGraphs
from gpu.replayable import Replayable
from gpu.runner_v2.step_state import V2StepState
from gpu.spec_decode.device_drafts import DeviceDrafts
from gpu.spec_decode.spec_tail import padded_rows, spec_tail
from gpu.spec_decode.uniform_graphs import UniformSpecGraphs

MAX_SPEC_GRAPH_LOGIT_ROWS = 512
"""Largest P * (K + 1) captured: the graph holds its [rows, vocab] float32 logits (about
0.3 GiB at 512 rows of a 152k vocabulary); larger steps launch few enough kernels per
token that the eager tail costs little."""


def spec_graph_sizes(decode_sizes: Sequence[int], num_speculative_tokens: int) -> tuple[int, ...]:
    """The padded request counts whose speculative tail is captured."""
    rows_per_req = num_speculative_tokens + 1
    return tuple(n for n in decode_sizes if n * rows_per_req <= MAX_SPEC_GRAPH_LOGIT_ROWS)


class SpecTailGraphs:
    """The speculative tail's graphs (see the module doc) and the draft tables they read
    and write; off CUDA `run` calls spec_tail eagerly on the same buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        step_state: V2StepState,
        config: SpeculativeConfig,
        decode_sizes: Sequence[int],
    ) -> None:
        if step_state.hidden is None:
            raise ValueError("the step state has no graph outputs (built with_graph_outputs=False)")
        buffers = step_state.buffers
        self.drafts = DeviceDrafts(config, buffers.max_num_reqs, buffers.device)
        self.sizes = spec_graph_sizes(decode_sizes, config.num_speculative_tokens)
        self.num_draft_slots_gpu = torch.zeros(
            buffers.max_num_reqs, dtype=torch.int32, device=buffers.device
        )
        self._model = model
        self._state = step_state
        self._tails: dict[tuple[int, bool], Replayable] = {}
        self._proposals: dict[int, Replayable] = {}
        self.capture_time_s = 0.0
        self.uniform: UniformSpecGraphs | None = None
        """The uniform steps' graphs over these draft tables (gpu/spec_decode/spec_capture.py)."""

    def holds(self, num_reqs_padded: int) -> bool:
        """Whether a step padded to num_reqs_padded requests has a captured tail."""
        return num_reqs_padded in self.sizes

    @torch.inference_mode()
    def capture(self, step_graphs: StepGraphs, pool: tuple[int, int] | None = None) -> float:
        """Capture every tail, largest first, into `pool` (a fresh one by default); returns
        the seconds it took. The capture steps have no real request (step_counts = 0): no
        row's computed count, length or history moves."""
        started = time.perf_counter()
        is_cuda = self._state.buffers.device.type == "cuda"
        if pool is None and is_cuda:
            pool = torch.cuda.graph_pool_handle()
        self._state.sampling_state.flush_to_device()
        for size in sorted(self.sizes, reverse=True):
            for filters in (True, False):
                step_graphs.zero_counts(decode_rows=size)
                self.num_draft_slots_gpu.zero_()
                self._tails[size, filters] = Replayable(
                    self._tail_fn(size, filters), self._state.buffers.device, pool
                )
            self._proposals[size] = Replayable(
                self._propose_fn(size), self._state.buffers.device, pool
            )
        if is_cuda:
            torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - started
        return self.capture_time_s

    def upload_slots(
        self,
        num_draft_slots_np: np.ndarray,  # [num_reqs] int
        num_reqs_padded: int,
    ) -> None:
        """Send the step's draft slots (0 for padding requests) through a fresh pinned
        buffer, as upload_step_meta does: no in-flight copy reads it again."""
        device = self.num_draft_slots_gpu.device
        staging = torch.zeros(num_reqs_padded, dtype=torch.int32, pin_memory=device.type == "cuda")
        staging.numpy()[: num_draft_slots_np.shape[0]] = num_draft_slots_np
        self.num_draft_slots_gpu[:num_reqs_padded].copy_(staging, non_blocking=True)

    def run(self, num_reqs_padded: int, filters: bool) -> torch.Tensor:
        """[P, K + 3] int64 (spec_tail's result), in a tensor the next replay overwrites."""
        return self._tails[num_reqs_padded, filters]()

    def propose(self, num_reqs_padded: int) -> None:
        """Propose drafts for the step's rows (DeviceDrafts.propose over its padded rows):
        one replay where eager launches would cost the CPU more than the device."""
        self._proposals[num_reqs_padded]()

    def _propose_fn(self, size: int) -> Callable[[], None]:
        state = self._state

        def propose() -> None:
            self.drafts.propose(state.states, padded_rows(state.buffers, size))

        return propose

    def _tail_fn(self, size: int, filters: bool) -> Callable[[], torch.Tensor]:
        state, slots = self._state, self.num_draft_slots_gpu[:size]

        def tail() -> torch.Tensor:
            return spec_tail(
                self._model,
                state.hidden,
                state.buffers,
                slots,
                state.states,
                state.sampler,
                self.drafts,
                filters,
            )

        return tail
