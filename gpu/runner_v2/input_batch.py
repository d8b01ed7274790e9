"""Per-step inputs of the V2 runner, built on the device from the row table.

Only `idx_mapping` and `query_start_loc` cross from the CPU each step; the kernels in
kernels/prepare_inputs.py and kernels/slot_mapping.py build token ids, positions, sequence
lengths, the step's block table and the slot mapping from device state. The buffers are
allocated once, so their addresses stay fixed (CUDA graphs replay on them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.messages import SchedulerOutput
from gpu.attention.base import AttentionMetadata
from gpu.runner_v2.states import RequestStates, _to_device
from kernels.prepare_inputs import prepare_inputs
from kernels.slot_mapping import compute_slot_mapping, gather_block_table


@dataclass(frozen=True, slots=True)
class InputBatch:
    num_reqs: int
    num_tokens: int
    idx_mapping_np: np.ndarray  # [num_reqs] int32 rows
    idx_mapping_gpu: torch.Tensor  # [num_reqs] int32
    query_start_loc_gpu: torch.Tensor  # [num_reqs + 1] int32
    input_ids_gpu: torch.Tensor  # [num_tokens]
    positions_gpu: torch.Tensor  # [num_tokens] int64
    logits_indices_gpu: torch.Tensor  # [num_reqs] int64: last token of each request
    attn_metadata: AttentionMetadata


class InputBuffers:
    """Persistent device buffers every step writes into."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32,
                                       device=device)


def build_input_batch(sched: SchedulerOutput, states: RequestStates, buffers: InputBuffers,
                      block_size: int) -> InputBatch:
    num_reqs = sched.num_reqs
    num_scheduled_np = np.asarray(sched.num_scheduled_tokens, dtype=np.int32)
    idx_mapping_np = np.fromiter((states.row_of[r] for r in sched.scheduled_request_ids),
                                 dtype=np.int32, count=num_reqs)
    query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_scheduled_np, out=query_start_loc_np[1:])
    num_tokens = int(query_start_loc_np[-1])
    # One transfer for both small arrays.
    packed_gpu = _to_device(np.concatenate([idx_mapping_np, query_start_loc_np]), states.device)
    idx_mapping_gpu = packed_gpu[:num_reqs]
    query_start_loc_gpu = packed_gpu[num_reqs:]

    prepare_inputs(idx_mapping_gpu, query_start_loc_gpu, states.token_ids_gpu,
                   states.num_computed_gpu, buffers.input_ids, buffers.positions,
                   buffers.seq_lens, num_reqs=num_reqs, num_tokens=num_tokens)
    gather_block_table(idx_mapping_gpu, states.block_table_gpu, buffers.block_table,
                       num_reqs=num_reqs)
    compute_slot_mapping(query_start_loc_gpu, buffers.positions, buffers.block_table, block_size,
                         buffers.slot_mapping, num_reqs=num_reqs, num_tokens=num_tokens)

    seq_lens_np = np.asarray(sched.num_computed_tokens, dtype=np.int32) + num_scheduled_np
    attn_metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=num_reqs,
        max_query_len=int(num_scheduled_np.max()),
        max_seq_len=int(seq_lens_np.max()),
        query_start_loc=query_start_loc_gpu,
        seq_lens=buffers.seq_lens[:num_reqs],
        slot_mapping=buffers.slot_mapping[:num_tokens],
        block_table=buffers.block_table[:num_reqs],
        query_start_loc_cpu=query_start_loc_np,
        seq_lens_cpu=seq_lens_np,
    )
    return InputBatch(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        idx_mapping_np=idx_mapping_np,
        idx_mapping_gpu=idx_mapping_gpu,
        query_start_loc_gpu=query_start_loc_gpu,
        input_ids_gpu=buffers.input_ids[:num_tokens],
        positions_gpu=buffers.positions[:num_tokens],
        logits_indices_gpu=query_start_loc_gpu[1:].to(torch.int64) - 1,
        attn_metadata=attn_metadata,
    )
