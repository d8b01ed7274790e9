"""rejection_sample: greedy verification by hand, the target distribution kept (chi-square
tests on a small vocabulary, against the exact softmax and against the non-speculative
sampler), equality with the non-speculative seeded stream, reproducibility, batch
invariance, argument checks, and Triton vs reference (interpreter and CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels.gumbel_sample import gumbel_sample
from kernels.rejection_sample import (
    rejection_sample,
    rejection_sample_ref,
    rejection_sample_triton,
)
from tests.kernels._triton_interpreter import triton_vs_reference_tests

MIN_P_VALUE = 1e-3
"""A correct sampler fails a chi-square test at this level once in a thousand seeds' worth
of runs; the seeds below are fixed, so each test is deterministic."""


def _batch(
    logits_per_req: list[torch.Tensor], drafts: list[list[int]], k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = torch.cat(logits_per_req)
    counts = [len(d) + 1 for d in drafts]
    assert counts == [x.shape[0] for x in logits_per_req]
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    draft_ids = torch.full((len(drafts), k), -1, dtype=torch.int32)
    for b, d in enumerate(drafts):
        draft_ids[b, : len(d)] = torch.tensor(d, dtype=torch.int32)
    return logits, cu, draft_ids


def _one_hot_logits(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_accepts_the_matching_prefix_then_emits_the_target() -> None:
    # Request 0: drafts 3, 4, 9 against targets 3, 4, 5, (bonus 6): two accepted, then 5.
    # Request 1: all drafts match: both accepted plus the bonus. Request 2: no drafts.
    # Request 3: the first draft is wrong.
    logits, cu, drafts = _batch(
        [
            _one_hot_logits([3, 4, 5, 6]),
            _one_hot_logits([1, 2, 7]),
            _one_hot_logits([8]),
            _one_hot_logits([0, 1]),
        ],
        [[3, 4, 9], [1, 2], [], [5]],
        k=3,
    )
    out, accepted = rejection_sample(
        logits,
        cu,
        drafts,
        torch.tensor([2, 0, 1, 3], dtype=torch.int32),
        temperature=torch.zeros(4),
        seed=torch.arange(4),
        positions=torch.tensor([10, 20, 30, 40]),
    )
    assert accepted.tolist() == [2, 2, 0, 0]
    assert out.tolist() == [[3, 4, 5, -1], [1, 2, 7, -1], [8, -1, -1, -1], [0, -1, -1, -1]]


def _random_case(num_reqs: int, k: int, vocab: int, generator: torch.Generator):
    counts = torch.randint(0, k + 1, (num_reqs,), generator=generator)
    logits = torch.randn(int(counts.sum()) + num_reqs, vocab, generator=generator) * 2
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = (counts + 1).cumsum(0)
    drafts = torch.randint(0, vocab, (num_reqs, k), generator=generator, dtype=torch.int32)
    return logits, cu, drafts


def test_output_is_the_non_speculative_stream_up_to_the_first_mismatch() -> None:
    generator = torch.Generator().manual_seed(0)
    num_reqs, k, vocab = 40, 4, 5
    logits, cu, drafts = _random_case(num_reqs, k, vocab, generator)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.5])
    seed = torch.tensor([11, -3, 2**40, 7])
    idx_mapping = torch.arange(num_reqs, dtype=torch.int32) % 4
    positions = torch.randint(0, 1000, (num_reqs,), generator=generator)
    # Drafts that copy the ordinary sampler's choice are accepted, so runs get long.
    counts = (cu[1:] - cu[:-1]).long()
    rows = torch.repeat_interleave(idx_mapping, counts)
    logit_positions = torch.cat(
        [positions[b] + torch.arange(int(counts[b])) for b in range(num_reqs)]
    )
    plain = gumbel_sample(logits, rows, temperature, seed, logit_positions)
    for b in range(0, num_reqs, 2):
        n = int(counts[b]) - 1
        drafts[b, :n] = plain[cu[b] : cu[b] + n].to(torch.int32)
    out, accepted = rejection_sample(logits, cu, drafts, idx_mapping, temperature, seed, positions)
    for b in range(num_reqs):
        n, a = int(counts[b]) - 1, int(accepted[b])
        expected = plain[cu[b] : cu[b] + a + 1].tolist()
        assert out[b, : a + 1].tolist() == expected
        assert (out[b, a + 1 :] == -1).all()
        assert drafts[b, :a].tolist() == expected[:a]
        assert a == n or int(drafts[b, a]) != expected[a]
        if b % 2 == 0:
            assert a == n
    assert int(accepted.sum()) > 0 and (accepted < (counts - 1)).any()


def test_seeded_results_are_reproducible_and_batch_invariant() -> None:
    generator = torch.Generator().manual_seed(1)
    num_reqs, k, vocab = 12, 3, 6
    logits, cu, drafts = _random_case(num_reqs, k, vocab, generator)
    temperature, seed = torch.full((num_reqs,), 1.0), torch.arange(num_reqs) * 7919
    idx_mapping = torch.arange(num_reqs, dtype=torch.int32)
    positions = torch.arange(num_reqs) * 100
    first = rejection_sample(logits, cu, drafts, idx_mapping, temperature, seed, positions)
    again = rejection_sample(logits, cu, drafts, idx_mapping, temperature, seed, positions)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    # Request 5 alone gives what it gave in the batch.
    b = 5
    alone_cu = torch.tensor([0, int(cu[b + 1] - cu[b])], dtype=torch.int32)
    alone = rejection_sample(
        logits[cu[b] : cu[b + 1]],
        alone_cu,
        drafts[b : b + 1],
        torch.tensor([b], dtype=torch.int32),
        temperature,
        seed,
        positions[b : b + 1],
    )
    assert torch.equal(alone[0][0], first[0][b]) and int(alone[1][0]) == int(first[1][b])
    reseeded = rejection_sample(logits, cu, drafts, idx_mapping, temperature, seed + 1, positions)
    assert not torch.equal(reseeded[0], first[0])


def _chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness of fit; the chi-square survival function is the regularised upper
    incomplete gamma function Q(df / 2, x / 2)."""
    keep = expected > 0
    statistic = (((observed - expected) ** 2)[keep] / expected[keep]).sum()
    df = torch.tensor(float(int(keep.sum()) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic.double() / 2))


