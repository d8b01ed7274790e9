"""Logit bias and min_tokens suppression of stop tokens, in place.

For each logit row i with request row r = idx_mapping[i]:

    for j < num_logit_bias[r]:  logits[i, logit_bias_token_ids[r, j]] += logit_bias_values[r, j]
    if num_output_tokens[i] < min_tokens[r]:
        for j < num_stop_token_ids[r]:  logits[i, stop_token_ids[r, j]] = -inf

The bias comes first, so a positive bias cannot revive a suppressed stop token. A row's
bias token ids must be distinct (duplicates would race in the kernel); stop ids may repeat.
"""

import torch

from kernels._checks import (
    check_logits,
    check_same_num_rows,
    check_tensor,
    check_triton_device,
    need_triton,
)
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 32

if HAS_TRITON:

    @triton.jit
    def _logit_bias_kernel(
        logits_ptr,
        logits_stride,
        idx_mapping_ptr,
        num_output_tokens_ptr,
        num_logit_bias_ptr,
        logit_bias_token_ids_ptr,
        logit_bias_values_ptr,
        logit_bias_stride,
        min_tokens_ptr,
        num_stop_token_ids_ptr,
        stop_token_ids_ptr,
        stop_token_ids_stride,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        req = tl.load(idx_mapping_ptr + row).to(tl.int64)
        row_ptr = logits_ptr + row * logits_stride
        num_bias = tl.load(num_logit_bias_ptr + req)
        for start in range(0, num_bias, BLOCK_SIZE):
            entries = start + tl.arange(0, BLOCK_SIZE)
            is_entry = entries < num_bias
            token_ids = tl.load(
                logit_bias_token_ids_ptr + req * logit_bias_stride + entries, mask=is_entry, other=0
            )
            bias = tl.load(
                logit_bias_values_ptr + req * logit_bias_stride + entries, mask=is_entry, other=0.0
            )
            logits = tl.load(row_ptr + token_ids, mask=is_entry)
            tl.store(row_ptr + token_ids, logits + bias, mask=is_entry)
        # Makes the bias writes visible to every thread before a stop id may overwrite one.
        tl.debug_barrier()
        if tl.load(num_output_tokens_ptr + row) < tl.load(min_tokens_ptr + req):
            num_stop = tl.load(num_stop_token_ids_ptr + req)
            for start in range(0, num_stop, BLOCK_SIZE):
                entries = start + tl.arange(0, BLOCK_SIZE)
                is_entry = entries < num_stop
                token_ids = tl.load(
                    stop_token_ids_ptr + req * stop_token_ids_stride + entries,
                    mask=is_entry,
                    other=0,
                )
                tl.store(
                    row_ptr + token_ids,
                    tl.full([BLOCK_SIZE], float("-inf"), tl.float32),
                    mask=is_entry,
                )


def _check_args(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_output_tokens: torch.Tensor,
    num_logit_bias: torch.Tensor,
    logit_bias_token_ids: torch.Tensor,
    logit_bias_values: torch.Tensor,
    min_tokens: torch.Tensor,
    num_stop_token_ids: torch.Tensor,
    stop_token_ids: torch.Tensor,
) -> None:
    num_rows, _ = check_logits(logits)
    device = logits.device
    check_tensor("idx_mapping", idx_mapping, torch.int32, 1, device, (num_rows,))
    check_tensor("num_output_tokens", num_output_tokens, torch.int32, 1, device, (num_rows,))
    check_tensor("logit_bias_token_ids", logit_bias_token_ids, torch.int32, 2, device)
    num_reqs, bias_width = logit_bias_token_ids.shape
    check_tensor(
        "logit_bias_values", logit_bias_values, torch.float32, 2, device, (num_reqs, bias_width)
    )
    check_tensor("stop_token_ids", stop_token_ids, torch.int32, 2, device, (num_reqs, None))
    for name, tensor in (
        ("num_logit_bias", num_logit_bias),
        ("min_tokens", min_tokens),
        ("num_stop_token_ids", num_stop_token_ids),
    ):
        check_tensor(name, tensor, torch.int32, 1, device)
        check_same_num_rows(name, tensor, num_reqs)


def apply_logit_bias_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, updated in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    num_output_tokens: torch.Tensor,  # [num_rows] int32, tokens generated so far
    num_logit_bias: torch.Tensor,  # [max_num_reqs] int32, entries used per row
    logit_bias_token_ids: torch.Tensor,  # [max_num_reqs, bias_width] int32
    logit_bias_values: torch.Tensor,  # [max_num_reqs, bias_width] float32
    min_tokens: torch.Tensor,  # [max_num_reqs] int32
    num_stop_token_ids: torch.Tensor,  # [max_num_reqs] int32, entries used per row
    stop_token_ids: torch.Tensor,  # [max_num_reqs, stop_width] int32, EOS and stop ids
) -> None:
    """Torch reference of `apply_logit_bias`."""
    _check_args(
        logits,
        idx_mapping,
        num_output_tokens,
        num_logit_bias,
        logit_bias_token_ids,
        logit_bias_values,
        min_tokens,
        num_stop_token_ids,
        stop_token_ids,
    )
    rows = idx_mapping.long()
    batch_rows = torch.arange(logits.shape[0], device=logits.device)[:, None]

    bias_entries = torch.arange(logit_bias_token_ids.shape[1], device=logits.device)
    is_bias = bias_entries[None, :] < num_logit_bias[rows][:, None]
    bias_token_ids = logit_bias_token_ids[rows].long()
    logits.index_put_(
        (batch_rows.expand_as(bias_token_ids)[is_bias], bias_token_ids[is_bias]),
        logit_bias_values[rows][is_bias],
        accumulate=True,
    )

    stop_entries = torch.arange(stop_token_ids.shape[1], device=logits.device)
    is_suppressing = num_output_tokens < min_tokens[rows]
    is_stop = (stop_entries[None, :] < num_stop_token_ids[rows][:, None]) & is_suppressing[:, None]
    row_stop_ids = stop_token_ids[rows].long()
    logits[batch_rows.expand_as(row_stop_ids)[is_stop], row_stop_ids[is_stop]] = float("-inf")


