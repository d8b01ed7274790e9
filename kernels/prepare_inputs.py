"""Per-step model inputs (input_ids, positions, seq_lens) built on the device from the
runner's persistent request state, so a step needs only `idx_mapping` and
`query_start_loc` from the CPU.

For each scheduled request b (row r = idx_mapping[b]) and each of its tokens i in
[query_start_loc[b], query_start_loc[b + 1]):

    pos = num_computed_tokens[r] + (i - query_start_loc[b])
    input_ids_out[i] = token_ids[r, pos]
    positions_out[i] = pos
    seq_lens_out[b] = num_computed_tokens[r] + query_len[b]

Entries past the real tokens / requests (CUDA-graph padding) are set to 0. Every position
must be below max_model_len (the scheduler guarantees it); the Triton kernel masks reads
past the row end instead of faulting, the reference raises an indexing error.

Inside a CUDA graph the real counts change from replay to replay while the launch stays
fixed: with `step_counts` ([num_reqs, num_tokens] int32 on the device), num_reqs and
num_tokens are only upper bounds (the launch's extent) and the real counts are read from
the device.
"""

import torch

from kernels._checks import (
    check_contiguous_rows,
    check_dtype_and_rank,
    check_same_device,
    check_step_counts,
    check_token_history_device,
    check_triton_device,
    need_triton,
    read_step_counts,
)
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 256

