"""Post-update of a speculative step: a variable number of new tokens per request.

For each scheduled request b (row r = idx_mapping[b], query length q, draft slots s_b,
accepted drafts a_b <= s_b, emitted tokens output[b, 0 .. a_b]):

    num_computed_tokens[r] += q - (s_b - a_b)        # the rejected slots are rolled back
    if num_computed_tokens[r] >= total_len[r]:       # the chunk reached the last known token
        token_ids[r, total_len[r] + j] = output[b, j]   for j in 0 .. a_b
        total_len[r] += a_b + 1
        last_sampled[r] = output[b, a_b]

With s_b = a_b = 0 this is kernels/post_update.py (a partial prefill chunk only advances
its computed count). Rolling back num_computed_tokens is all the reuse of rejected KV
slots needs: the next step computes those positions again and overwrites their entries.
Writes at or past max_model_len are dropped (the scheduler never lets a row get there).

With `step_counts` ([num_reqs, num_tokens] int32 on the device, as inside a CUDA graph)
the batch is padded: only the first step_counts[0] requests are updated, so padding
entries (which name some real row) never touch the row state.
"""

from __future__ import annotations

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
    def _spec_post_update_kernel(
        idx_mapping_ptr,
        query_start_loc_ptr,
        num_draft_slots_ptr,
        output_token_ids_ptr,
        output_stride,
        num_accepted_ptr,
        num_computed_tokens_ptr,
        total_len_ptr,
        token_ids_ptr,
        token_ids_stride,
        last_sampled_ptr,
        max_model_len,
        step_counts_ptr,
        HAS_STEP_COUNTS: tl.constexpr,
        NUM_OUTPUTS: tl.constexpr,
        NUM_OUTPUTS_POW2: tl.constexpr,
    ):
        batch_idx = tl.program_id(0)
        if HAS_STEP_COUNTS:
            if batch_idx >= tl.load(step_counts_ptr):
                return
        row = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
        query_len = tl.load(query_start_loc_ptr + batch_idx + 1) - tl.load(
            query_start_loc_ptr + batch_idx
        )
        num_accepted = tl.load(num_accepted_ptr + batch_idx)
        num_rejected = tl.load(num_draft_slots_ptr + batch_idx) - num_accepted
        num_computed = tl.load(num_computed_tokens_ptr + row) + query_len - num_rejected
        tl.store(num_computed_tokens_ptr + row, num_computed)
        total = tl.load(total_len_ptr + row)
        if num_computed >= total:
            offsets = tl.arange(0, NUM_OUTPUTS_POW2)
            emitted = offsets <= num_accepted
            tokens = tl.load(
                output_token_ids_ptr + batch_idx * output_stride + offsets,
                mask=emitted & (offsets < NUM_OUTPUTS),
                other=0,
            )
            columns = total + offsets
            tl.store(
                token_ids_ptr + row * token_ids_stride + columns,
                tokens.to(tl.int32),
                mask=emitted & (offsets < NUM_OUTPUTS) & (columns < max_model_len),
            )
            tl.store(total_len_ptr + row, total + num_accepted + 1)
            last = tl.sum(tl.where(offsets == num_accepted, tokens, 0), 0)
            tl.store(last_sampled_ptr + row, last)


def _check_args(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_draft_slots: torch.Tensor,
    output_token_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    total_len: torch.Tensor,
    token_ids: torch.Tensor,
    last_sampled: torch.Tensor,
    step_counts: torch.Tensor | None = None,
) -> int:
    check_dtype_and_rank("idx_mapping", idx_mapping, torch.int32, 1)
    check_step_counts(step_counts, total_len.device)
    check_dtype_and_rank("query_start_loc", query_start_loc, torch.int32, 1)
    check_dtype_and_rank("num_draft_slots", num_draft_slots, torch.int32, 1)
    check_dtype_and_rank("output_token_ids", output_token_ids, torch.int64, 2)
    check_dtype_and_rank("num_accepted", num_accepted, torch.int32, 1)
    check_row_state(num_computed_tokens, total_len, token_ids, last_sampled)
    num_reqs = idx_mapping.shape[0]
    check_offsets("query_start_loc", query_start_loc, num_reqs)
    for name, tensor in (
        ("num_draft_slots", num_draft_slots),
        ("num_accepted", num_accepted),
        ("output_token_ids", output_token_ids),
    ):
        if tensor.shape[0] != num_reqs:
            raise ValueError(
                f"{name} needs one entry per scheduled request ({num_reqs}), got {tensor.shape[0]}"
            )
    device = check_same_device(
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        num_draft_slots=num_draft_slots,
        output_token_ids=output_token_ids,
        num_accepted=num_accepted,
        num_computed_tokens=num_computed_tokens,
        total_len=total_len,
        last_sampled=last_sampled,
    )
    check_token_history_device(token_ids, device)
    return num_reqs