def _homogeneity_p_value(counts_a: torch.Tensor, counts_b: torch.Tensor) -> float:
    """Chi-square test that two samples come from one distribution (2 x vocab table)."""
    table = torch.stack([counts_a, counts_b]).double()
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    df = torch.tensor(float(table.shape[1] - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_speculation_keeps_the_target_distribution(temperature: float) -> None:
    num_samples, vocab = 6000, 6
    logits_0 = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5, 0.0])
    logits_1 = torch.tensor([0.0, -0.5, 1.0, 2.5, 0.3, 0.3])
    drafts_0, drafts_1 = 1, 3  # likely drafts, so both acceptance and rejection happen often
    logits = torch.stack([logits_0, logits_1, logits_1]).repeat(num_samples, 1)
    cu = torch.arange(num_samples + 1, dtype=torch.int32) * 3
    drafts = torch.tensor([[drafts_0, drafts_1]], dtype=torch.int32).repeat(num_samples, 1)
    idx_mapping = torch.arange(num_samples, dtype=torch.int32)
    seed = torch.arange(num_samples, dtype=torch.int64) * 1_000_003 + 17
    temperatures = torch.full((num_samples,), temperature)
    positions = torch.full((num_samples,), 50, dtype=torch.int64)
    out, accepted = rejection_sample(logits, cu, drafts, idx_mapping, temperatures, seed, positions)

    p_0 = torch.softmax(logits_0 / temperature, dim=0).double()
    p_1 = torch.softmax(logits_1 / temperature, dim=0).double()
    first = out[:, 0]
    assert torch.equal(accepted >= 1, first == drafts_0)
    first_counts = torch.bincount(first, minlength=vocab).double()
    assert _chi_square_p_value(first_counts, p_0 * num_samples) > MIN_P_VALUE
    # Rejected: the residual, p_0 without the draft token, renormalised.
    rejected = first[accepted == 0]
    residual = p_0.clone()
    residual[drafts_0] = 0
    residual /= residual.sum()
    assert (
        _chi_square_p_value(
            torch.bincount(rejected, minlength=vocab).double(), residual * rejected.numel()
        )
        > MIN_P_VALUE
    )
    # Accepted at position 0: the next token follows p_1.
    second = out[accepted >= 1, 1]
    assert (
        _chi_square_p_value(torch.bincount(second, minlength=vocab).double(), p_1 * second.numel())
        > MIN_P_VALUE
    )
    # Against the non-speculative sampler on other seeds.
    plain = gumbel_sample(
        logits[::3].contiguous(),
        idx_mapping,
        temperatures,
        seed + num_samples * 1_000_003,
        positions,
    )
    assert (
        _homogeneity_p_value(first_counts, torch.bincount(plain, minlength=vocab).double())
        > MIN_P_VALUE
    )
    acceptance_rate = float((accepted >= 1).double().mean())
    assert abs(acceptance_rate - float(p_0[drafts_0])) < 4 * (0.25 / num_samples) ** 0.5


