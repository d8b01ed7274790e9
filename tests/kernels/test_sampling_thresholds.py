"""sampling_thresholds: hand-checked kept sets, the reference against the sort-based in-place
ops, the sort-free Triton search against the reference (interpreter and CUDA) on random
rows with ties, flat and peaked rows, top_k = 1, k past the vocabulary, k past the search's
capacity and -inf logits; sampling through thresholds against the old sort-based path."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.gumbel_sample import gumbel_sample_ref, gumbel_sample_triton
from kernels.min_p import apply_min_p_ref
from kernels.sampling_thresholds import (
    sampling_thresholds,
    sampling_thresholds_ref,
    sampling_thresholds_triton,
)
from kernels.temperature import apply_temperature_ref
from kernels.top_k_top_p import apply_top_k_top_p_ref
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    interpreted_test,
    triton_vs_reference_tests,
)

NEG_INF = float("-inf")


def _kept(
    logits: list[float],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> list[int]:
    row = torch.tensor([logits])
    threshold = sampling_thresholds(
        row,
        torch.zeros(1, dtype=torch.int32),
        torch.tensor([temperature]),
        torch.tensor([top_k], dtype=torch.int32),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )
    scaled = row[0] / (temperature if temperature not in (0.0, 1.0) else 1.0)
    return torch.nonzero(scaled >= threshold).flatten().tolist()


# Probabilities 0.4, 0.3, 0.2, 0.1 at token ids 2, 0, 3, 1.
PROBS = [math.log(0.3), math.log(0.1), math.log(0.4), math.log(0.2)]


def test_hand_checked_kept_sets() -> None:
    assert _kept(PROBS) == [0, 1, 2, 3]
    assert _kept(PROBS, top_k=2) == [0, 2]
    assert _kept(PROBS, top_k=1) == [2]
    assert _kept(PROBS, top_p=0.35) == [2]  # 0.4 alone reaches 0.35
    assert _kept(PROBS, top_p=0.5) == [0, 2]  # 0.4 < 0.5, then 0.7
    assert _kept(PROBS, top_k=3, top_p=0.6) == [0, 2]  # renormalised top 3: 0.444 < 0.6 <= 0.778
    assert _kept(PROBS, min_p=0.6) == [0, 2]  # 0.3 >= 0.6 * 0.4 > 0.2
    assert _kept(PROBS, min_p=0.6, top_p=0.5) == [2]  # over the survivors: 0.571 >= 0.5


def test_ties_at_the_boundary_are_kept_together() -> None:
    assert _kept([1.0, 3.0, 2.0, 2.0, 2.0], top_k=2) == [1, 2, 3, 4]
    assert _kept([5.0, 5.0, 5.0], top_k=1, top_p=0.1) == [0, 1, 2]


def test_temperature_scales_before_the_filters() -> None:
    # At T = 2 the top token's probability drops below 0.5: top-p 0.5 needs a second one.
    logits = [1.0, 0.0, -1.0, -3.0]
    assert _kept(logits, top_p=0.5) == [0]
    assert _kept(logits, temperature=2.0, top_p=0.5) == [0, 1]


def _old_kept_mask(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The sampler's previous in-place pipeline, full sort: which tokens stay finite."""
    processed = logits.clone()
    apply_temperature_ref(processed, rows, temperature)
    apply_min_p_ref(processed, rows, min_p)
    apply_top_k_top_p_ref(processed, rows, top_k, top_p, logits.shape[1])
    return processed > NEG_INF


