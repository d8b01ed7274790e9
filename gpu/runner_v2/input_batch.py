"""Per-step inputs of the V2 runner, built on the device from the row table.

Only `idx_mapping` and `query_start_loc` cross from the CPU each step (one copy); the
kernels in kernels/prepare_inputs.py and kernels/slot_mapping.py build token ids,
positions, sequence lengths, the step's block table and the slot mapping from device state,
into the worker's persistent `InputBuffers`, whose addresses stay fixed so that the decode
CUDA graphs replay on them. A decode-only step that a graph holds is padded to the graph's
size: the extra query_start_loc entries give each padding row one token, and the kernels
clear the padding rows' lengths (0), slots (-1) and block-table rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.messages import SchedulerOutput
from gpu.attention.base import AttentionMetadata
from gpu.cuda_graphs import DecodeGraphs, decode_metadata
from gpu.input_buffers import InputBuffers
from gpu.runner_v2.states import RequestStates
from kernels.prepare_inputs import prepare_inputs
from kernels.slot_mapping import compute_slot_mapping, gather_block_table

__all__ = ["InputBatch", "InputBuffers", "build_input_batch"]


@dataclass(frozen=True, slots=True)
class InputBatch:
    num_reqs: int
    num_tokens: int
    num_reqs_padded: int | None
    """The CUDA graph size this decode step replays with; None = run eagerly."""
    idx_mapping_np: np.ndarray  # [num_reqs] int32 rows
    idx_mapping_gpu: torch.Tensor  # [num_reqs] int32
    query_start_loc_gpu: torch.Tensor  # [num_reqs + 1] int32
    input_ids_gpu: torch.Tensor  # [num_tokens]
    positions_gpu: torch.Tensor  # [num_tokens] int64
    seq_lens_gpu: torch.Tensor  # [num_reqs] int32: computed tokens + this step's tokens
    logits_indices_gpu: torch.Tensor  # [num_reqs] int64: last token of each request
    attn_metadata: AttentionMetadata


def build_input_batch(sched: SchedulerOutput, states: RequestStates, buffers: InputBuffers,
                      block_size: int, graphs: DecodeGraphs | None = None) -> InputBatch:
    num_reqs = sched.num_reqs
    num_scheduled_np = np.asarray(sched.num_scheduled_tokens, dtype=np.int32)
    idx_mapping_np = np.fromiter((states.row_of[r] for r in sched.scheduled_request_ids),
                                 dtype=np.int32, count=num_reqs)
    max_query_len = int(num_scheduled_np.max())
    num_reqs_padded = None
    if graphs is not None and max_query_len == 1:
        num_reqs_padded = graphs.padded_size(num_reqs)
    if num_reqs_padded is not None:
        # Decode: request b owns token b; padding rows get one token each.
        query_start_loc_np = np.arange(num_reqs_padded + 1, dtype=np.int32)
        num_tokens = num_reqs
    else:
        query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_scheduled_np, out=query_start_loc_np[1:])
        num_tokens = int(query_start_loc_np[-1])
    buffers.upload_step_meta(idx_mapping_np, query_start_loc_np)
    idx_mapping_gpu = buffers.idx_mapping[:num_reqs]
    query_start_loc_gpu = buffers.query_start_loc[: num_reqs + 1]

    prepare_inputs(idx_mapping_gpu, query_start_loc_gpu, states.token_ids_gpu,
                   states.num_computed_gpu, buffers.input_ids, buffers.positions,
                   buffers.seq_lens, num_reqs=num_reqs, num_tokens=num_tokens)
    gather_block_table(idx_mapping_gpu, states.block_table_gpu, buffers.block_table,
                       num_reqs=num_reqs)
    compute_slot_mapping(query_start_loc_gpu, buffers.positions, buffers.block_table, block_size,
                         buffers.slot_mapping, num_reqs=num_reqs, num_tokens=num_tokens)

    seq_lens_np = np.asarray(sched.num_computed_tokens, dtype=np.int32) + num_scheduled_np
    if num_reqs_padded is not None:
        attn_metadata = decode_metadata(buffers, num_reqs_padded, int(seq_lens_np.max()),
                                        query_start_loc_np, seq_lens_np)
    else:
        attn_metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
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
        num_reqs_padded=num_reqs_padded,
        idx_mapping_np=idx_mapping_np,
        idx_mapping_gpu=idx_mapping_gpu,
        query_start_loc_gpu=query_start_loc_gpu,
        input_ids_gpu=buffers.input_ids[:num_tokens],
        positions_gpu=buffers.positions[:num_tokens],
        seq_lens_gpu=buffers.seq_lens[:num_reqs],
        logits_indices_gpu=query_start_loc_gpu[1:].to(torch.int64) - 1,
        attn_metadata=attn_metadata,
    )
