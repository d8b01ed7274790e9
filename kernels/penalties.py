"""Repetition, frequency and presence penalties, in place (the vLLM / OpenAI definitions).

For each logit row i with request row r = idx_mapping[i], counts = output_counts[r]
(how often each token was generated so far) and seen = prompt_mask[r] | (counts > 0):

    logits[seen & (logits > 0)] /= repetition_penalty[r]
    logits[seen & (logits <= 0)] *= repetition_penalty[r]
    logits -= frequency_penalty[r] * counts + presence_penalty[r] * (counts > 0)

Rows whose penalties are neutral (1, 0, 0) are left untouched.
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

_BLOCK_SIZE = 2048

if HAS_TRITON:

    @triton.jit
    def _penalties_kernel(
        logits_ptr,
        logits_stride,
        idx_mapping_ptr,
        repetition_penalty_ptr,
        frequency_penalty_ptr,
        presence_penalty_ptr,
        prompt_mask_ptr,
        output_counts_ptr,
        vocab_size,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        req = tl.load(idx_mapping_ptr + row).to(tl.int64)
        repetition = tl.load(repetition_penalty_ptr + req)
        frequency = tl.load(frequency_penalty_ptr + req)
        presence = tl.load(presence_penalty_ptr + req)
        if (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0):
            token_ids = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            in_vocab = token_ids < vocab_size
            ptrs = logits_ptr + row * logits_stride + token_ids
            logits = tl.load(ptrs, mask=in_vocab)
            counts = tl.load(
                output_counts_ptr + req * vocab_size + token_ids, mask=in_vocab, other=0
            )
            in_prompt = tl.load(
                prompt_mask_ptr + req * vocab_size + token_ids, mask=in_vocab, other=0
            )
            was_generated = counts > 0
            is_seen = (in_prompt != 0) | was_generated
            repeated = tl.where(
                logits > 0.0, tl.math.div_rn(logits, repetition), logits * repetition
            )
            logits = tl.where(is_seen, repeated, logits)
            logits = (
                logits - frequency * counts.to(tl.float32) - presence * was_generated.to(tl.float32)
            )
            tl.store(ptrs, logits, mask=in_vocab)


def _check_args(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
) -> None:
    num_rows, vocab_size = check_logits(logits)
    device = logits.device
    check_tensor("idx_mapping", idx_mapping, torch.int32, 1, device, (num_rows,))
    check_tensor("prompt_mask", prompt_mask, torch.bool, 2, device, (None, vocab_size))
    check_tensor("output_counts", output_counts, torch.int32, 2, device, (None, vocab_size))
    num_reqs = prompt_mask.shape[0]
    check_same_num_rows("output_counts", output_counts, num_reqs)
    for name, tensor in (
        ("repetition_penalty", repetition_penalty),
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
    ):
        check_tensor(name, tensor, torch.float32, 1, device)
        check_same_num_rows(name, tensor, num_reqs)


def apply_penalties_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, penalised in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    repetition_penalty: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    frequency_penalty: torch.Tensor,  # [max_num_reqs] float32, 0 = off
    presence_penalty: torch.Tensor,  # [max_num_reqs] float32, 0 = off
    prompt_mask: torch.Tensor,  # [max_num_reqs, vocab_size] bool, token occurs in the prompt
    output_counts: torch.Tensor,  # [max_num_reqs, vocab_size] int32, times generated so far
) -> None:
    """Torch reference of `apply_penalties`."""
    _check_args(
        logits,
        idx_mapping,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        prompt_mask,
        output_counts,
    )
    rows = idx_mapping.long()
    repetition = repetition_penalty[rows][:, None]
    counts = output_counts[rows]
    was_generated = counts > 0
    is_seen = prompt_mask[rows] | was_generated
    repeated = torch.where(logits > 0.0, logits / repetition, logits * repetition)
    penalised = torch.where(is_seen, repeated, logits)
    penalised = (
        penalised
        - frequency_penalty[rows][:, None] * counts.float()
        - presence_penalty[rows][:, None] * was_generated.float()
    )
    logits.copy_(penalised)


def apply_penalties_cpu(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, penalised in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    repetition_penalty: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    frequency_penalty: torch.Tensor,  # [max_num_reqs] float32, 0 = off
    presence_penalty: torch.Tensor,  # [max_num_reqs] float32, 0 = off
    prompt_mask: torch.Tensor,  # [max_num_reqs, vocab_size] bool, token occurs in the prompt
    output_counts: torch.Tensor,  # [max_num_reqs, vocab_size] int32, times generated so far
) -> None:
    """`apply_penalties_ref`'s logits, bit for bit, writing only the tokens it changes: the
    seen ones (in the prompt or generated). An unseen token's logit x becomes
    x - frequency * 0 - presence * 0, which is x unless a penalty's sign bit is set (then
    -0.0 turns into +0.0): such rows take the reference's dense ops, neutral rows none."""
    _check_args(
        logits,
        idx_mapping,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        prompt_mask,
        output_counts,
    )
    rows = idx_mapping.long()
    repetition, frequency = repetition_penalty[rows], frequency_penalty[rows]
    presence = presence_penalty[rows]
    signed = torch.signbit(frequency) | torch.signbit(presence)
    neutral = (repetition == 1.0) & (frequency == 0.0) & (presence == 0.0) & ~signed
    dense = signed.nonzero().squeeze(1)
    if dense.numel():
        penalised = logits.index_select(0, dense)
        apply_penalties_ref(
            penalised,
            idx_mapping.index_select(0, dense),
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            prompt_mask,
            output_counts,
        )
        logits.index_copy_(0, dense, penalised)
    sparse = (~neutral & ~signed).nonzero().squeeze(1)
    if sparse.numel() == 0:
        return
    reqs = rows.index_select(0, sparse)
    is_seen = prompt_mask.index_select(0, reqs) | (output_counts.index_select(0, reqs) > 0)
    at, token_ids = is_seen.nonzero(as_tuple=True)
    logit_rows = sparse.index_select(0, at)
    counts = output_counts[reqs.index_select(0, at), token_ids]
    seen = logits[logit_rows, token_ids]
    row_repetition = repetition.index_select(0, logit_rows)
    repeated = torch.where(seen > 0.0, seen / row_repetition, seen * row_repetition)
    logits[logit_rows, token_ids] = (
        repeated
        - frequency.index_select(0, logit_rows) * counts.float()
        - presence.index_select(0, logit_rows) * (counts > 0).float()
    )


