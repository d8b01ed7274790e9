"""Grammar token bitmask applied to logits rows, in place.

For each masked row i (a request with a grammar this step), with logit row r = row_indices[i]:

    for every token t < vocab_size:
        if bit (t % 32) of bitmask[i, t // 32] is 0:  logits[r, t] = -inf

The bitmask is the packed int32 layout grammar libraries fill (one bit per token, bit set =
allowed, little-endian within a word), so a row comes straight from the matcher without
unpacking on the host. Rows not listed in `row_indices` are untouched: requests without a
grammar share the batch and pay nothing. Tokens beyond 32 * num_words (a model vocabulary
padded past the tokenizer's) are forbidden, since no grammar can accept them.
"""

import torch

from kernels._checks import (
    check_contiguous_rows,
    check_dtype_and_rank,
    check_tensor,
    check_triton_device,
    need_triton,
)
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 1024
"""Tokens per program; a multiple of 32, so each program reads whole bitmask words."""

if HAS_TRITON:

    @triton.jit
    def _token_bitmask_kernel(
        logits_ptr,
        logits_stride,
        bitmask_ptr,
        bitmask_stride,
        row_indices_ptr,
        vocab_size,
        num_words,
        BLOCK_SIZE: tl.constexpr,
    ):
        masked_row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        logit_row = tl.load(row_indices_ptr + masked_row).to(tl.int64)
        tokens = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        words = tokens // 32
        packed = tl.load(
            bitmask_ptr + masked_row * bitmask_stride + words, mask=words < num_words, other=0
        )
        is_allowed = ((packed >> (tokens % 32)) & 1) == 1
        tl.store(
            logits_ptr + logit_row * logits_stride + tokens,
            tl.full([BLOCK_SIZE], float("-inf"), tl.float32),
            mask=(tokens < vocab_size) & ~is_allowed,
        )


def _check_args(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
    check_dtype_and_rank("logits", logits, torch.float32, 2)
    check_contiguous_rows(logits=logits)
    device = logits.device
    check_tensor("bitmask", bitmask, torch.int32, 2, device)
    check_tensor("row_indices", row_indices, torch.int32, 1, device, (bitmask.shape[0],))


def apply_token_bitmask_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, updated in place
    bitmask: torch.Tensor,  # [num_masked, num_words] int32, bit set = token allowed
    row_indices: torch.Tensor,  # [num_masked] int32, masked row -> logits row
) -> None:
    """Torch reference of `apply_token_bitmask`."""
    _check_args(logits, bitmask, row_indices)
    vocab_size = logits.shape[1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [num_masked, 32 * words]
    if allowed.shape[1] < vocab_size:
        padding = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
        allowed = torch.cat([allowed, padding], dim=1)
    rows = row_indices.long()
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab_size], float("-inf"))


def apply_token_bitmask_triton(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, updated in place
    bitmask: torch.Tensor,  # [num_masked, num_words] int32
    row_indices: torch.Tensor,  # [num_masked] int32
) -> None:
    """Triton launcher of `apply_token_bitmask`: one program per (masked row, token block)."""
    need_triton("apply_token_bitmask_triton")
    _check_args(logits, bitmask, row_indices)
    check_triton_device("apply_token_bitmask_triton", logits.device)
    num_masked = bitmask.shape[0]
    vocab_size = logits.shape[1]
    if num_masked == 0 or vocab_size == 0:
        return
    grid = (num_masked, triton.cdiv(vocab_size, _BLOCK_SIZE))
    _token_bitmask_kernel[grid](
        logits,
        logits.stride(0),
        bitmask,
        bitmask.stride(0),
        row_indices,
        vocab_size,
        bitmask.shape[1],
        BLOCK_SIZE=_BLOCK_SIZE,
    )


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, updated in place
    bitmask: torch.Tensor,  # [num_masked, num_words] int32, bit set = token allowed
    row_indices: torch.Tensor,  # [num_masked] int32, distinct logits rows
) -> None:
    """Forbid (-inf) every token whose bit is clear, in the listed logits rows only."""
    impl = apply_token_bitmask_triton if HAS_TRITON and logits.is_cuda else apply_token_bitmask_ref
    impl(logits, bitmask, row_indices)
