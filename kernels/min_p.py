"""min-p filtering of logits, in place.

For each logit row i with p = min_p[idx_mapping[i]] > 0: every token whose probability is
below p times the most likely token's probability is masked to -inf. In logit space that
is `logit < max(logits[i]) + log(p)`, which needs no softmax. Rows with p == 0 are untouched.
Apply it after temperature, since the threshold is relative to the scaled distribution.
"""

import torch

from kernels._checks import check_logits, check_tensor, check_triton_device, need_triton
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 2048

if HAS_TRITON:

    @triton.jit
    def _min_p_kernel(
        logits_ptr,
        logits_stride,
        idx_mapping_ptr,
        min_p_ptr,
        vocab_size,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        min_p = tl.load(min_p_ptr + tl.load(idx_mapping_ptr + row))
        if min_p > 0.0:
            row_ptr = logits_ptr + row * logits_stride
            running_max = tl.full([BLOCK_SIZE], float("-inf"), tl.float32)
            for start in range(0, vocab_size, BLOCK_SIZE):
                token_ids = start + tl.arange(0, BLOCK_SIZE)
                logits = tl.load(
                    row_ptr + token_ids, mask=token_ids < vocab_size, other=float("-inf")
                )
                running_max = tl.maximum(running_max, logits)
            threshold = tl.max(running_max, 0) + tl.log(min_p)
            for start in range(0, vocab_size, BLOCK_SIZE):
                token_ids = start + tl.arange(0, BLOCK_SIZE)
                in_vocab = token_ids < vocab_size
                logits = tl.load(row_ptr + token_ids, mask=in_vocab)
                tl.store(
                    row_ptr + token_ids,
                    tl.where(logits < threshold, float("-inf"), logits),
                    mask=in_vocab,
                )


def _check_args(logits: torch.Tensor, idx_mapping: torch.Tensor, min_p: torch.Tensor) -> None:
    num_rows, _ = check_logits(logits)
    check_tensor("idx_mapping", idx_mapping, torch.int32, 1, logits.device, (num_rows,))
    check_tensor("min_p", min_p, torch.float32, 1, logits.device)


def apply_min_p_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, masked in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    min_p: torch.Tensor,  # [max_num_reqs] float32 in [0, 1]; 0 = off
) -> None:
    """Torch reference of `apply_min_p`."""
    _check_args(logits, idx_mapping, min_p)
    # log(0) = -inf gives a -inf threshold, so rows with min_p == 0 keep everything.
    threshold = logits.amax(dim=-1) + torch.log(min_p[idx_mapping.long()])
    logits.masked_fill_(logits < threshold[:, None], float("-inf"))


def apply_min_p_triton(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, masked in place
    idx_mapping: torch.Tensor,  # [num_rows] int32
    min_p: torch.Tensor,  # [max_num_reqs] float32
    block_size: int = _BLOCK_SIZE,
) -> None:
    """Triton launcher of `apply_min_p`: one program per row (a max pass, then a mask pass)."""
    need_triton("apply_min_p_triton")
    _check_args(logits, idx_mapping, min_p)
    check_triton_device("apply_min_p_triton", logits.device)
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    _min_p_kernel[(num_rows,)](
        logits, logits.stride(0), idx_mapping, min_p, vocab_size, BLOCK_SIZE=block_size, num_warps=8
    )


def apply_min_p(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, masked in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    min_p: torch.Tensor,  # [max_num_reqs] float32 in [0, 1]; 0 = off
) -> None:
    """Mask tokens less likely than min_p times the row's most likely token."""
    if HAS_TRITON and logits.is_cuda:
        apply_min_p_triton(logits, idx_mapping, min_p)
    else:
        apply_min_p_ref(logits, idx_mapping, min_p)
