"""Per-step inputs of the V2 runner for a forward that runs eagerly (no graph holds the step,
or graphs are off), built on the device from the row table.

The step's idx_mapping and query_start_loc are already in the worker's persistent
`InputBuffers` (uploaded with the plan, gpu/runner_v2/step_plan.py); the kernels in
kernels/prepare_inputs.py and kernels/slot_mapping.py build token ids, positions, sequence
lengths, the step's block table and the slot mapping from device state, for exactly the
step's requests and tokens. A step that a forward graph holds builds the same inputs
inside the graph (gpu/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.attention.base import AttentionMetadata
from gpu.input_buffers import InputBuffers
from gpu.runner_v2.states import RequestStates
from gpu.runner_v2.step_plan import StepPlan
from kernels.prepare_inputs import prepare_inputs
from kernels.slot_mapping import compute_slot_mapping, gather_block_table

__all__ = ["InputBatch", "InputBuffers", "build_input_batch"]


@dataclass(frozen=True, slots=True)
class InputBatch:
    input_ids_gpu: torch.Tensor  # [num_tokens]
    positions_gpu: torch.Tensor  # [num_tokens] int64
    logits_indices_gpu: torch.Tensor  # [num_reqs] int64: last token of each request
    attn_metadata: AttentionMetadata


def build_input_batch(
    plan: StepPlan, states: RequestStates, buffers: InputBuffers, block_size: int
) -> InputBatch:
    num_reqs, num_tokens = plan.num_reqs, plan.num_tokens
    idx_mapping_gpu = buffers.idx_mapping[:num_reqs]
    query_start_loc_gpu = buffers.query_start_loc[: num_reqs + 1]
    prepare_inputs(
        idx_mapping_gpu,
        query_start_loc_gpu,
        states.token_ids_gpu,
        states.num_computed_gpu,
        buffers.input_ids,
        buffers.positions,
        buffers.seq_lens,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
    )
    gather_block_table(
        idx_mapping_gpu, states.block_table_gpu, buffers.block_table, num_reqs=num_reqs
    )
    compute_slot_mapping(
        query_start_loc_gpu,
        buffers.positions,
        buffers.block_table,
        block_size,
        buffers.slot_mapping,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
    )
    seq_lens_np = plan.seq_lens_np
    if buffers.device.type == "cpu":
        # The plan's lengths are the scheduler's, an upper bound while speculative steps
        # are in flight; on the CPU the exact ones cost nothing to read (the torch
        # attention loops over them). Device backends read them from the device.
        seq_lens_np = buffers.seq_lens[:num_reqs].numpy().copy()
    attn_metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=num_reqs,
        max_query_len=plan.max_query_len,
        max_seq_len=int(plan.seq_lens_np.max()),
        query_start_loc=query_start_loc_gpu,
        seq_lens=buffers.seq_lens[:num_reqs],
        slot_mapping=buffers.slot_mapping[:num_tokens],
        block_table=buffers.block_table[:num_reqs],
        query_start_loc_cpu=plan.query_start_loc_np[: num_reqs + 1],
        seq_lens_cpu=seq_lens_np,
    )
    return InputBatch(
        input_ids_gpu=buffers.input_ids[:num_tokens],
        positions_gpu=buffers.positions[:num_tokens],
        logits_indices_gpu=query_start_loc_gpu[1:].to(torch.int64) - 1,
        attn_metadata=attn_metadata,
    )