def test_the_chi_square_check_catches_a_biased_sampler() -> None:
    # Guards the statistics above: accepting every draft is a wrong sampler and must fail.
    vocab, num_samples = 6, 6000
    p_0 = torch.softmax(torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5, 0.0]), 0).double()
    always_the_draft = torch.zeros(vocab, dtype=torch.float64)
    always_the_draft[1] = num_samples
    assert _chi_square_p_value(always_the_draft, p_0 * num_samples) < MIN_P_VALUE


def test_bad_arguments_name_the_culprit() -> None:
    logits, cu, drafts = _batch([_one_hot_logits([1, 2])], [[1]], k=2)
    idx = torch.zeros(1, dtype=torch.int32)
    args = (torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="cu_num_logits needs num_reqs . 1 = 2 entries"):
        rejection_sample(logits, cu[:1], drafts, idx, *args)
    with pytest.raises(ValueError, match="draft_token_ids must be torch.int32"):
        rejection_sample(logits, cu, drafts.long(), idx, *args)
    with pytest.raises(ValueError, match="one row per scheduled request"):
        rejection_sample(
            logits, cu, drafts, idx, args[0], args[1], torch.zeros(2, dtype=torch.int64)
        )


def _compare(num_reqs: int, k: int, vocab_size: int, device: str) -> None:
    generator = torch.Generator().manual_seed(vocab_size + k)
    logits, cu, drafts = _random_case(num_reqs, k, vocab_size, generator)
    # Half the rows draft the greedy continuation, so long accepted runs are covered.
    for b in range(0, num_reqs, 2):
        n = int(cu[b + 1] - cu[b]) - 1
        drafts[b, :n] = logits[int(cu[b]) : int(cu[b]) + n].argmax(-1).to(torch.int32)
    temperature = torch.tensor([0.0, 1.0, 0.6, 1.7, 0.0]).to(device)
    seed = torch.tensor([1, -7, 2**62 + 11, 42, 5]).to(device)
    idx_mapping = torch.randint(0, 5, (num_reqs,), generator=generator, dtype=torch.int32)
    positions = torch.randint(0, 2**40, (num_reqs,), generator=generator)
    args = [t.to(device) for t in (logits, cu, drafts, idx_mapping)]
    for apply_temperature in (True, False):
        expected = rejection_sample_ref(
            *args, temperature, seed, positions.to(device), apply_temperature
        )
        actual = rejection_sample_triton(
            *args, temperature, seed, positions.to(device), apply_temperature
        )
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_reqs": 7, "k": 3, "vocab_size": 300, "device": "cpu"},
        on_cuda={"num_reqs": 256, "k": 5, "vocab_size": 151936, "device": "cuda"},
    )
)
