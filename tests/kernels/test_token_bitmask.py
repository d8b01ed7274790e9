"""apply_token_bitmask: packed grammar masks by hand, Triton vs reference."""

from __future__ import annotations

import pytest
import torch

from kernels.token_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_ref,
    apply_token_bitmask_triton,
)
from tests.kernels._triton_interpreter import triton_vs_reference_tests

NEG_INF = float("-inf")


def _pack(allowed: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Rows of allowed token ids -> the packed int32 bitmask (bit t % 32 of word t // 32)."""
    num_words = (vocab_size + 31) // 32
    words = torch.zeros(len(allowed), num_words, dtype=torch.int64)
    for row, token_ids in enumerate(allowed):
        for token_id in token_ids:
            words[row, token_id // 32] |= 1 << (token_id % 32)
    # Bit 31 set makes a negative int32, as the grammar libraries write it.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_only_listed_rows_are_masked_and_only_cleared_bits() -> None:
    logits = torch.zeros(3, 40)
    bitmask = _pack([[0, 31, 32, 39], [5]], 40)
    apply_token_bitmask(logits, bitmask, torch.tensor([2, 0], dtype=torch.int32))
    assert torch.isinf(logits[0]).sum() == 39 and logits[0, 5] == 0.0
    assert not torch.isinf(logits[1]).any()  # a request without a grammar
    assert [t for t in range(40) if logits[2, t] == 0.0] == [0, 31, 32, 39]


def test_tokens_past_the_bitmask_are_forbidden() -> None:
    logits = torch.zeros(1, 70)  # model vocabulary padded past a 64-token tokenizer
    apply_token_bitmask_ref(
        logits, _pack([list(range(64))], 64), torch.tensor([0], dtype=torch.int32)
    )
    assert not torch.isinf(logits[0, :64]).any() and torch.isinf(logits[0, 64:]).all()


def test_bad_arguments_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="bitmask must be torch.int32"):
        apply_token_bitmask(
            torch.zeros(1, 8),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.tensor([0], dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="row_indices must have size 2 in dim 0"):
        apply_token_bitmask(
            torch.zeros(2, 8),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
        )


def _compare(num_rows: int, vocab_size: int, device: str) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    num_words = (vocab_size + 31) // 32
    bitmask = (
        torch.randint(
            -(2**31), 2**31, (num_rows // 2, num_words), generator=generator, dtype=torch.int64
        )
        .to(torch.int32)
        .to(device)
    )
    row_indices = torch.randperm(num_rows, generator=generator)[: num_rows // 2]
    row_indices = row_indices.to(torch.int32).to(device)
    logits = torch.randn(num_rows, vocab_size, generator=generator).to(device)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, row_indices)
    apply_token_bitmask_triton(logits, bitmask, row_indices)
    assert torch.equal(logits, expected)
    assert torch.isinf(expected).any() and not torch.isinf(expected).all()


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 6, "vocab_size": 2100, "device": "cpu"},
        on_cuda={"num_rows": 256, "vocab_size": 151936, "device": "cuda"},
    )
)