def spec_post_update_ref(
    idx_mapping: torch.Tensor,  # [num_reqs] int32, batch position -> request row
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32
    num_draft_slots: torch.Tensor,  # [num_reqs] int32, draft slots each request ran
    output_token_ids: torch.Tensor,  # [num_reqs, K + 1] int64, emitted tokens (-1 after)
    num_accepted: torch.Tensor,  # [num_reqs] int32, accepted drafts (emits num_accepted + 1)
    num_computed_tokens: torch.Tensor,  # [max_num_reqs] int32, updated in place
    total_len: torch.Tensor,  # [max_num_reqs] int32, updated in place
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, updated in place
    last_sampled: torch.Tensor,  # [max_num_reqs] int64, updated in place
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Torch reference of `spec_post_update` (see the module doc); no host sync unless
    step_counts is given."""
    num_reqs = _check_args(
        idx_mapping,
        query_start_loc,
        num_draft_slots,
        output_token_ids,
        num_accepted,
        num_computed_tokens,
        total_len,
        token_ids,
        last_sampled,
        step_counts,
    )
    num_reqs = read_step_counts(step_counts, num_reqs, None)[0]
    if num_reqs == 0:
        return
    idx_mapping, num_draft_slots = idx_mapping[:num_reqs], num_draft_slots[:num_reqs]
    output_token_ids, num_accepted = output_token_ids[:num_reqs], num_accepted[:num_reqs]
    rows = idx_mapping.long()
    query_lens = query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]
    num_computed = num_computed_tokens[rows] + query_lens - (num_draft_slots - num_accepted)
    num_computed_tokens[rows] = num_computed
    total = total_len[rows]
    is_real = num_computed >= total
    offsets = torch.arange(output_token_ids.shape[1], device=rows.device)[None, :]
    max_model_len = token_ids.shape[1]
    # Columns past the row end are clamped onto its last column; every entry that lands
    # on a column carries that column's value, so repeated indices agree.
    columns = (total.long()[:, None] + offsets).clamp(max=max_model_len - 1)
    source = columns - total.long()[:, None]  # the output each column takes
    write = is_real[:, None] & (source >= 0) & (source <= num_accepted[:, None].long())
    values = output_token_ids.gather(1, source.clamp(min=0)).to(torch.int32)
    history_rows = rows[:, None].expand_as(columns).to(token_ids.device)
    columns = columns.to(token_ids.device)
    current = token_ids[history_rows, columns]
    token_ids[history_rows, columns] = torch.where(
        write.to(token_ids.device), values.to(token_ids.device), current
    )
    total_len[rows] = torch.where(is_real, total + num_accepted + 1, total)
    last = output_token_ids.gather(1, num_accepted.long()[:, None])[:, 0]
    last_sampled[rows] = torch.where(is_real, last, last_sampled[rows])


def spec_post_update_triton(
    idx_mapping: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32
    num_draft_slots: torch.Tensor,  # [num_reqs] int32
    output_token_ids: torch.Tensor,  # [num_reqs, K + 1] int64, rows contiguous
    num_accepted: torch.Tensor,  # [num_reqs] int32
    num_computed_tokens: torch.Tensor,  # [max_num_reqs] int32
    total_len: torch.Tensor,  # [max_num_reqs] int32
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, rows contiguous
    last_sampled: torch.Tensor,  # [max_num_reqs] int64
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Triton launcher of `spec_post_update`: one program per scheduled request (up to the
    device-side count with step_counts)."""
    need_triton("spec_post_update_triton")
    num_reqs = _check_args(
        idx_mapping,
        query_start_loc,
        num_draft_slots,
        output_token_ids,
        num_accepted,
        num_computed_tokens,
        total_len,
        token_ids,
        last_sampled,
        step_counts,
    )
    check_triton_device("spec_post_update_triton", total_len.device)
    check_contiguous_rows(
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        num_draft_slots=num_draft_slots,
        output_token_ids=output_token_ids,
        num_accepted=num_accepted,
        num_computed_tokens=num_computed_tokens,
        total_len=total_len,
        token_ids=token_ids,
        last_sampled=last_sampled,
    )
    if num_reqs == 0:
        return
    num_outputs = output_token_ids.shape[1]
    _spec_post_update_kernel[(num_reqs,)](
        idx_mapping,
        query_start_loc,
        num_draft_slots,
        output_token_ids,
        output_token_ids.stride(0),
        num_accepted,
        num_computed_tokens,
        total_len,
        token_ids,
        token_ids.stride(0),
        last_sampled,
        token_ids.shape[1],
        total_len if step_counts is None else step_counts,
        HAS_STEP_COUNTS=step_counts is not None,
        NUM_OUTPUTS=num_outputs,
        NUM_OUTPUTS_POW2=triton.next_power_of_2(num_outputs),
    )


def spec_post_update(
    idx_mapping: torch.Tensor,  # [num_reqs] int32, batch position -> request row
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1] int32
    num_draft_slots: torch.Tensor,  # [num_reqs] int32
    output_token_ids: torch.Tensor,  # [num_reqs, K + 1] int64
    num_accepted: torch.Tensor,  # [num_reqs] int32
    num_computed_tokens: torch.Tensor,  # [max_num_reqs] int32, updated in place
    total_len: torch.Tensor,  # [max_num_reqs] int32, updated in place
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, device or pinned host (UVA)
    last_sampled: torch.Tensor,  # [max_num_reqs] int64, updated in place
    step_counts: torch.Tensor | None = None,  # [2] int32 (num_reqs, num_tokens) on the device
) -> None:
    """Advance the request state after a speculative step (see the module doc)."""
    impl = spec_post_update_triton if HAS_TRITON and total_len.is_cuda else spec_post_update_ref
    impl(
        idx_mapping,
        query_start_loc,
        num_draft_slots,
        output_token_ids,
        num_accepted,
        num_computed_tokens,
        total_len,
        token_ids,
        last_sampled,
        step_counts,
    )