if HAS_TRITON:

    @triton.jit
    def _prepare_inputs_kernel(
        idx_mapping_ptr,
        query_start_loc_ptr,
        token_ids_ptr,
        token_ids_stride,
        num_computed_tokens_ptr,
        input_ids_ptr,
        positions_ptr,
        seq_lens_ptr,
        num_reqs,
        num_tokens,
        num_tokens_padded,
        num_reqs_padded,
        max_model_len,
        step_counts_ptr,
        HAS_STEP_COUNTS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        batch_idx = tl.program_id(0)
        offsets = tl.arange(0, BLOCK_SIZE)
        is_padding_program = batch_idx == tl.num_programs(0) - 1
        if HAS_STEP_COUNTS:
            num_reqs = tl.load(step_counts_ptr)
            num_tokens = tl.load(step_counts_ptr + 1)
        if batch_idx < num_reqs:
            row = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
            start = tl.load(query_start_loc_ptr + batch_idx)
            end = tl.load(query_start_loc_ptr + batch_idx + 1)
            num_computed = tl.load(num_computed_tokens_ptr + row)
            for block_start in range(start, end, BLOCK_SIZE):
                token_idx = block_start + offsets
                in_query = token_idx < end
                pos = num_computed + (token_idx - start)
                ids = tl.load(
                    token_ids_ptr + row * token_ids_stride + pos,
                    mask=in_query & (pos < max_model_len),
                    other=0,
                )
                tl.store(input_ids_ptr + token_idx, ids, mask=in_query)
                tl.store(positions_ptr + token_idx, pos, mask=in_query)
            tl.store(seq_lens_ptr + batch_idx, num_computed + (end - start))
        elif is_padding_program:
            # The one extra program zeroes the CUDA-graph padding.
            for block_start in range(num_tokens, num_tokens_padded, BLOCK_SIZE):
                token_idx = block_start + offsets
                pad = token_idx < num_tokens_padded
                tl.store(input_ids_ptr + token_idx, 0, mask=pad)
                tl.store(positions_ptr + token_idx, 0, mask=pad)
            for block_start in range(num_reqs, num_reqs_padded, BLOCK_SIZE):
                batch_pad_idx = block_start + offsets
                tl.store(seq_lens_ptr + batch_pad_idx, 0, mask=batch_pad_idx < num_reqs_padded)


def _check_args(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_ids: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    input_ids_out: torch.Tensor,
    positions_out: torch.Tensor,
    seq_lens_out: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    step_counts: torch.Tensor | None = None,
) -> None:
    check_dtype_and_rank("idx_mapping", idx_mapping, torch.int32, 1)
    check_step_counts(step_counts, input_ids_out.device)
    check_dtype_and_rank("query_start_loc", query_start_loc, torch.int32, 1)
    check_dtype_and_rank("token_ids", token_ids, torch.int32, 2)
    check_dtype_and_rank("num_computed_tokens", num_computed_tokens, torch.int32, 1)
    check_dtype_and_rank("input_ids_out", input_ids_out, (torch.int32, torch.int64), 1)
    check_dtype_and_rank("positions_out", positions_out, torch.int64, 1)
    check_dtype_and_rank("seq_lens_out", seq_lens_out, torch.int32, 1)
    if num_reqs < 0 or num_tokens < 0:
        raise ValueError(f"num_reqs ({num_reqs}) and num_tokens ({num_tokens}) must be >= 0")
    if idx_mapping.shape[0] < num_reqs or query_start_loc.shape[0] < num_reqs + 1:
        raise ValueError(
            f"idx_mapping ({idx_mapping.shape[0]}) needs >= num_reqs ({num_reqs}) entries and "
            f"query_start_loc ({query_start_loc.shape[0]}) >= num_reqs + 1"
        )
    if seq_lens_out.shape[0] < num_reqs:
        raise ValueError(
            f"seq_lens_out has {seq_lens_out.shape[0]} entries, fewer than num_reqs ({num_reqs})"
        )
    if input_ids_out.shape[0] < num_tokens or positions_out.shape[0] < num_tokens:
        raise ValueError(
            f"input_ids_out ({input_ids_out.shape[0]}) and positions_out "
            f"({positions_out.shape[0]}) must hold num_tokens ({num_tokens})"
        )
    if input_ids_out.shape[0] != positions_out.shape[0]:
        raise ValueError("input_ids_out and positions_out must have the same length")
    if num_computed_tokens.shape[0] != token_ids.shape[0]:
        raise ValueError("num_computed_tokens and token_ids must have one entry per request row")
    device = check_same_device(
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        num_computed_tokens=num_computed_tokens,
        input_ids_out=input_ids_out,
        positions_out=positions_out,
        seq_lens_out=seq_lens_out,
    )
    check_token_history_device(token_ids, device)


def prepare_inputs_ref(
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32, batch position -> request row
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32, cumsum of query lengths
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32
    num_computed_tokens: torch.Tensor,  # [max_num_reqs] int32
    input_ids_out: torch.Tensor,  # [num_tokens_padded] int32 or int64
    positions_out: torch.Tensor,  # [num_tokens_padded] int64
    seq_lens_out: torch.Tensor,  # [num_reqs_padded] int32
    num_reqs: int,
    num_tokens: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Torch reference of `prepare_inputs` (same semantics, any device; reading
    step_counts syncs a GPU)."""
    _check_args(
        idx_mapping,
        query_start_loc,
        token_ids,
        num_computed_tokens,
        input_ids_out,
        positions_out,
        seq_lens_out,
        num_reqs,
        num_tokens,
        step_counts,
    )
    num_reqs, num_tokens = read_step_counts(step_counts, num_reqs, num_tokens)
    device = input_ids_out.device
    query_start = query_start_loc[: num_reqs + 1].long()
    token_idx = torch.arange(num_tokens, device=device)
    # searchsorted instead of repeat_interleave: no host sync for the output size.
    batch_of_token = torch.searchsorted(query_start[1:], token_idx, right=True)
    rows = idx_mapping[:num_reqs].long()
    num_computed = num_computed_tokens[rows].long()
    positions = num_computed[batch_of_token] + (token_idx - query_start[batch_of_token])
    history_device = token_ids.device
    token_rows = rows[batch_of_token].to(history_device)
    ids = token_ids[token_rows, positions.to(history_device)]
    input_ids_out[:num_tokens] = ids.to(device=device, dtype=input_ids_out.dtype)
    positions_out[:num_tokens] = positions
    seq_lens_out[:num_reqs] = (num_computed + query_start[1:] - query_start[:-1]).to(torch.int32)
    input_ids_out[num_tokens:] = 0
    positions_out[num_tokens:] = 0
    seq_lens_out[num_reqs:] = 0


def prepare_inputs_triton(
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, rows contiguous
    num_computed_tokens: torch.Tensor,  # [max_num_reqs] int32
    input_ids_out: torch.Tensor,  # [num_tokens_padded] int32 or int64
    positions_out: torch.Tensor,  # [num_tokens_padded] int64
    seq_lens_out: torch.Tensor,  # [num_reqs_padded] int32
    num_reqs: int,
    num_tokens: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Triton launcher of `prepare_inputs`: one program per request (up to the bound
    num_reqs) plus one for padding."""
    need_triton("prepare_inputs_triton")
    _check_args(
        idx_mapping,
        query_start_loc,
        token_ids,
        num_computed_tokens,
        input_ids_out,
        positions_out,
        seq_lens_out,
        num_reqs,
        num_tokens,
        step_counts,
    )
    check_triton_device("prepare_inputs_triton", input_ids_out.device)
    check_contiguous_rows(
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        num_computed_tokens=num_computed_tokens,
        input_ids_out=input_ids_out,
        positions_out=positions_out,
        seq_lens_out=seq_lens_out,
        token_ids=token_ids,
    )
    _prepare_inputs_kernel[(num_reqs + 1,)](
        idx_mapping,
        query_start_loc,
        token_ids,
        token_ids.stride(0),
        num_computed_tokens,
        input_ids_out,
        positions_out,
        seq_lens_out,
        num_reqs,
        num_tokens,
        input_ids_out.shape[0],
        seq_lens_out.shape[0],
        token_ids.shape[1],
        seq_lens_out if step_counts is None else step_counts,
        HAS_STEP_COUNTS=step_counts is not None,
        BLOCK_SIZE=_BLOCK_SIZE,
    )


def prepare_inputs(
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32, batch position -> request row
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32, cumsum of query lengths
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, device or pinned host (UVA)
    num_computed_tokens: torch.Tensor,  # [max_num_reqs] int32
    input_ids_out: torch.Tensor,  # [num_tokens_padded] int32 or int64
    positions_out: torch.Tensor,  # [num_tokens_padded] int64
    seq_lens_out: torch.Tensor,  # [num_reqs_padded] int32
    num_reqs: int,
    num_tokens: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Fill input_ids_out, positions_out and seq_lens_out in place (see the module doc).

    Runs the Triton kernel on CUDA tensors when Triton is installed, the torch reference
    otherwise.
    """
    impl = prepare_inputs_triton if HAS_TRITON and input_ids_out.is_cuda else prepare_inputs_ref
    impl(
        idx_mapping,
        query_start_loc,
        token_ids,
        num_computed_tokens,
        input_ids_out,
        positions_out,
        seq_lens_out,
        num_reqs,
        num_tokens,
        step_counts,
    )
