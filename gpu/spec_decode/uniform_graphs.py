"""Uniform speculative steps: a pure-decode step that speculates, replayed as ONE graph.

A speculative step run as a mixed step (gpu/spec_decode/spec_runner.py: the forward in a
mixed graph, the tail in its own) launches several graphs and copies, and its rows take
1 + slots tokens each, a varlen layout. When every row of the step decodes (no prefill
chunk), the step is made uniform instead: every row runs K + 1 tokens, K the step's
largest slot count, so the whole step has one fixed shape per padded request count P,

    drafts proposed from each row's history (gpu/spec_decode/device_drafts.py)
    -> input prep (token ids, positions, lengths, block table, slot mapping) for P x (K + 1)
    -> the model -> the tail: head over the P x (K + 1) rows, sampling, acceptance,
       post-update (gpu/spec_decode/spec_graphs.py, spec_tail with uniform=True)

and is captured as one CUDA graph per (P, K, filters), K = 1 .. the configured K and P the
decode sizes with P * (K + 1) <= MAX_SPEC_GRAPH_LOGIT_ROWS (and the token buffers). Per
step the CPU uploads the step metadata and the slots, and replays once.

Padding. A row with s < K slots (no drafts wanted, a back-off, max_tokens near) runs its
last token, its s slots, then K - s padding tokens. Their outputs are never used: the
drafts compared with them are masked to -1, so acceptance stops before them, and the
post-update rolls every slot the row did not accept back from its computed count (a row
without slots advances exactly one token, as in a plain step). Their KV writes go
nowhere: their slot mapping is the padding slot (-1, which the KV write skips), so the
padding needs no KV block and the scheduler reserves nothing for it. The real tokens
never read a padding position (attention is causal within the row: token i of the row
sees positions up to its own). A padding token's own attention reads up to its position,
past the row's blocks: the step's block-table columns there are pointed at the row's last
real block (`clamp_padding_blocks`), so those reads stay in the row's own memory, into
outputs nobody reads. Every position stays below max_model_len (the launcher checks
num_computed + K + 1 <= max_model_len for every row, or the step runs mixed), so no read
leaves the token history or the block table.

Proposing first rather than last: the drafts are a function of the row's history alone,
so proposing at the start of every uniform step gives the drafts a step after a plain
one needs without a separate replay, and wastes nothing when a plain step follows.
Padding requests (b >= the step's count) name the step's first row, as in the tail
graphs: their proposals repeat its own writes with the same values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from gpu.attention.base import AttentionMetadata
from gpu.cuda_graphs import StepGraphs
from gpu.replayable import Replayable
from gpu.runner_v2.step_plan import ForwardShape, padded_batch_size
from gpu.runner_v2.step_state import V2StepState
from gpu.spec_decode.device_drafts import DeviceDrafts
from gpu.spec_decode.spec_tail import padded_rows, spec_tail

MIN_QUERY_TILE = 16


def uniform_graph_sizes(
    decode_sizes: Sequence[int], max_draft_len: int, max_num_rows: int
) -> dict[int, tuple[int, ...]]:
    """Per draft length K, the padded request counts P captured (P * (K + 1) <= max_num_rows)."""
    return {
        draft_len: tuple(n for n in decode_sizes if n * (draft_len + 1) <= max_num_rows)
        for draft_len in range(1, max_draft_len + 1)
    }


def mask_padding_slots(
    slot_mapping: torch.Tensor,  # [P * (K + 1)] int64, updated in place
    num_draft_slots: torch.Tensor,  # [P] int32, 0 for padding requests
    draft_len: int,
) -> None:
    """Send the KV writes of every token past its row's last token and slots to the
    padding slot (-1, skipped by the KV write)."""
    rows = slot_mapping.view(-1, draft_len + 1)
    offsets = torch.arange(draft_len + 1, device=slot_mapping.device)
    rows.copy_(torch.where(offsets[None, :] <= num_draft_slots[:, None], rows, -1))


def clamp_padding_blocks(
    block_table: torch.Tensor,  # [P, max_blocks_per_req] int32, the step's, updated in place
    seq_lens: torch.Tensor,  # [P] int32, computed + K + 1 (0 for padding requests)
    num_draft_slots: torch.Tensor,  # [P] int32
    draft_len: int,
    block_size: int,
) -> None:
    """Point every block-table column past a row's last real position (its last token plus
    its slots, which the scheduler gave blocks) at the block holding that position. Only
    padding tokens read those columns, and the entries there may be stale: ids of an
    earlier request's blocks, even of a larger KV cache on the same rows. So their reads
    stay in the row's own block."""
    last_real = (seq_lens.long() - (draft_len + 1) + num_draft_slots.long()).clamp(min=0)
    last_column = (last_real // block_size).clamp(max=block_table.shape[1] - 1)
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    source = torch.minimum(columns[None, :], last_column[:, None])
    block_table.copy_(block_table.gather(1, source))


def uniform_metadata(
    step_graphs: StepGraphs, num_reqs_padded: int, draft_len: int
) -> AttentionMetadata:
    """Attention metadata of a uniform step of P requests x (K + 1) tokens on the buffers.
    The query tile holds a request's K + 1 tokens for a whole head group, so the kernel
    reads each row's KV once for all of its queries."""
    buffers = step_graphs.buffers
    num_tokens = num_reqs_padded * (draft_len + 1)
    config = getattr(step_graphs.model, "config", None)
    group = 1 if config is None else max(1, config.num_heads // config.num_kv_heads)
    tile = 1 << max(0, ((draft_len + 1) * group - 1).bit_length())
    return AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=num_reqs_padded,
        max_query_len=draft_len + 1,
        max_seq_len=step_graphs.max_model_len,
        query_start_loc=buffers.query_start_loc[: num_reqs_padded + 1],
        seq_lens=buffers.seq_lens[:num_reqs_padded],
        slot_mapping=buffers.slot_mapping[:num_tokens],
        block_table=buffers.block_table[:num_reqs_padded],
        query_start_loc_cpu=np.zeros(num_reqs_padded + 1, dtype=np.int32),
        seq_lens_cpu=np.zeros(num_reqs_padded, dtype=np.int32),
        query_tile=max(MIN_QUERY_TILE, tile),
    )


def uniform_step(
    step_graphs: StepGraphs,
    state: V2StepState,
    drafts: DeviceDrafts,
    num_draft_slots: torch.Tensor,  # [P] int32
    draft_len: int,
    filters: bool,
    metadata: AttentionMetadata,
) -> torch.Tensor:  # [P, K + 3] int64: emitted tokens (-1 after), accepted, drafts verified
    """The whole uniform step on the persistent buffers (see the module doc): no host sync,
    no host-side decision, so one CUDA graph holds it; off CUDA it runs eagerly."""
    buffers = state.buffers
    num_reqs_padded = num_draft_slots.shape[0]
    num_tokens = num_reqs_padded * (draft_len + 1)
    drafts.propose(state.states, padded_rows(buffers, num_reqs_padded))
    step_graphs.prepare(ForwardShape(False, num_tokens, num_reqs_padded))
    mask_padding_slots(buffers.slot_mapping[:num_tokens], num_draft_slots, draft_len)
    clamp_padding_blocks(
        buffers.block_table[:num_reqs_padded],
        buffers.seq_lens[:num_reqs_padded],
        num_draft_slots,
        draft_len,
        step_graphs.block_size,
    )
    model = step_graphs.model
    hidden = model(
        buffers.input_ids[:num_tokens],
        buffers.positions[:num_tokens],
        step_graphs.kv_caches,
        metadata,
    )
    return spec_tail(
        model,
        hidden,
        buffers,
        num_draft_slots,
        state.states,
        state.sampler,
        drafts,
        filters,
        draft_len=draft_len,
        uniform=True,
        propose=False,
    )


class UniformSpecGraphs:
    """The uniform step's graphs per (P, K, filters) (see the module doc); off CUDA `run`
    calls uniform_step eagerly on the same buffers."""

    def __init__(
        self,
        step_graphs: StepGraphs,
        step_state: V2StepState,
        drafts: DeviceDrafts,
        num_draft_slots_gpu: torch.Tensor,  # [max_num_reqs] int32, uploaded per step
        max_num_rows: int,
    ) -> None:
        buffers = step_state.buffers
        self.sizes = uniform_graph_sizes(
            step_graphs.sizes.decode,
            drafts.num_speculative_tokens,
            min(max_num_rows, buffers.max_num_tokens),
        )
        self.drafts = drafts
        self.num_draft_slots_gpu = num_draft_slots_gpu
        self._step_graphs = step_graphs
        self._state = step_state
        self._graphs: dict[tuple[int, int, bool], Replayable] = {}
        self.capture_time_s = 0.0

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def padded_size(self, num_reqs: int, draft_len: int) -> int | None:
        """The captured request count a uniform step of num_reqs rows and K = draft_len
        pads to, or None (the step runs mixed)."""
        sizes = self.sizes.get(draft_len, ())
        return padded_batch_size(sizes, num_reqs) if sizes else None

    def capture(self, pool: tuple[int, int] | None) -> float:
        """Capture every graph, most tokens first (the smaller ones reuse the larger ones'
        memory in `pool`); returns the seconds it took. The capture steps have no real
        request (step_counts = 0): no row's computed count, length or history moves."""
        started = time.perf_counter()
        keys = [
            (size, draft_len, filters)
            for draft_len, sizes in self.sizes.items()
            for size in sizes
            for filters in (True, False)
        ]
        self._state.sampling_state.flush_to_device()
        for key in sorted(keys, key=lambda k: -k[0] * (k[1] + 1)):
            self._step_graphs.zero_counts(decode_rows=0)
            self.num_draft_slots_gpu.zero_()
            self._graphs[key] = Replayable(self._fn(*key), self._state.buffers.device, pool)
        self.capture_time_s = time.perf_counter() - started
        return self.capture_time_s

    def run(self, num_reqs_padded: int, draft_len: int, filters: bool) -> torch.Tensor:
        """[P, K + 3] int64 (uniform_step's result), in a tensor the next replay overwrites."""
        key = (num_reqs_padded, draft_len, filters)
        if key not in self._graphs:  # off CUDA nothing is captured until asked
            self._graphs[key] = Replayable(self._fn(*key), self._state.buffers.device, None)
        return self._graphs[key]()

    def _fn(self, size: int, draft_len: int, filters: bool) -> Callable[[], torch.Tensor]:
        metadata = uniform_metadata(self._step_graphs, size, draft_len)
        slots = self.num_draft_slots_gpu[:size]

        def step() -> torch.Tensor:
            return uniform_step(
                self._step_graphs, self._state, self.drafts, slots, draft_len, filters, metadata
            )

        return step