def apply_penalties_triton(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, penalised in place
    idx_mapping: torch.Tensor,  # [num_rows] int32
    repetition_penalty: torch.Tensor,  # [max_num_reqs] float32
    frequency_penalty: torch.Tensor,  # [max_num_reqs] float32
    presence_penalty: torch.Tensor,  # [max_num_reqs] float32
    prompt_mask: torch.Tensor,  # [max_num_reqs, vocab_size] bool
    output_counts: torch.Tensor,  # [max_num_reqs, vocab_size] int32
    block_size: int = _BLOCK_SIZE,
) -> None:
    """Triton launcher of `apply_penalties`: one program per (row, vocab block)."""
    need_triton("apply_penalties_triton")
    _check_args(
        logits,
        idx_mapping,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        prompt_mask,
        output_counts,
    )
    check_triton_device("apply_penalties_triton", logits.device)
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab_size, block_size))
    _penalties_kernel[grid](
        logits,
        logits.stride(0),
        idx_mapping,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        prompt_mask,
        output_counts,
        vocab_size,
        BLOCK_SIZE=block_size,
    )


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, penalised in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    repetition_penalty: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    frequency_penalty: torch.Tensor,  # [max_num_reqs] float32, 0 = off
    presence_penalty: torch.Tensor,  # [max_num_reqs] float32, 0 = off
    prompt_mask: torch.Tensor,  # [max_num_reqs, vocab_size] bool, token occurs in the prompt
    output_counts: torch.Tensor,  # [max_num_reqs, vocab_size] int32, times generated so far
) -> None:
    """Apply the repetition, frequency and presence penalties (see the module doc)."""
    impl = apply_penalties_ref
    if HAS_TRITON and logits.is_cuda:
        impl = apply_penalties_triton
    elif logits.device.type == "cpu":
        impl = apply_penalties_cpu
    impl(
        logits,
        idx_mapping,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        prompt_mask,
        output_counts,
    )
