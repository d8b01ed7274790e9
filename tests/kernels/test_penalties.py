"""apply_penalties: the vLLM/OpenAI formulas by hand, Triton vs reference (interpreter, CUDA),
the CPU path vs reference bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels.penalties import (
    apply_penalties,
    apply_penalties_cpu,
    apply_penalties_ref,
    apply_penalties_triton,
)
from tests.kernels._triton_interpreter import triton_vs_reference_tests


def _state(num_reqs: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(num_reqs, vocab_size, dtype=torch.bool),
        torch.zeros(num_reqs, vocab_size, dtype=torch.int32),
    )


def test_hand_computed_penalties() -> None:
    prompt_mask, output_counts = _state(2, 5)
    prompt_mask[1, 0] = True  # token 0 in the prompt
    output_counts[1, 1] = 2  # token 1 generated twice
    output_counts[1, 2] = 1  # token 2 once
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 2)
    apply_penalties(
        logits,
        torch.tensor([0, 1], dtype=torch.int32),
        repetition_penalty=torch.tensor([1.0, 2.0]),
        frequency_penalty=torch.tensor([0.0, 0.5]),
        presence_penalty=torch.tensor([0.0, 0.25]),
        prompt_mask=prompt_mask,
        output_counts=output_counts,
    )
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # neutral row untouched
    assert logits[1].tolist() == [
        2.0 / 2,  # seen in the prompt, positive: divided; no output count
        -1.0 * 2 - 0.5 * 2 - 0.25,  # seen, negative: multiplied; frequency and presence
        0.5 / 2 - 0.5 * 1 - 0.25,
        3.0,  # never seen
        -2.0,
    ]


def test_prompt_tokens_get_repetition_but_not_frequency_or_presence() -> None:
    prompt_mask, output_counts = _state(1, 3)
    prompt_mask[0, 1] = True
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    apply_penalties_ref(
        logits,
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([1.0]),
        torch.tensor([1.0]),
        torch.tensor([1.0]),
        prompt_mask,
        output_counts,
    )
    assert logits.tolist() == [[1.0, 1.0, 1.0]]


@pytest.mark.parametrize("vocab_size", [7, 1000])
def test_the_cpu_path_writes_the_reference_bits(vocab_size: int) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    num_reqs, num_rows = 12, 40
    prompt_mask = torch.rand(num_reqs, vocab_size, generator=generator) < 0.05
    output_counts = torch.randint(0, 4, (num_reqs, vocab_size), generator=generator)
    output_counts = (output_counts * (torch.rand(num_reqs, vocab_size) < 0.05)).int()
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 3
    logits[:, ::5] = 0.0
    logits[:, 1::5] = -0.0  # an unseen -0.0 stays -0.0 unless a penalty is negative
    logits[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    # neutral, repetition alone, all three, negative, -0.0 and zero presence, ...
    repetition = torch.tensor([1.0, 1.3, 0.8, 1.0, 1.0, 2.0, 1.0, 1.1, 1.0, 1.2, 1.0, 1.0])
    frequency = torch.tensor([0.0, 0.0, 0.5, -0.5, -0.0, 0.1, 0.0, 2.0, 0.3, -2.0, 0.0, 0.0])
    presence = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.0, -1.0, 0.7, 0.0, 0.0, 0.5, -0.0, 0.0])
    idx_mapping = torch.randint(0, num_reqs, (num_rows,), generator=generator, dtype=torch.int32)
    args = (idx_mapping, repetition, frequency, presence, prompt_mask, output_counts)
    expected, actual = logits.clone(), logits.clone()
    apply_penalties_ref(expected, *args)
    apply_penalties_cpu(actual, *args)
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


def test_bad_arguments_name_the_culprit() -> None:
    prompt_mask, output_counts = _state(2, 5)
    ones, zeros = torch.ones(2), torch.zeros(2)
    with pytest.raises(ValueError, match="prompt_mask must have size 4"):
        apply_penalties(
            torch.zeros(1, 4),
            torch.zeros(1, dtype=torch.int32),
            ones,
            zeros,
            zeros,
            prompt_mask,
            output_counts,
        )
    with pytest.raises(ValueError, match="frequency_penalty has 3 request rows"):
        apply_penalties(
            torch.zeros(1, 5),
            torch.zeros(1, dtype=torch.int32),
            ones,
            torch.zeros(3),
            zeros,
            prompt_mask,
            output_counts,
        )


def _compare(num_rows: int, vocab_size: int, device: str, block_size: int | None) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    num_reqs = 5
    repetition = torch.tensor([1.0, 1.3, 0.7, 1.0, 2.0]).to(device)
    frequency = torch.tensor([0.0, 0.5, -0.4, 0.0, 2.0]).to(device)
    presence = torch.tensor([0.0, 0.2, 0.0, 1.5, -2.0]).to(device)
    prompt_mask = (torch.rand(num_reqs, vocab_size, generator=generator) < 0.1).to(device)
    seen = torch.rand(num_reqs, vocab_size, generator=generator) < 0.05
    counts = torch.randint(1, 5, (num_reqs, vocab_size), generator=generator, dtype=torch.int32)
    output_counts = (counts * seen).to(torch.int32).to(device)
    idx_mapping = torch.randint(0, num_reqs, (num_rows,), generator=generator, dtype=torch.int32)
    logits = (torch.randn(num_rows, vocab_size, generator=generator) * 3).to(device)
    expected = logits.clone()
    args = (idx_mapping.to(device), repetition, frequency, presence, prompt_mask, output_counts)
    apply_penalties_ref(expected, *args)
    kwargs = {} if block_size is None else {"block_size": block_size}
    apply_penalties_triton(logits, *args, **kwargs)
    # The GPU may fuse a multiply-subtract, so allow one rounding step of difference.
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 5, "vocab_size": 300, "device": "cpu", "block_size": 128},
        on_cuda={"num_rows": 256, "vocab_size": 151936, "device": "cuda", "block_size": None},
    )
)
