"""The sort-free threshold search's passes: crafted rows that stress its histogram and
fallback paths (flat rows, ties at the boundary, p near 0 and 1, k of 1 and vocab - 1,
extreme temperatures, wide outliers) against the reference, batch invariance of each row,
and how many of the graphed rounds typical rows need (so that none is left to the slow
finishing kernel)."""

from __future__ import annotations

import torch

from kernels.sampling_thresholds import sampling_thresholds_ref
from tests.kernels._triton_interpreter import (
    interpreted_test,
    triton_vs_reference_tests,
)
from tests.kernels.test_sampling_thresholds import _assert_thresholds_match

NEG_INF = float("-inf")
PHASE, ACTION, RESTARTED = (
    0,
    1,
    6,
)  # columns of the search's int state (kernels/_threshold_search.py)
HISTOGRAM = 4  # an action


def _stress_rows(vocab: int) -> tuple[torch.Tensor, list[tuple[float, int, float, float]]]:
    """Logits [17, vocab] and each row's (temperature, top_k, top_p, min_p)."""
    generator = torch.Generator().manual_seed(11)
    randn = lambda scale: torch.randn(vocab, generator=generator) * scale  # noqa: E731
    ties = torch.round(randn(2.0) * 2) / 2
    two_values = (torch.arange(vocab) % 2).float()
    few_finite = torch.full((vocab,), NEG_INF)
    few_finite[[5, vocab // 2, vocab - 1]] = torch.tensor([1.0, 2.0, 0.5])
    outliers = randn(1.0)
    outliers[:7] = -1e4
    peaked = randn(1.0)
    peaked[vocab // 3] = 20.0
    dense = randn(1e-6) + 1.0  # a bulk within a few floats and one token far above it
    dense[0] = 1e30
    rows = [
        (torch.full((vocab,), 0.25), (1.0, 0, 0.5, 0.0)),  # flat: every token ties
        (torch.full((vocab,), 0.25), (1.0, 1, 1.0, 0.0)),
        (ties, (1.0, 37, 1.0, 0.0)),  # ties at the k-th value
        (ties, (1.0, 0, 0.7, 0.0)),
        (randn(3.0), (1.0, 0, 1e-6, 0.0)),  # p near 0: the max alone
        (randn(3.0), (1.0, 0, 0.99999, 0.0)),  # p near 1: nearly everything
        (randn(3.0), (0.8, 1, 0.9, 0.0)),
        (randn(3.0), (1.0, vocab - 1, 1.0, 0.0)),
        (randn(3.0), (1.0, vocab - 1, 0.95, 0.0)),
        (randn(3.0), (0.05, 0, 0.9, 0.0)),  # temperature extremes
        (randn(0.1), (5.0, 0, 0.9, 0.0)),
        (randn(2.0), (1.0, 20, 0.8, 0.1)),  # all three filters
        (two_values, (1.0, 0, 0.6, 0.0)),  # half the row ties at the answer
        (few_finite, (1.0, 2, 0.9, 0.0)),
        (outliers, (1.0, 100, 1.0, 0.0)),  # a wide range: the histogram's bins are coarse
        (peaked, (1.0, 0, 0.95, 0.0)),
        # the histogram makes no progress in the bulk: pivot passes (the finishing kernel)
        (dense, (1.0, 300, 1.0, 0.0)),
    ]
    return torch.stack([logits for logits, _ in rows]), [filters for _, filters in rows]


def _filters(settings: list[tuple[float, int, float, float]]) -> list[torch.Tensor]:
    temperature, top_k, top_p, min_p = zip(*settings)
    return [
        torch.tensor(temperature),
        torch.tensor(top_k, dtype=torch.int32),
        torch.tensor(top_p),
        torch.tensor(min_p),
    ]


def check_stress_rows_match_reference_and_are_batch_invariant(vocab: int, chunk: int) -> None:
    from kernels import sampling_thresholds as module

    logits, settings = _stress_rows(vocab)
    filters = _filters(settings)
    rows = torch.arange(len(settings), dtype=torch.int32)
    actual = module.sampling_thresholds_triton(logits, rows, *filters, chunk=chunk)
    _assert_thresholds_match(
        logits, rows, filters, actual, sampling_thresholds_ref(logits, rows, *filters)
    )
    # The same rows in another batch, in another order: bit for bit the same thresholds.
    subset = torch.tensor([15, 3, 16, 12, 7, 0, 9, 14])
    again = module.sampling_thresholds_triton(logits[subset], rows[subset], *filters, chunk=chunk)
    assert torch.equal(again, actual[subset]), (again, actual[subset])


def check_typical_rows_finish_within_the_graphed_rounds(
    vocab: int, chunk: int, device: str = "cpu"
) -> None:
    """Gaussian rows need no finishing passes: on a wide row (std 3.75 after temperature, as
    bench_sampler.py draws them) a small top-k (+ top-p) and top-p alone take one copy-out
    where the fit guesses the answer; top-p with min-p one histogram pass and the copy-out;
    a large top-k at most two more; none restarts."""
    from kernels import sampling_thresholds as module

    generator = torch.Generator().manual_seed(5)
    settings = [
        (0.8, 0, 0.9, 0.0),
        (0.8, 50, 0.9, 0.0),
        (0.8, 50, 1.0, 0.0),
        (1.0, 0, 0.5, 0.0),
        (0.8, 0, 0.99, 0.0),
        (1.0, vocab // 3, 1.0, 0.0),
        (1.0, 0, 0.9, 0.05),
    ]
    scale = torch.tensor([3.0, 3.0, 3.0, 1.0, 3.0, 3.0, 0.3])
    logits = (torch.randn(len(settings), vocab, generator=generator) * scale[:, None]).to(device)
    filters = [f.to(device) for f in _filters(settings)]
    rows = torch.arange(len(settings), dtype=torch.int32, device=device)
    expected = sampling_thresholds_ref(logits, rows, *filters)
    for num_rounds, finished in (
        (1, [0, 1, 2, 3, 4]),
        (module.NUM_GRAPHED_ROUNDS, list(range(len(settings)))),
    ):
        thresholds, state = module._launch(
            logits[finished],
            rows[finished],
            (rows[finished], *filters),
            chunk,
            max_finish_rounds=0,
            num_rounds=num_rounds,
        )
        state = state.cpu()
        assert (state[:, PHASE] == 0).all(), (num_rounds, state[:, PHASE])
        assert (state[:, RESTARTED] == 0).all(), state[:, RESTARTED]
        _assert_thresholds_match(
            logits[finished].cpu(),
            rows[finished].cpu(),
            filters,
            thresholds.cpu(),
            expected[finished].cpu(),
        )


def _assert_missed_guesses_fall_back(
    logits: torch.Tensor, settings: list[tuple[float, int, float, float]], chunk: int
) -> None:
    """After one round each row is not done but searching by histogram; given the graphed
    rounds it matches the reference, without a restart."""
    from kernels import sampling_thresholds as module

    filters = [f.to(logits.device) for f in _filters(settings)]
    rows = torch.arange(len(settings), dtype=torch.int32, device=logits.device)
    _, state = module._launch(
        logits, rows, (rows, *filters), chunk, max_finish_rounds=0, num_rounds=1
    )
    state = state.cpu()
    assert (state[:, PHASE] != 0).all() and (state[:, ACTION] == HISTOGRAM).all(), state
    thresholds, state = module._launch(logits, rows, (rows, *filters), chunk, max_finish_rounds=0)
    state = state.cpu()
    assert (state[:, PHASE] == 0).all() and (state[:, RESTARTED] == 0).all(), state
    _assert_thresholds_match(
        logits.cpu(),
        rows.cpu(),
        [f.cpu() for f in filters],
        thresholds.cpu(),
        sampling_thresholds_ref(logits, rows, *filters).cpu(),
    )


def check_a_missed_top_k_guess_falls_back_to_the_histogram(
    vocab: int, chunk: int, device: str = "cpu"
) -> None:
    """Rows where the normal fit's cut misses: too few tokens above it (a few far spikes
    inflate the spread) or more than the candidates hold (a tight cluster far above the
    bulk)."""
    generator = torch.Generator().manual_seed(7)
    spikes = torch.randn(vocab, generator=generator)
    spikes[:40] = 200.0  # the cut lands above the bulk: 40 tokens above it
    cluster = torch.randn(vocab, generator=generator)
    num_clustered = max(1200, vocab // 20)  # all above the cut, more than the 1024 candidates
    cluster[:num_clustered] = 20.0 + 0.01 * torch.randn(num_clustered, generator=generator)
    _assert_missed_guesses_fall_back(
        torch.stack([spikes, cluster]).to(device), [(1.0, 50, 1.0, 0.0), (1.0, 50, 0.9, 0.0)], chunk
    )


def check_a_missed_top_p_guess_falls_back_to_the_histogram(
    vocab: int, chunk: int, device: str = "cpu"
) -> None:
    """Top-p alone, where the fit's window misses: a tight cluster at the answer (more
    tokens in the window than the candidates hold), and a block of strong candidates above
    the bulk that the fit does not describe."""
    generator = torch.Generator().manual_seed(9)
    cluster = torch.randn(vocab, generator=generator)
    num_clustered = max(3000, vocab // 20)
    cluster[:num_clustered] = 3.0 + 1e-3 * torch.randn(num_clustered, generator=generator)
    strong = torch.randn(vocab, generator=generator)
    strong[:2000] = 5.0 + torch.rand(2000, generator=generator)
    _assert_missed_guesses_fall_back(
        torch.stack([cluster, strong]).to(device), [(1.0, 0, 0.5, 0.0), (1.0, 0, 0.9, 0.0)], chunk
    )


(
    test_a_missed_top_k_guess_falls_back_in_interpreter,
    test_a_missed_top_k_guess_falls_back_on_cuda,
) = triton_vs_reference_tests(
    check_a_missed_top_k_guess_falls_back_to_the_histogram,
    interpreted={"vocab": 8192, "chunk": 2048},
    on_cuda={"vocab": 151936, "chunk": 8192, "device": "cuda"},
)
(
    test_a_missed_top_p_guess_falls_back_in_interpreter,
    test_a_missed_top_p_guess_falls_back_on_cuda,
) = triton_vs_reference_tests(
    check_a_missed_top_p_guess_falls_back_to_the_histogram,
    interpreted={"vocab": 8192, "chunk": 2048},
    on_cuda={"vocab": 151936, "chunk": 8192, "device": "cuda"},
)


# 1100 tokens over 256-token chunks: a partial last chunk, k = vocab - 1 past the capacity.
test_stress_rows_in_interpreter = interpreted_test(
    __file__,
    "check_stress_rows_match_reference_and_are_batch_invariant",
    kwargs={"vocab": 1100, "chunk": 256},
)


(
    test_typical_rows_finish_within_the_graphed_rounds_in_interpreter,
    test_typical_rows_finish_within_the_graphed_rounds_on_cuda,
) = triton_vs_reference_tests(
    check_typical_rows_finish_within_the_graphed_rounds,
    interpreted={"vocab": 8192, "chunk": 2048},
    on_cuda={"vocab": 151936, "chunk": 8192, "device": "cuda"},
)
