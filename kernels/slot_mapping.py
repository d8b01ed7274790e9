"""Per-step block table and KV-cache slot mapping, built on the device.

`gather_block_table` copies the persistent block-table row of each scheduled request into
a per-step table at a fixed address (CUDA graphs read it there) and zeroes the padding
rows. `compute_slot_mapping` turns each real token's position into its KV-cache slot:

    slot = block_table_out[b, pos // block_size] * block_size + pos % block_size

and pads the rest of slot_mapping_out with -1 (PAD_SLOT_ID: attention skips the store).
Every position must fall inside the request's block-table row (the KV cache manager
allocates blocks before scheduling); the Triton kernel masks reads past the row end
instead of faulting, the reference raises an indexing error.

With `step_counts` ([num_reqs, num_tokens] int32 on the device, as inside a CUDA graph)
num_reqs and num_tokens are upper bounds and the real counts are read from the device.
"""

import torch

from kernels._checks import (
    check_contiguous_rows,
    check_dtype_and_rank,
    check_same_device,
    check_step_counts,
    check_triton_device,
    need_triton,
    read_step_counts,
)
from kernels._triton import HAS_TRITON, tl, triton

PAD_SLOT_ID = -1
_BLOCK_SIZE = 256

if HAS_TRITON:

    @triton.jit
    def _gather_block_table_kernel(
        idx_mapping_ptr,
        block_table_ptr,
        block_table_stride,
        block_table_out_ptr,
        block_table_out_stride,
        num_reqs,
        max_num_blocks,
        step_counts_ptr,
        HAS_STEP_COUNTS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        batch_idx = tl.program_id(0)
        offsets = tl.arange(0, BLOCK_SIZE)
        out_row_ptr = block_table_out_ptr + batch_idx.to(tl.int64) * block_table_out_stride
        if HAS_STEP_COUNTS:
            num_reqs = tl.load(step_counts_ptr)
        if batch_idx < num_reqs:
            row = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
            for block_start in range(0, max_num_blocks, BLOCK_SIZE):
                col = block_start + offsets
                mask = col < max_num_blocks
                blocks = tl.load(block_table_ptr + row * block_table_stride + col, mask=mask)
                tl.store(out_row_ptr + col, blocks, mask=mask)
        else:
            for block_start in range(0, max_num_blocks, BLOCK_SIZE):
                col = block_start + offsets
                tl.store(out_row_ptr + col, 0, mask=col < max_num_blocks)

    @triton.jit
    def _compute_slot_mapping_kernel(
        query_start_loc_ptr,
        positions_ptr,
        block_table_out_ptr,
        block_table_out_stride,
        slot_mapping_ptr,
        num_reqs,
        num_tokens,
        num_tokens_padded,
        max_num_blocks,
        block_size,
        step_counts_ptr,
        HAS_STEP_COUNTS: tl.constexpr,
        PAD_SLOT: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        batch_idx = tl.program_id(0)
        offsets = tl.arange(0, BLOCK_SIZE)
        is_padding_program = batch_idx == tl.num_programs(0) - 1
        if HAS_STEP_COUNTS:
            num_reqs = tl.load(step_counts_ptr)
            num_tokens = tl.load(step_counts_ptr + 1)
        if batch_idx < num_reqs:
            start = tl.load(query_start_loc_ptr + batch_idx)
            end = tl.load(query_start_loc_ptr + batch_idx + 1)
            table_row_ptr = block_table_out_ptr + batch_idx.to(tl.int64) * block_table_out_stride
            for block_start in range(start, end, BLOCK_SIZE):
                token_idx = block_start + offsets
                in_query = token_idx < end
                pos = tl.load(positions_ptr + token_idx, mask=in_query, other=0)
                block_idx = pos // block_size
                block_ids = tl.load(
                    table_row_ptr + block_idx, mask=in_query & (block_idx < max_num_blocks), other=0
                )
                slots = block_ids.to(tl.int64) * block_size + pos % block_size
                tl.store(slot_mapping_ptr + token_idx, slots, mask=in_query)
        elif is_padding_program:
            for block_start in range(num_tokens, num_tokens_padded, BLOCK_SIZE):
                token_idx = block_start + offsets
                tl.store(slot_mapping_ptr + token_idx, PAD_SLOT, mask=token_idx < num_tokens_padded)


def _check_gather_args(
    idx_mapping: torch.Tensor,
    block_table: torch.Tensor,
    block_table_out: torch.Tensor,
    num_reqs: int,
    step_counts: torch.Tensor | None = None,
) -> None:
    check_dtype_and_rank("idx_mapping", idx_mapping, torch.int32, 1)
    check_step_counts(step_counts, block_table_out.device)
    check_dtype_and_rank("block_table", block_table, torch.int32, 2)
    check_dtype_and_rank("block_table_out", block_table_out, torch.int32, 2)
    check_same_device(
        idx_mapping=idx_mapping, block_table=block_table, block_table_out=block_table_out
    )
    if not 0 <= num_reqs <= min(idx_mapping.shape[0], block_table_out.shape[0]):
        raise ValueError(
            f"num_reqs ({num_reqs}) must be in [0, min(len(idx_mapping)={idx_mapping.shape[0]}, "
            f"block_table_out rows={block_table_out.shape[0]})]"
        )
    if block_table_out.shape[1] != block_table.shape[1]:
        raise ValueError(
            f"block_table_out has {block_table_out.shape[1]} columns, "
            f"block_table {block_table.shape[1]}"
        )


def gather_block_table_ref(
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32, batch position -> request row
    block_table: torch.Tensor,  # [max_num_reqs, max_blocks_per_req] int32
    block_table_out: torch.Tensor,  # [num_reqs_padded, max_blocks_per_req] int32
    num_reqs: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Torch reference of `gather_block_table`."""
    _check_gather_args(idx_mapping, block_table, block_table_out, num_reqs, step_counts)
    num_reqs = read_step_counts(step_counts, num_reqs, None)[0]
    block_table_out[:num_reqs] = block_table[idx_mapping[:num_reqs].long()]
    block_table_out[num_reqs:] = 0


def gather_block_table_triton(
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32
    block_table: torch.Tensor,  # [max_num_reqs, max_blocks_per_req] int32, rows contiguous
    block_table_out: torch.Tensor,  # [num_reqs_padded, max_blocks_per_req] int32, rows contiguous
    num_reqs: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Triton launcher of `gather_block_table`: one program per output row."""
    _check_gather_args(idx_mapping, block_table, block_table_out, num_reqs, step_counts)
    need_triton("gather_block_table_triton")
    check_triton_device("gather_block_table_triton", block_table_out.device)
    check_contiguous_rows(
        idx_mapping=idx_mapping, block_table=block_table, block_table_out=block_table_out
    )
    if block_table_out.shape[0] == 0:
        return
    _gather_block_table_kernel[(block_table_out.shape[0],)](
        idx_mapping,
        block_table,
        block_table.stride(0),
        block_table_out,
        block_table_out.stride(0),
        num_reqs,
        block_table.shape[1],
        block_table_out if step_counts is None else step_counts,
        HAS_STEP_COUNTS=step_counts is not None,
        BLOCK_SIZE=_BLOCK_SIZE,
    )


def gather_block_table(
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32, batch position -> request row
    block_table: torch.Tensor,  # [max_num_reqs, max_blocks_per_req] int32
    block_table_out: torch.Tensor,  # [num_reqs_padded, max_blocks_per_req] int32
    num_reqs: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """block_table_out[b] = block_table[idx_mapping[b]] for b < num_reqs; later rows = 0."""
    impl = (
        gather_block_table_triton
        if HAS_TRITON and block_table_out.is_cuda
        else gather_block_table_ref
    )
    impl(idx_mapping, block_table, block_table_out, num_reqs, step_counts)


def _check_slot_args(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table_out: torch.Tensor,
    block_size: int,
    slot_mapping_out: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    step_counts: torch.Tensor | None = None,
) -> None:
    check_dtype_and_rank("query_start_loc", query_start_loc, torch.int32, 1)
    check_dtype_and_rank("positions", positions, torch.int64, 1)
    check_step_counts(step_counts, slot_mapping_out.device)
    check_dtype_and_rank("block_table_out", block_table_out, torch.int32, 2)
    check_dtype_and_rank("slot_mapping_out", slot_mapping_out, torch.int64, 1)
    check_same_device(
        query_start_loc=query_start_loc,
        positions=positions,
        block_table_out=block_table_out,
        slot_mapping_out=slot_mapping_out,
    )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not 0 <= num_reqs <= block_table_out.shape[0] or query_start_loc.shape[0] < num_reqs + 1:
        raise ValueError(
            f"num_reqs ({num_reqs}) must be in [0, {block_table_out.shape[0]}] "
            "(block_table_out rows) with query_start_loc holding num_reqs + 1 entries "
            f"(has {query_start_loc.shape[0]})"
        )
    if not 0 <= num_tokens <= min(positions.shape[0], slot_mapping_out.shape[0]):
        raise ValueError(
            f"num_tokens ({num_tokens}) must be in [0, min(len(positions)={positions.shape[0]}, "
            f"len(slot_mapping_out)={slot_mapping_out.shape[0]})]"
        )


def compute_slot_mapping_ref(
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32
    positions: torch.Tensor,  # [>= num_tokens] int64
    block_table_out: torch.Tensor,  # [num_reqs_padded, max_blocks_per_req] int32, per-step table
    block_size: int,
    slot_mapping_out: torch.Tensor,  # [num_tokens_padded] int64
    num_reqs: int,
    num_tokens: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Torch reference of `compute_slot_mapping`."""
    _check_slot_args(
        query_start_loc,
        positions,
        block_table_out,
        block_size,
        slot_mapping_out,
        num_reqs,
        num_tokens,
        step_counts,
    )
    num_reqs, num_tokens = read_step_counts(step_counts, num_reqs, num_tokens)
    token_idx = torch.arange(num_tokens, device=positions.device)
    query_end = query_start_loc[1 : num_reqs + 1].long()
    batch_of_token = torch.searchsorted(query_end, token_idx, right=True)
    token_positions = positions[:num_tokens]
    block_ids = block_table_out[batch_of_token, token_positions // block_size].long()
    slot_mapping_out[:num_tokens] = block_ids * block_size + token_positions % block_size
    slot_mapping_out[num_tokens:] = PAD_SLOT_ID


def compute_slot_mapping_triton(
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32
    positions: torch.Tensor,  # [>= num_tokens] int64
    block_table_out: torch.Tensor,  # [num_reqs_padded, max_blocks_per_req] int32, rows contiguous
    block_size: int,
    slot_mapping_out: torch.Tensor,  # [num_tokens_padded] int64
    num_reqs: int,
    num_tokens: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Triton launcher of `compute_slot_mapping`: one program per request (up to the bound
    num_reqs) plus one for padding."""
    _check_slot_args(
        query_start_loc,
        positions,
        block_table_out,
        block_size,
        slot_mapping_out,
        num_reqs,
        num_tokens,
        step_counts,
    )
    need_triton("compute_slot_mapping_triton")
    check_triton_device("compute_slot_mapping_triton", slot_mapping_out.device)
    check_contiguous_rows(
        query_start_loc=query_start_loc,
        positions=positions,
        block_table_out=block_table_out,
        slot_mapping_out=slot_mapping_out,
    )
    _compute_slot_mapping_kernel[(num_reqs + 1,)](
        query_start_loc,
        positions,
        block_table_out,
        block_table_out.stride(0),
        slot_mapping_out,
        num_reqs,
        num_tokens,
        slot_mapping_out.shape[0],
        block_table_out.shape[1],
        block_size,
        slot_mapping_out if step_counts is None else step_counts,
        HAS_STEP_COUNTS=step_counts is not None,
        PAD_SLOT=PAD_SLOT_ID,
        BLOCK_SIZE=_BLOCK_SIZE,
    )


def compute_slot_mapping(
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32, cumsum of query lengths
    positions: torch.Tensor,  # [>= num_tokens] int64
    block_table_out: torch.Tensor,  # [num_reqs_padded, max_blocks_per_req] int32, per-step table
    block_size: int,
    slot_mapping_out: torch.Tensor,  # [num_tokens_padded] int64
    num_reqs: int,
    num_tokens: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Fill slot_mapping_out with each real token's KV slot and -1 past num_tokens."""
    impl = (
        compute_slot_mapping_triton
        if HAS_TRITON and slot_mapping_out.is_cuda
        else compute_slot_mapping_ref
    )
    impl(
        query_start_loc,
        positions,
        block_table_out,
        block_size,
        slot_mapping_out,
        num_reqs,
        num_tokens,
        step_counts,
    )
