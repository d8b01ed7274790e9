"""topk_logprobs: hand-computed cases, Triton vs reference (interpreter and CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.topk_logprobs import topk_logprobs, topk_logprobs_ref, topk_logprobs_triton
from tests.kernels._triton_interpreter import triton_vs_reference_tests


def test_hand_computed_logprobs_and_rank() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor([[math.log(p) + 5.0 for p in probs]])  # a shift changes nothing
    token_ids, logprobs, ranks = topk_logprobs(logits, torch.tensor([1]), num_logprobs=2)
    assert token_ids.tolist() == [[1, 3, 2]]
    torch.testing.assert_close(
        logprobs, torch.tensor([[math.log(0.2), math.log(0.4), math.log(0.3)]])
    )
    assert ranks.tolist() == [3]


def test_rank_counts_strictly_greater_logits_and_k_zero_returns_the_sampled_only() -> None:
    logits = torch.tensor([[2.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    token_ids, logprobs, ranks = topk_logprobs(logits, torch.tensor([2, 3]), num_logprobs=0)
    assert token_ids.tolist() == [[2], [3]]
    assert ranks.tolist() == [1, 1]  # a tie with the best is still rank 1
    assert logprobs[1, 0].item() == pytest.approx(math.log(0.25))


def test_bad_arguments_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="num_logprobs"):
        topk_logprobs(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64), 5)
    with pytest.raises(ValueError, match="sampled_token_ids must be torch.int64"):
        topk_logprobs(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int32), 1)


def _compare(num_rows: int, vocab_size: int, device: str, block_size: int | None) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    logits = (torch.randn(num_rows, vocab_size, generator=generator) * 4).to(device)
    logits[0, : vocab_size // 2] = float("-inf")  # masked logits must not poison the sum
    sampled = torch.randint(vocab_size // 2, vocab_size, (num_rows,), generator=generator).to(
        device
    )
    kwargs = {} if block_size is None else {"block_size": block_size}
    for num_logprobs in (0, 5, 20):
        expected = topk_logprobs_ref(logits, sampled, num_logprobs)
        actual = topk_logprobs_triton(logits, sampled, num_logprobs, **kwargs)
        assert torch.equal(actual[0], expected[0])
        torch.testing.assert_close(actual[1], expected[1], rtol=1e-5, atol=1e-5)
        assert torch.equal(actual[2], expected[2])


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 4, "vocab_size": 300, "device": "cpu", "block_size": 128},
        on_cuda={"num_rows": 256, "vocab_size": 151936, "device": "cuda", "block_size": None},
    )
)
