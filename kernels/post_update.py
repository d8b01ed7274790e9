"""Post-sampling update of the runner's persistent request state, on the device.

For each scheduled request b (row r = idx_mapping[b], query length q):

    num_computed_tokens[r] += q
    if num_computed_tokens[r] >= total_len[r]:      # the chunk reached the last known token
        token_ids[r, total_len[r]] = sampled_token_ids[b]
        total_len[r] += 1
        last_sampled[r] = sampled_token_ids[b]

A partial prefill chunk samples a token that is thrown away, so it only advances
num_computed_tokens. This is how sampled tokens reach the next step's inputs without a
round trip through the CPU. idx_mapping must not repeat a row within one step. A sample
that would land at or past max_model_len is not stored in token_ids (the scheduler never
runs such a step), but total_len and last_sampled still advance, in both implementations.

With `step_counts` ([num_reqs, num_tokens] int32 on the device, as inside a CUDA graph)
num_reqs is an upper bound and the real count is read from the device.
"""

import torch

from kernels._checks import (
    check_contiguous_rows,
    check_dtype_and_rank,
    check_offsets,
    check_row_state,
    check_same_device,
    check_step_counts,
    check_token_history_device,
    check_triton_device,
    need_triton,
    read_step_counts,
)
from kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _post_update_kernel(
        idx_mapping_ptr,
        query_start_loc_ptr,
        sampled_token_ids_ptr,
        num_computed_tokens_ptr,
        total_len_ptr,
        token_ids_ptr,
        token_ids_stride,
        last_sampled_ptr,
        max_model_len,
        step_counts_ptr,
        HAS_STEP_COUNTS: tl.constexpr,
    ):
        batch_idx = tl.program_id(0)
        if HAS_STEP_COUNTS:
            if batch_idx >= tl.load(step_counts_ptr):
                return
        row = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
        query_len = tl.load(query_start_loc_ptr + batch_idx + 1) - tl.load(
            query_start_loc_ptr + batch_idx
        )
        num_computed = tl.load(num_computed_tokens_ptr + row) + query_len
        tl.store(num_computed_tokens_ptr + row, num_computed)
        total = tl.load(total_len_ptr + row)
        if num_computed >= total:
            token = tl.load(sampled_token_ids_ptr + batch_idx)
            tl.store(
                token_ids_ptr + row * token_ids_stride + total,
                token.to(tl.int32),
                mask=total < max_model_len,
            )
            tl.store(total_len_ptr + row, total + 1)
            tl.store(last_sampled_ptr + row, token)


def _check_args(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    sampled_token_ids: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    total_len: torch.Tensor,
    token_ids: torch.Tensor,
    last_sampled: torch.Tensor,
    num_reqs: int,
    step_counts: torch.Tensor | None = None,
) -> None:
    check_dtype_and_rank("idx_mapping", idx_mapping, torch.int32, 1)
    check_step_counts(step_counts, total_len.device)
    check_dtype_and_rank("query_start_loc", query_start_loc, torch.int32, 1)
    check_dtype_and_rank("sampled_token_ids", sampled_token_ids, torch.int64, 1)
    check_row_state(num_computed_tokens, total_len, token_ids, last_sampled)
    if num_reqs < 0 or min(idx_mapping.shape[0], sampled_token_ids.shape[0]) < num_reqs:
        raise ValueError(
            f"num_reqs ({num_reqs}) must be >= 0 and at most "
            f"len(idx_mapping)={idx_mapping.shape[0]} and "
            f"len(sampled_token_ids)={sampled_token_ids.shape[0]}"
        )
    check_offsets("query_start_loc", query_start_loc, num_reqs)
    device = check_same_device(
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        sampled_token_ids=sampled_token_ids,
        num_computed_tokens=num_computed_tokens,
        total_len=total_len,
        last_sampled=last_sampled,
    )
    check_token_history_device(token_ids, device)


