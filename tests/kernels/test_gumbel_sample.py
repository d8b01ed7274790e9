"""gumbel_sample: the noise against a Python-integer oracle, its statistics, greedy rows,
and Triton vs reference (interpreter and CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.gumbel_sample import (
    gumbel_noise_ref,
    gumbel_sample,
    gumbel_sample_ref,
    gumbel_sample_triton,
)
from tests.kernels._triton_interpreter import triton_vs_reference_tests

MASK32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _oracle_noise(seed: int, position: int, token_id: int) -> float:
    """The documented noise, computed with unbounded Python integers and float64."""
    seed, position = seed % 2**64, position % 2**64
    key = _lowbias32((seed & MASK32) ^ 0x6A09E667)
    key = _lowbias32(key ^ (seed >> 32))
    key = _lowbias32(key ^ (position & MASK32))
    key = _lowbias32(key ^ (position >> 32))
    hashed = _lowbias32(key ^ ((token_id * 0x9E3779B9) & MASK32))
    uniform = ((hashed >> 9) + 0.5) / 2**23
    return -math.log(-math.log(uniform))


def test_noise_matches_the_integer_oracle() -> None:
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789123]
    positions = [0, 7, 2**31, 2**32 + 5, 2**40, 99]
    noise = gumbel_noise_ref(torch.tensor(seeds), torch.tensor(positions), vocab_size=300)
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        for token_id in (0, 1, 2, 150, 299):
            assert noise[row, token_id].item() == pytest.approx(
                _oracle_noise(seed, position, token_id), rel=1e-5, abs=1e-5
            )


def test_noise_has_gumbel_statistics() -> None:
    seeds = torch.arange(64, dtype=torch.int64) * 1_000_003
    positions = torch.arange(64, dtype=torch.int64) % 7
    noise = gumbel_noise_ref(seeds, positions, vocab_size=2000).double()
    assert noise.mean().item() == pytest.approx(0.5772156649, abs=0.01)  # Euler-Mascheroni
    assert noise.std().item() == pytest.approx(math.pi / math.sqrt(6), abs=0.01)
    neighbours = torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))
    assert abs(neighbours[0, 1].item()) < 0.01
    assert torch.isfinite(noise).all()


def test_noise_changes_with_seed_and_position() -> None:
    base = gumbel_noise_ref(torch.tensor([5]), torch.tensor([10]), 100)
    assert torch.equal(base, gumbel_noise_ref(torch.tensor([5]), torch.tensor([10]), 100))
    assert not torch.equal(base, gumbel_noise_ref(torch.tensor([6]), torch.tensor([10]), 100))
    assert not torch.equal(base, gumbel_noise_ref(torch.tensor([5]), torch.tensor([11]), 100))
    assert not torch.equal(
        base, gumbel_noise_ref(torch.tensor([5]), torch.tensor([10 + 2**32]), 100)
    )


def test_greedy_rows_take_the_first_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 0.0, 0.0]])
    sampled = gumbel_sample(
        logits,
        torch.tensor([0, 0], dtype=torch.int32),
        torch.tensor([0.0]),
        torch.tensor([1]),
        torch.tensor([0, 1]),
    )
    assert sampled.tolist() == [1, 0]


def test_a_large_gap_beats_any_noise_and_temperature_is_applied_on_request() -> None:
    # Noise lies in [-log(-log(2**-24)), -log(-log(1 - 2**-24))] ~ [-2.9, 16.6].
    logits = torch.zeros(400, 50)
    logits[:, 7] = 1.0
    idx_mapping = torch.zeros(400, dtype=torch.int32)
    temperature, seed, positions = torch.tensor([0.04]), torch.tensor([3]), torch.arange(400)
    scaled = gumbel_sample(
        logits, idx_mapping, temperature, seed, positions, apply_temperature=True
    )
    assert (scaled == 7).all()  # a gap of 1 / 0.04 = 25
    unscaled = gumbel_sample(
        logits, idx_mapping, temperature, seed, positions, apply_temperature=False
    )
    assert len(set(unscaled.tolist())) > 10


def test_bad_arguments_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="seed must be torch.int64"):
        gumbel_sample(
            torch.zeros(1, 4),
            torch.zeros(1, dtype=torch.int32),
            torch.ones(1),
            torch.ones(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match="positions must have size 1"):
        gumbel_sample(
            torch.zeros(1, 4),
            torch.zeros(1, dtype=torch.int32),
            torch.ones(1),
            torch.ones(1, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
        )


def _compare(num_rows: int, vocab_size: int, device: str, block_size: int | None) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    temperature = torch.tensor([0.0, 1.0, 0.6, 1.7, 0.0, 1.0]).to(device)
    seed = torch.tensor([1, -7, 2**62 + 11, 42, 5, -(2**63)]).to(device)
    idx_mapping = torch.randint(0, 6, (num_rows,), generator=generator, dtype=torch.int32).to(
        device
    )
    positions = torch.randint(0, 2**40, (num_rows,), generator=generator).to(device)
    random_logits = (torch.randn(num_rows, vocab_size, generator=generator) * 2).to(device)
    tied_logits = torch.zeros(num_rows, vocab_size, device=device)  # greedy: 0; else pure noise
    kwargs = {} if block_size is None else {"block_size": block_size}
    for logits in (random_logits, tied_logits):
        for apply_temperature in (True, False):
            expected = gumbel_sample_ref(
                logits, idx_mapping, temperature, seed, positions, apply_temperature
            )
            actual = gumbel_sample_triton(
                logits, idx_mapping, temperature, seed, positions, apply_temperature, **kwargs
            )
            assert torch.equal(actual, expected)


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 6, "vocab_size": 300, "device": "cpu", "block_size": 64},
        on_cuda={"num_rows": 256, "vocab_size": 151936, "device": "cuda", "block_size": None},
    )
)