def _random_filters(
    num_reqs: int, vocab: int, generator: torch.Generator
) -> tuple[torch.Tensor, ...]:
    def pick(options: list[float]) -> torch.Tensor:
        return torch.tensor(options)[torch.randint(len(options), (num_reqs,), generator=generator)]

    temperature = pick([1.0, 0.0, 0.5, 0.8, 1.3, 2.0])
    top_k = pick([0, 0, 1, 2, 7, 50, vocab // 3, vocab - 1, vocab + 5]).to(torch.int32)
    top_p = pick([1.0, 1.0, 0.05, 0.5, 0.8, 0.9, 0.95, 0.999])
    min_p = pick([0.0, 0.0, 0.0, 0.01, 0.1, 0.5, 1.0])
    return temperature, top_k, top_p, min_p


def _random_logits(num_rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    logits = torch.randn(num_rows, vocab, generator=generator)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0])[torch.randint(4, (num_rows,), generator=generator)]
    logits = logits * scale[:, None]
    logits[0::5] = torch.round(logits[0::5] * 2) / 2  # many ties
    logits[1::5, : vocab // 2] = NEG_INF  # banned tokens (a -inf logit bias)
    logits[2::5, 3] += 12.0  # one peaked token
    logits[3::7] = 0.25  # a flat row
    return logits


def test_reference_keeps_what_the_sort_based_in_place_ops_keep() -> None:
    generator = torch.Generator().manual_seed(1)
    vocab = 300
    logits = _random_logits(64, vocab, generator)
    filters = _random_filters(16, vocab, generator)
    rows = torch.randint(0, 16, (64,), generator=generator, dtype=torch.int32)
    thresholds = sampling_thresholds_ref(logits, rows, *filters)
    temperature = filters[0][rows.long()]
    scaled = (
        logits / torch.where((temperature == 0) | (temperature == 1), 1.0, temperature)[:, None]
    )
    assert torch.equal(scaled >= thresholds[:, None], _old_kept_mask(logits, rows, *filters))


def test_knife_edge_check_accepts_rounding_and_rejects_real_differences() -> None:
    # Probabilities 0.5, 0.3, 0.2: with top-p 0.5 the second token's mass before it is 0.5
    # exactly, so float rounding may keep it or not; the third (0.8 before it) must go.
    row = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)])
    edge, kept, wrong = float(row[0]), float(row[1]), float(row[2])
    assert _knife_edge_only(row, 1.0, 0, 0.5, 0.0, (edge, kept))
    assert not _knife_edge_only(row, 1.0, 0, 0.5, 0.0, (edge, wrong))
    assert not _knife_edge_only(row, 1.0, 0, 0.6, 0.0, (edge, kept))  # 0.5 before it: far from 0.6


def test_bad_arguments_name_the_culprit() -> None:
    logits = torch.zeros(2, 8)
    rows = torch.zeros(2, dtype=torch.int32)
    ok = (torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.ones(1), torch.zeros(1))
    with pytest.raises(ValueError, match="top_k must be torch.int32"):
        sampling_thresholds(logits, rows, ok[0], ok[1].float(), ok[2], ok[3])
    with pytest.raises(ValueError, match="min_p must have size 1"):
        sampling_thresholds(logits, rows, *ok[:3], torch.zeros(2))


KNIFE_EDGE_MASS = 5e-5
"""How close (in probability) to p a token's cumulative mass may be for float32 sums taken in
another order (a GPU scan over the sorted row, a tree over chunks) to decide it differently.
The reference's float32 cumulative sum over 151936 sorted probabilities drifts that far: at
p = 0.99 on a row of std 3.75 it was 2.6e-5 off, where the search's threshold was the exact
one in float64."""


def _knife_edge_only(
    row_logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    thresholds: tuple[float, float],
) -> bool:
    """Whether two thresholds of one row differ only by tokens at a float32 knife edge: a
    min-p floor within rounding of their value, or a top-p cut within KNIFE_EDGE_MASS of
    their exclusive cumulative mass (float64, over the top-k survivors in rank order)."""
    y32 = row_logits.float().cpu()
    if temperature not in (0.0, 1.0):
        y32 = y32 / temperature
    y = y32.double()
    lo, hi = sorted(thresholds)
    between = torch.unique(y[(y >= lo) & (y < hi)])
    floor = float(y.max() + math.log(min_p)) if min_p > 0 else NEG_INF
    at_floor = ((between - floor).abs() <= 1e-6 * max(1.0, abs(floor))) & (min_p > 0)
    ranked = torch.sort(y[y >= floor], descending=True).values
    if 0 < top_k < ranked.numel():
        ranked = ranked[:top_k]
    probs = torch.softmax(ranked, dim=0)
    mass_before = torch.cumsum(probs, dim=0) - probs
    first_rank = torch.searchsorted(-ranked, -between)  # each value's first place in rank order
    near_cut = (first_rank < ranked.numel()) & (
        (mass_before[first_rank.clamp(max=ranked.numel() - 1)] - top_p).abs() <= KNIFE_EDGE_MASS
    )
    return bool((at_floor | (near_cut & (top_p < 1.0))).all())