def post_update_ref(
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32, batch position -> request row
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32
    sampled_token_ids: torch.Tensor,  # [>= num_reqs] int64
    num_computed_tokens: torch.Tensor,  # [max_num_reqs] int32, updated in place
    total_len: torch.Tensor,  # [max_num_reqs] int32, updated in place
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, updated in place
    last_sampled: torch.Tensor,  # [max_num_reqs] int64, updated in place
    num_reqs: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Torch reference of `post_update`; needs no host sync (masked writes, no boolean
    indexing) unless step_counts is given."""
    _check_args(
        idx_mapping,
        query_start_loc,
        sampled_token_ids,
        num_computed_tokens,
        total_len,
        token_ids,
        last_sampled,
        num_reqs,
        step_counts,
    )
    num_reqs = read_step_counts(step_counts, num_reqs, None)[0]
    rows = idx_mapping[:num_reqs].long()
    query_lens = query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]
    num_computed = num_computed_tokens[rows] + query_lens
    num_computed_tokens[rows] = num_computed
    total = total_len[rows]
    sampled = sampled_token_ids[:num_reqs]
    is_real_sample = num_computed >= total

    # Rows that do not take the sample rewrite the value already there.
    history_rows = rows.to(token_ids.device)
    write_col = total.clamp(max=token_ids.shape[1] - 1).long().to(token_ids.device)
    fits = (is_real_sample & (total < token_ids.shape[1])).to(token_ids.device)
    current = token_ids[history_rows, write_col]
    token_ids[history_rows, write_col] = torch.where(
        fits, sampled.to(device=token_ids.device, dtype=torch.int32), current
    )

    total_len[rows] = torch.where(is_real_sample, total + 1, total)
    last_sampled[rows] = torch.where(is_real_sample, sampled, last_sampled[rows])


def post_update_triton(
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32
    sampled_token_ids: torch.Tensor,  # [>= num_reqs] int64
    num_computed_tokens: torch.Tensor,  # [max_num_reqs] int32
    total_len: torch.Tensor,  # [max_num_reqs] int32
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, rows contiguous
    last_sampled: torch.Tensor,  # [max_num_reqs] int64
    num_reqs: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Triton launcher of `post_update`: one program per scheduled request (up to the bound)."""
    need_triton("post_update_triton")
    _check_args(
        idx_mapping,
        query_start_loc,
        sampled_token_ids,
        num_computed_tokens,
        total_len,
        token_ids,
        last_sampled,
        num_reqs,
        step_counts,
    )
    check_triton_device("post_update_triton", total_len.device)
    check_contiguous_rows(
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        sampled_token_ids=sampled_token_ids,
        num_computed_tokens=num_computed_tokens,
        total_len=total_len,
        last_sampled=last_sampled,
        token_ids=token_ids,
    )
    if num_reqs == 0:
        return
    _post_update_kernel[(num_reqs,)](
        idx_mapping,
        query_start_loc,
        sampled_token_ids,
        num_computed_tokens,
        total_len,
        token_ids,
        token_ids.stride(0),
        last_sampled,
        token_ids.shape[1],
        total_len if step_counts is None else step_counts,
        HAS_STEP_COUNTS=step_counts is not None,
    )


def post_update(
    idx_mapping: torch.Tensor,  # [>= num_reqs] int32, batch position -> request row
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32, cumsum of query lengths
    sampled_token_ids: torch.Tensor,  # [>= num_reqs] int64, one sample per scheduled request
    num_computed_tokens: torch.Tensor,  # [max_num_reqs] int32, updated in place
    total_len: torch.Tensor,  # [max_num_reqs] int32, updated in place
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, device or pinned host (UVA)
    last_sampled: torch.Tensor,  # [max_num_reqs] int64, updated in place
    num_reqs: int,
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Advance the request state after sampling (see the module doc)."""
    impl = post_update_triton if HAS_TRITON and total_len.is_cuda else post_update_ref
    impl(
        idx_mapping,
        query_start_loc,
        sampled_token_ids,
        num_computed_tokens,
        total_len,
        token_ids,
        last_sampled,
        num_reqs,
        step_counts,
    )
