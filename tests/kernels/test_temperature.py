"""apply_temperature: hand-computed cases, Triton vs reference (interpreter and CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels.temperature import (
    apply_temperature,
    apply_temperature_ref,
    apply_temperature_triton,
)
from tests.kernels._triton_interpreter import triton_vs_reference_tests

# Request rows: 0 -> T 0.5, 1 -> greedy, 2 -> T 1, 3 -> T 2.
TEMPERATURE = torch.tensor([0.5, 0.0, 1.0, 2.0])


def test_rows_are_divided_by_their_request_temperature() -> None:
    logits = torch.tensor([[2.0, -4.0, 1.0]] * 5)
    idx_mapping = torch.tensor([3, 0, 1, 2, 0], dtype=torch.int32)
    apply_temperature(logits, idx_mapping, TEMPERATURE)
    expected = torch.tensor(
        [
            [1.0, -2.0, 0.5],  # T 2
            [4.0, -8.0, 2.0],  # T 0.5
            [2.0, -4.0, 1.0],  # greedy: untouched
            [2.0, -4.0, 1.0],  # T 1: untouched
            [4.0, -8.0, 2.0],
        ]
    )
    assert torch.equal(logits, expected)


def test_division_is_correctly_rounded() -> None:
    logits = torch.randn(3, 50)
    original = logits.clone()
    apply_temperature_ref(logits, torch.tensor([0, 3, 0], dtype=torch.int32), TEMPERATURE)
    assert torch.equal(logits[1], original[1] / 2.0)
    assert torch.equal(logits[0], original[0] / 0.5)


def test_bad_arguments_name_the_culprit() -> None:
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="idx_mapping must be torch.int32"):
        apply_temperature(logits, torch.zeros(2, dtype=torch.int64), TEMPERATURE)
    with pytest.raises(ValueError, match="idx_mapping must have size 2"):
        apply_temperature(logits, torch.zeros(3, dtype=torch.int32), TEMPERATURE)
    with pytest.raises(ValueError, match="logits must be torch.float32"):
        apply_temperature(logits.half(), torch.zeros(2, dtype=torch.int32), TEMPERATURE)


def _compare(num_rows: int, vocab_size: int, device: str, block_size: int | None) -> None:
    generator = torch.Generator().manual_seed(num_rows + vocab_size)
    temperature = torch.tensor([0.0, 1.0, 0.3, 0.7, 1.9, 1e-3]).to(device)
    idx_mapping = torch.randint(0, 6, (num_rows,), generator=generator, dtype=torch.int32).to(
        device
    )
    logits = (torch.randn(num_rows, vocab_size, generator=generator) * 5).to(device)
    expected = logits.clone()
    apply_temperature_ref(expected, idx_mapping, temperature)
    kwargs = {} if block_size is None else {"block_size": block_size}
    apply_temperature_triton(logits, idx_mapping, temperature, **kwargs)
    assert torch.equal(logits, expected)


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 5, "vocab_size": 300, "device": "cpu", "block_size": 128},
        on_cuda={"num_rows": 256, "vocab_size": 151936, "device": "cuda", "block_size": None},
    )
)
