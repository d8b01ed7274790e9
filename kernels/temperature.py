"""Temperature scaling of logits, in place.

For each logit row i with request row r = idx_mapping[i] and t = temperature[r]:
logits[i, :] /= t, except that t == 0 (greedy) and t == 1 leave the row untouched.
The division is correctly rounded in both implementations, so they agree bit for bit.
"""

import torch

from kernels._checks import check_logits, check_tensor, check_triton_device, need_triton
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 4096

if HAS_TRITON:

    @triton.jit
    def _temperature_kernel(
        logits_ptr,
        logits_stride,
        idx_mapping_ptr,
        temperature_ptr,
        vocab_size,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        temperature = tl.load(temperature_ptr + tl.load(idx_mapping_ptr + row))
        if (temperature != 0.0) & (temperature != 1.0):
            token_ids = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            in_vocab = token_ids < vocab_size
            ptrs = logits_ptr + row * logits_stride + token_ids
            logits = tl.load(ptrs, mask=in_vocab)
            tl.store(ptrs, tl.math.div_rn(logits, temperature), mask=in_vocab)


def _check_args(logits: torch.Tensor, idx_mapping: torch.Tensor, temperature: torch.Tensor) -> None:
    num_rows, _ = check_logits(logits)
    check_tensor("idx_mapping", idx_mapping, torch.int32, 1, logits.device, (num_rows,))
    check_tensor("temperature", temperature, torch.float32, 1, logits.device)


def apply_temperature_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, scaled in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32; 0 = greedy
) -> None:
    """Torch reference of `apply_temperature`."""
    _check_args(logits, idx_mapping, temperature)
    row_temperature = temperature[idx_mapping.long()]
    is_untouched = (row_temperature == 0.0) | (row_temperature == 1.0)
    logits.div_(torch.where(is_untouched, 1.0, row_temperature)[:, None])


def apply_temperature_triton(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, scaled in place
    idx_mapping: torch.Tensor,  # [num_rows] int32
    temperature: torch.Tensor,  # [max_num_reqs] float32
    block_size: int = _BLOCK_SIZE,
) -> None:
    """Triton launcher of `apply_temperature`: one program per (row, vocab block)."""
    need_triton("apply_temperature_triton")
    _check_args(logits, idx_mapping, temperature)
    check_triton_device("apply_temperature_triton", logits.device)
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab_size, block_size))
    _temperature_kernel[grid](
        logits, logits.stride(0), idx_mapping, temperature, vocab_size, BLOCK_SIZE=block_size
    )


def apply_temperature(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, scaled in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32; 0 = greedy
) -> None:
    """Divide each row by its request's temperature (rows with 0 or 1 are left as they are)."""
    if HAS_TRITON and logits.is_cuda:
        apply_temperature_triton(logits, idx_mapping, temperature)
    else:
        apply_temperature_ref(logits, idx_mapping, temperature)