def apply_logit_bias_triton(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, updated in place
    idx_mapping: torch.Tensor,  # [num_rows] int32
    num_output_tokens: torch.Tensor,  # [num_rows] int32
    num_logit_bias: torch.Tensor,  # [max_num_reqs] int32
    logit_bias_token_ids: torch.Tensor,  # [max_num_reqs, bias_width] int32
    logit_bias_values: torch.Tensor,  # [max_num_reqs, bias_width] float32
    min_tokens: torch.Tensor,  # [max_num_reqs] int32
    num_stop_token_ids: torch.Tensor,  # [max_num_reqs] int32
    stop_token_ids: torch.Tensor,  # [max_num_reqs, stop_width] int32
) -> None:
    """Triton launcher of `apply_logit_bias`: one program per logit row."""
    need_triton("apply_logit_bias_triton")
    _check_args(
        logits,
        idx_mapping,
        num_output_tokens,
        num_logit_bias,
        logit_bias_token_ids,
        logit_bias_values,
        min_tokens,
        num_stop_token_ids,
        stop_token_ids,
    )
    check_triton_device("apply_logit_bias_triton", logits.device)
    if logits.shape[0] == 0:
        return
    _logit_bias_kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        idx_mapping,
        num_output_tokens,
        num_logit_bias,
        logit_bias_token_ids,
        logit_bias_values,
        logit_bias_token_ids.stride(0),
        min_tokens,
        num_stop_token_ids,
        stop_token_ids,
        stop_token_ids.stride(0),
        BLOCK_SIZE=_BLOCK_SIZE,
    )


def apply_logit_bias(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, updated in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    num_output_tokens: torch.Tensor,  # [num_rows] int32, tokens generated so far
    num_logit_bias: torch.Tensor,  # [max_num_reqs] int32, entries used per row
    logit_bias_token_ids: torch.Tensor,  # [max_num_reqs, bias_width] int32, distinct per row
    logit_bias_values: torch.Tensor,  # [max_num_reqs, bias_width] float32
    min_tokens: torch.Tensor,  # [max_num_reqs] int32
    num_stop_token_ids: torch.Tensor,  # [max_num_reqs] int32, entries used per row
    stop_token_ids: torch.Tensor,  # [max_num_reqs, stop_width] int32, EOS and stop ids
) -> None:
    """Add each row's logit bias, then forbid its stop tokens until min_tokens are out."""
    impl = apply_logit_bias_triton if HAS_TRITON and logits.is_cuda else apply_logit_bias_ref
    impl(
        logits,
        idx_mapping,
        num_output_tokens,
        num_logit_bias,
        logit_bias_token_ids,
        logit_bias_values,
        min_tokens,
        num_stop_token_ids,
        stop_token_ids,
    )
