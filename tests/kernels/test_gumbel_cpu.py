"""gumbel_sample's CPU path (kernels/_gumbel_cpu.py) against the dense reference, bit for
bit: its int32 hash, its noise bound, and whole draws over hostile rows."""

from __future__ import annotations

import pytest
import torch

from kernels import _gumbel_cpu
from kernels._gumbel_hash import (
    NUM_UNIFORM_BITS,
    TOKEN_FACTOR,
    as_int32,
    gumbel_noise_ref,
    max_noise,
    mix32_int32_,
    mix32_ref,
    mul32_ref,
    noise_of_top_bits,
    token_factors_int32,
)
from kernels.gumbel_sample import gumbel_sample, gumbel_sample_cpu, gumbel_sample_ref

CPU = torch.device("cpu")


def _bits32(values: torch.Tensor) -> torch.Tensor:
    return values.long() & 0xFFFFFFFF


def test_the_int32_hash_gives_the_reference_bits() -> None:
    generator = torch.Generator().manual_seed(0)
    edges = torch.tensor([0, 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1])
    values = torch.cat([edges, torch.randint(0, 2**32, (100_000,), generator=generator)])
    assert torch.equal(_bits32(mix32_int32_(as_int32(values))), mix32_ref(values))
    assert torch.equal(
        _bits32(token_factors_int32(70_000, CPU)),
        mul32_ref(torch.arange(70_000), TOKEN_FACTOR),
    )


def test_max_noise_bounds_every_noise_value() -> None:
    top_bits = torch.arange(1 << NUM_UNIFORM_BITS)
    noise = noise_of_top_bits(top_bits)
    assert max_noise(CPU) == noise.max().item() == noise[-1].item()
    assert max_noise(CPU) == pytest.approx(16.6355, abs=1e-3)


def _hostile_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 3
    logits[0] = 0.0  # flat: every token contends
    logits[1, ::3] = float("-inf")
    logits[2] = float("-inf")  # nothing finite: the dense draw
    logits[2, vocab_size // 2] = 5.0
    logits[3] = float("-inf")
    logits[4, 7 % vocab_size] = float("nan")
    logits[5, vocab_size - 1] = float("inf")
    logits[6] *= 1e37  # spans beyond any noise; sums near float32's max
    logits[7] = torch.randint(-3, 3, (vocab_size,), generator=generator).float()  # ties
    logits[8] *= 1e-30  # below any noise's resolution
    return logits


@pytest.mark.parametrize("vocab_size", [1, 3, 64, 1000, 4096, 49152])
@pytest.mark.parametrize("apply_temperature", [True, False])
def test_draws_equal_the_reference(vocab_size: int, apply_temperature: bool) -> None:
    num_rows = 40
    generator = torch.Generator().manual_seed(vocab_size)
    logits = _hostile_logits(num_rows, vocab_size, vocab_size)
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.7, 1.0, 40.0, 1e-3, 1.0])
    seed = torch.tensor([1, -7, 2**62 + 11, 42, 5, -(2**63), 2**63 - 1, 0])
    idx_mapping = torch.randint(0, 8, (num_rows,), generator=generator, dtype=torch.int32)
    positions = torch.randint(0, 2**40, (num_rows,), generator=generator)
    args = (logits, idx_mapping, temperature, seed, positions, apply_temperature)
    assert torch.equal(gumbel_sample_cpu(*args), gumbel_sample_ref(*args))
    assert torch.equal(gumbel_sample(*args), gumbel_sample_ref(*args))
    for cut in (0.0, 2.5):  # thresholds as top-k / top-p / min-p leave them
        thresholds = logits.nan_to_num(0.0, 0.0, 0.0).amax(dim=1) - cut
        thresholds[::5] = float("-inf")
        assert torch.equal(
            gumbel_sample_cpu(*args, thresholds=thresholds),
            gumbel_sample_ref(*args, thresholds=thresholds),
        )


def test_a_row_draws_the_same_token_in_any_batch() -> None:
    vocab_size = 2048
    logits = _hostile_logits(12, vocab_size, 3)
    temperature, seed = torch.ones(12), torch.arange(12) * 977
    positions = torch.arange(12) + 100
    idx_mapping = torch.arange(12, dtype=torch.int32)
    alone = [
        gumbel_sample_cpu(
            logits[i : i + 1], idx_mapping[i : i + 1], temperature, seed, positions[i : i + 1]
        ).item()
        for i in range(12)
    ]
    together = gumbel_sample_cpu(logits, idx_mapping, temperature, seed, positions)
    assert together.tolist() == alone


def test_ties_go_to_the_first_token() -> None:
    sampled = torch.full((3,), -1)
    rows = torch.tensor([0, 0, 0, 2, 2])
    tokens = torch.tensor([4, 9, 12, 1, 3])
    noised = torch.tensor([1.0, 2.0, 2.0, -5.0, float("-inf")])
    _gumbel_cpu._first_argmax_into(sampled, rows, tokens, noised)
    assert sampled.tolist() == [9, -1, 1]


def test_zero_rows_and_all_greedy_batches() -> None:
    empty = gumbel_sample_cpu(
        torch.zeros(0, 10),
        torch.zeros(0, dtype=torch.int32),
        torch.ones(1),
        torch.ones(1, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
    )
    assert empty.shape == (0,)
    logits = torch.tensor([[0.0, 3.0, 3.0, float("nan")], [5.0, 5.0, 0.0, 0.0]])
    args = (logits, torch.zeros(2, dtype=torch.int32), torch.zeros(1), torch.ones(1).long())
    greedy = gumbel_sample_cpu(*args, torch.tensor([0, 1]))
    assert greedy.tolist() == gumbel_sample_ref(*args, torch.tensor([0, 1])).tolist() == [3, 0]


def test_a_token_at_the_noise_bound_still_wins() -> None:
    # Seed 1234 at position 186 gives token 1006 the largest noise there is: it must win
    # from 17.1 below the leader (noise -0.47), whose noised score falls just short.
    seed, position, token, vocab_size = 1234, 186, 1006, 1024
    noise = gumbel_noise_ref(torch.tensor([seed]), torch.tensor([position]), vocab_size)[0]
    assert noise[token].item() == max_noise(CPU)
    logits = torch.full((1, vocab_size), float("-inf"))
    logits[0, token] = 0.0
    logits[0, 3] = max_noise(CPU) - noise[3].item() - 1e-3  # noised: 1e-3 below token's
    args = (logits, torch.zeros(1, dtype=torch.int32), torch.ones(1), torch.tensor([seed]))
    assert gumbel_sample_ref(*args, torch.tensor([position])).item() == token
    assert gumbel_sample_cpu(*args, torch.tensor([position])).item() == token
