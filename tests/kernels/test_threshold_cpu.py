"""sampling_thresholds' CPU path (kernels/_threshold_cpu.py) against the sort-based
reference, bit for bit: mixed batches of top-k, top-p, min-p and temperature over hostile
rows, the softmax property the top-k shortcut rests on, and which rows get sorted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels import _threshold_cpu
from kernels.sampling_thresholds import (
    sampling_thresholds,
    sampling_thresholds_cpu,
    sampling_thresholds_ref,
)


def _same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal values, NaN where the reference has NaN."""
    nan = torch.isnan(expected)
    return torch.equal(torch.isnan(actual), nan) and torch.equal(actual[~nan], expected[~nan])


def _hostile_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 4
    logits[0] = 0.0  # flat
    logits[1, ::2] = float("-inf")
    logits[2] = float("-inf")
    logits[3, 0] = float("nan")
    logits[4, vocab_size - 1] = float("inf")
    logits[5] = torch.randint(-2, 2, (vocab_size,), generator=generator).float()  # ties
    logits[6] *= 30  # peaked
    return logits


def _params(vocab_size: int) -> tuple[torch.Tensor, ...]:
    top_k = [0, -1, 1, 5, 15, 16, 17, 20, 50, vocab_size // 4, vocab_size // 4 + 1]
    top_k += [vocab_size - 1, vocab_size, vocab_size + 5, 20, 20, 0, 3, 0]
    top_p = [1.0, 0.9, 1.0, 0.5, 0.95, 0.999, 1.0, 0.8, 0.3, 0.9, 1.0, 0.7, 0.6, 0.9]
    top_p += [1.0, 0.0, 0.9, 1.0, 0.9999999]  # the last keeps the negligible tail
    min_p = [0.0, 0.0, 0.05, 0.0, 0.5, 0.0, 0.1, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0]
    min_p += [0.0, 0.0, 0.3, 0.0, 0.0]
    temperature = [1.0, 0.6, 0.0, 1.7, 1.0, 0.3, 1.0, 0.7, 2.0, 1.0, 1.0, 0.9, 1.0, 1.0]
    temperature += [0.5, 1.0, 1.0, 1.0, 1.0]
    return (
        torch.tensor(temperature),
        torch.tensor(top_k, dtype=torch.int32),
        torch.tensor(top_p),
        torch.tensor(min_p),
    )


@pytest.mark.parametrize("vocab_size", [4, 15, 16, 64, 1000, 8192])
def test_mixed_batches_equal_the_reference(vocab_size: int) -> None:
    num_rows = 48
    generator = torch.Generator().manual_seed(vocab_size)
    logits = _hostile_logits(num_rows, vocab_size, vocab_size)
    filters = _params(vocab_size)
    idx_mapping = torch.randint(0, 19, (num_rows,), generator=generator, dtype=torch.int32)
    expected = sampling_thresholds_ref(logits, idx_mapping, *filters)
    assert _same(sampling_thresholds_cpu(logits, idx_mapping, *filters), expected)
    assert _same(sampling_thresholds(logits, idx_mapping, *filters), expected)
    # one kind of row at a time, as a batch of a single request would be
    for request in range(19):
        mapping = torch.full((num_rows,), request, dtype=torch.int32)
        expected = sampling_thresholds_ref(logits, mapping, *filters)
        assert _same(sampling_thresholds_cpu(logits, mapping, *filters), expected)


def test_softmax_of_a_sorted_prefix_equals_the_full_rows() -> None:
    # The top-k shortcut: past k every value is -inf, so from 16 candidates on the
    # softmax of the prefix gives the full row's probabilities bit for bit.
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(32, 49152, generator=generator) * 5
    ranked = torch.sort(rows, dim=-1, descending=True).values
    for k in (1, 7, 16, 20, 100, 1000):
        full = torch.softmax(ranked.masked_fill(torch.arange(49152) >= k, float("-inf")), -1)
        length = max(k, _threshold_cpu.MIN_CANDIDATES)
        prefix = ranked[:, :length].masked_fill(torch.arange(length) >= k, float("-inf"))
        assert torch.equal(torch.softmax(prefix, -1)[:, :k], full[:, :k])


@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])
def test_a_negligible_tail_changes_no_softmax_sum(scale: float) -> None:
    # The top-p shortcut: values NEGLIGIBLE_SPAN below the 16th largest, masked to -inf,
    # leave the probabilities ahead of them bit for bit (a span of 12 would not).
    generator = torch.Generator().manual_seed(int(scale))
    ranked = torch.sort(torch.randn(64, 49152, generator=generator) * scale, -1, True).values
    full = torch.softmax(ranked, dim=-1)
    for span in (_threshold_cpu.NEGLIGIBLE_SPAN, 12.0):
        is_tail = ranked < (ranked[:, 15] - span)[:, None]
        head = torch.softmax(ranked.masked_fill(is_tail, float("-inf")), dim=-1)
        holds = span == _threshold_cpu.NEGLIGIBLE_SPAN or scale < 3.0  # scale 1: no tail
        assert torch.equal(head[~is_tail], full[~is_tail]) == holds


def test_rows_are_sorted_only_where_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab_size = 4096
    calls: list[tuple[int, int]] = []
    real = _threshold_cpu.top_k_top_p_thresholds

    def recording(scaled: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append((scaled.shape[0], args[-1]))
        return real(scaled, *args)

    monkeypatch.setattr(_threshold_cpu, "top_k_top_p_thresholds", recording)
    logits = torch.randn(6, vocab_size)
    temperature = torch.ones(3)
    top_k = torch.tensor([20, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 0.8])
    min_p = torch.tensor([0.0, 0.1, 0.0])
    idx_mapping = torch.tensor([0, 1, 1, 2, 0, 1], dtype=torch.int32)
    expected = sampling_thresholds_ref(logits, idx_mapping, temperature, top_k, top_p, min_p)
    actual = sampling_thresholds_cpu(logits, idx_mapping, temperature, top_k, top_p, min_p)
    assert _same(actual, expected)
    # the two top-k rows take 20 candidates; the top-p row alone is sorted; min-p rows neither
    assert calls == [(2, 20), (1, vocab_size)]


def test_top_p_rows_sort_their_heads_and_redo_a_row_that_reaches_past(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vocab_size, num_rows = 8192, 24
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 12  # narrow heads
    logits[0, 5:] = float("-inf")  # fewer finite values than one softmax lane group
    logits[1] = torch.randn(vocab_size, generator=generator)  # a wide head
    logits[3] = -19.0  # a tail holding 3e-6 of the mass, more than 1 - p leaves out
    logits[3, :16] = 0.0
    temperature = torch.tensor([0.6, 1.0, 0.8, 1.0])
    top_k = torch.zeros(4, dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.9999999])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0])
    idx_mapping = (torch.arange(num_rows) % 4).to(torch.int32)
    redone: list[int] = []
    real = _threshold_cpu._top_thresholds

    def recording(scaled: torch.Tensor, *args: Any) -> torch.Tensor:
        redone.append(scaled.shape[0])
        return real(scaled, *args)

    monkeypatch.setattr(_threshold_cpu, "_top_thresholds", recording)
    filters = (temperature, top_k, top_p, min_p)
    expected = sampling_thresholds_ref(logits, idx_mapping, *filters)
    assert _same(sampling_thresholds_cpu(logits, idx_mapping, *filters), expected)
    assert redone == [2]  # one full pass, of row 1 (wide) and row 3 (past its head)
