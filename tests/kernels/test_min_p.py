"""apply_min_p: hand-computed cases, Triton vs reference (interpreter and CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.min_p import apply_min_p, apply_min_p_ref, apply_min_p_triton
from tests.kernels._triton_interpreter import triton_vs_reference_tests

NEG_INF = float("-inf")


def test_tokens_below_min_p_times_the_top_probability_are_masked() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]
    logits = torch.tensor([[math.log(p) + 1.0 for p in probs]] * 3)  # offset: min-p is shift-free
    min_p = torch.tensor([0.2, 0.0, 0.7])
    apply_min_p(logits, torch.tensor([0, 1, 2], dtype=torch.int32), min_p)
    # 0.2 * 0.5 = 0.1: only 0.05 goes; 0.7 * 0.5 = 0.35: only 0.5 stays; 0: all stay.
    assert torch.isinf(logits[0]).tolist() == [True, False, False, False]
    assert not torch.isinf(logits[1]).any()
    assert torch.isinf(logits[2]).tolist() == [True, False, True, True]
    assert logits[0, 1] == pytest.approx(math.log(0.5) + 1.0)


def test_min_p_one_keeps_only_the_maximum() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 2.9]])
    apply_min_p_ref(logits, torch.tensor([0], dtype=torch.int32), torch.tensor([1.0]))
    assert logits.tolist() == [[NEG_INF, 3.0, 3.0, NEG_INF]]


def test_bad_arguments_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="min_p must be torch.float32"):
        apply_min_p(
            torch.zeros(1, 4),
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.float64),
        )


def _compare(num_rows: int, vocab_size: int, device: str, block_size: int | None) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    min_p = torch.tensor([0.0, 0.05, 0.3, 1e-4, 0.9]).to(device)
    idx_mapping = torch.randint(0, 5, (num_rows,), generator=generator, dtype=torch.int32).to(
        device
    )
    logits = (torch.randn(num_rows, vocab_size, generator=generator) * 4).to(device)
    expected = logits.clone()
    apply_min_p_ref(expected, idx_mapping, min_p)
    kwargs = {} if block_size is None else {"block_size": block_size}
    apply_min_p_triton(logits, idx_mapping, min_p, **kwargs)
    assert torch.equal(logits, expected)


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 5, "vocab_size": 300, "device": "cpu", "block_size": 128},
        on_cuda={"num_rows": 256, "vocab_size": 151936, "device": "cuda", "block_size": None},
    )
)