def _assert_thresholds_match(
    logits: torch.Tensor,
    rows: torch.Tensor,
    filters: list[torch.Tensor],
    actual: torch.Tensor,
    expected: torch.Tensor,
) -> None:
    """Equal, but for rows that differ only at a float32 knife edge (at 151936 tokens a flat
    row's tokens each carry ~7e-6 of the mass, near float32 summation error)."""
    temperature, top_k, top_p, min_p = (f.cpu() for f in filters)
    for row in torch.nonzero(actual != expected).flatten().tolist():
        req = int(rows[row])
        assert _knife_edge_only(
            logits[row],
            float(temperature[req]),
            int(top_k[req]),
            float(top_p[req]),
            float(min_p[req]),
            (float(actual[row]), float(expected[row])),
        ), (row, float(actual[row]), float(expected[row]))


def _compare(num_rows: int, vocab: int, chunk: int | None, num_batches: int, device: str) -> None:
    from kernels import sampling_thresholds as module

    if device == "cpu":
        assert_interpreted(module._round_kernel, module._finish_kernel)
    kwargs = {} if chunk is None else {"chunk": chunk}
    for batch in range(num_batches):
        generator = torch.Generator().manual_seed(100 + batch)
        logits = _random_logits(num_rows, vocab, generator).to(device)
        filters = [f.to(device) for f in _random_filters(num_rows, vocab, generator)]
        rows = torch.randperm(num_rows, generator=generator).to(torch.int32).to(device)
        expected = sampling_thresholds_ref(logits, rows, *filters)
        actual = sampling_thresholds_triton(logits, rows, *filters, **kwargs)
        _assert_thresholds_match(logits, rows, filters, actual, expected)
        # A row's threshold does not depend on the rest of the batch.
        alone = sampling_thresholds_triton(logits[3:4], rows[3:4], *filters, **kwargs)
        assert torch.equal(alone, expected[3:4])


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        # 1500 tokens over 512-token chunks; k up to 1505 passes the 1024-candidate capacity.
        interpreted={
            "num_rows": 20,
            "vocab": 1500,
            "chunk": 512,
            "num_batches": 2,
            "device": "cpu",
        },
        on_cuda={
            "num_rows": 256,
            "vocab": 151936,
            "chunk": None,
            "num_batches": 4,
            "device": "cuda",
        },
    )
)


def _sample_both_ways(
    logits: torch.Tensor,
    rows: torch.Tensor,
    filters: tuple[torch.Tensor, ...],
    seed: torch.Tensor,
    positions: torch.Tensor,
    threshold_fn,
    gumbel_fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    temperature, top_k, top_p, min_p = filters
    old = logits.clone()
    apply_temperature_ref(old, rows, temperature)
    apply_min_p_ref(old, rows, min_p)
    apply_top_k_top_p_ref(old, rows, top_k, top_p, logits.shape[1])
    expected = gumbel_sample_ref(old, rows, temperature, seed, positions, apply_temperature=False)
    thresholds = threshold_fn(logits, rows, *filters)
    return gumbel_fn(logits, rows, temperature, seed, positions, thresholds=thresholds), expected


@pytest.mark.parametrize("seed", range(3))
def test_sampling_through_thresholds_draws_what_the_sort_based_path_draws(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    vocab, num_rows = 400, 96
    logits = _random_logits(num_rows, vocab, generator)
    filters = _random_filters(num_rows, vocab, generator)
    rows = torch.randperm(num_rows, generator=generator).to(torch.int32)
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=generator)
    positions = torch.randint(0, 4096, (num_rows,), generator=generator)
    actual, expected = _sample_both_ways(
        logits, rows, filters, seeds, positions, sampling_thresholds_ref, gumbel_sample_ref
    )
    assert torch.equal(actual, expected)


def check_interpreted_sampling_matches_the_sort_based_path() -> None:
    generator = torch.Generator().manual_seed(7)
    vocab, num_rows = 600, 12
    logits = _random_logits(num_rows, vocab, generator)
    filters = _random_filters(num_rows, vocab, generator)
    rows = torch.arange(num_rows, dtype=torch.int32)
    seeds = torch.randint(0, 2**62, (num_rows,), generator=generator)
    positions = torch.randint(0, 4096, (num_rows,), generator=generator)
    actual, expected = _sample_both_ways(
        logits,
        rows,
        filters,
        seeds,
        positions,
        lambda *args: sampling_thresholds_triton(*args, chunk=256),
        gumbel_sample_triton,
    )
    assert torch.equal(actual, expected)


test_triton_sampling_matches_the_sort_based_path_in_interpreter = interpreted_test(
    __file__, "check_interpreted_sampling_matches_the_sort_based_path"
)
