"""The CPU path of kernels/sampling_thresholds.py: the reference's thresholds, bit for bit,
without sorting rows that do not need it.

The reference sorts every row of the batch in full (at 150 rows of 49152 tokens, ~450 ms
of the ~600 a top-k batch took on one thread), then takes a softmax and a cumulative sum
over the sorted row. Here:
- rows without top-k and top-p keep the min-p floor alone (the reference's max with -inf);
- rows whose top-k keeps at most a quarter of the vocabulary take torch.topk of the
  batch's largest such k instead of the sort. Their softmax then sums the same values in
  the same lanes: past the row's k the reference adds exp(-inf) = 0, which changes no
  partial sum, and from 16 values on (one AVX-512 vector; below that torch reduces in
  another order) torch's softmax assigns each rank the same lane whatever the length.
  The cumulative sum is sequential, so its first k values are the reference's too;
  tests/kernels/test_threshold_cpu.py checks this against the reference;
- the others (top-p without top-k, a k near the vocabulary, a row with a NaN or an
  infinite logit) run the reference's ops on their rows alone.
Every op works row by row, so a subset of rows gets the values the whole batch would.
"""

from __future__ import annotations

import torch

from kernels.temperature import apply_temperature_ref
from kernels.top_k_top_p import top_k_top_p_thresholds

MIN_CANDIDATES = 16
"""Fewest top-k candidates to take: a softmax over fewer sums them in another order."""
MAX_CANDIDATES_FRACTION = 4
"""A top-k row takes torch.topk while its k is at most vocab_size / this (topk of 8192 of
49152 tokens costs a quarter of the sort)."""


def thresholds_cpu(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32
    top_k: torch.Tensor,  # [max_num_reqs] int32, 0 = off
    top_p: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    min_p: torch.Tensor,  # [max_num_reqs] float32, 0 = off
) -> torch.Tensor:  # [num_rows] float32
    """`sampling_thresholds_ref`'s result (arguments checked by the caller)."""
    num_rows, vocab_size = logits.shape
    rows = idx_mapping.long()
    row_temperature = temperature[rows]
    scaled = logits
    if not bool(((row_temperature == 0.0) | (row_temperature == 1.0)).all()):
        scaled = logits.clone()
        apply_temperature_ref(scaled, idx_mapping, temperature)
    row_max = scaled.amax(dim=-1)
    floor = row_max + torch.log(min_p[rows])
    row_top_k, row_top_p = top_k[rows], top_p[rows]
    ranked = (row_top_k > 0) | (row_top_p < 1.0)
    if not bool(ranked.any()):
        return floor
    kept_by_k = torch.where((row_top_k > 0) & (row_top_k < vocab_size), row_top_k, vocab_size)
    few = ranked & torch.isfinite(row_max) & (kept_by_k <= vocab_size // MAX_CANDIDATES_FRACTION)
    top = torch.full_like(floor, float("-inf"))
    for group in (few, ranked & ~few):
        group_rows = group.nonzero().squeeze(1)
        if group_rows.numel() == 0:
            continue
        num_candidates = vocab_size
        if group is few:
            num_candidates = min(vocab_size, max(MIN_CANDIDATES, int(kept_by_k[group_rows].max())))
        top[group_rows] = _top_thresholds(
            scaled.index_select(0, group_rows),
            floor[group_rows],
            row_top_k[group_rows],
            row_top_p[group_rows],
            num_candidates,
        )
    return torch.maximum(floor, top)


def _top_thresholds(
    scaled: torch.Tensor,  # [n, vocab_size] float32, a copy: min-p masks it in place
    floor: torch.Tensor,  # [n] float32: each row's min-p threshold
    top_k: torch.Tensor,  # [n] int32
    top_p: torch.Tensor,  # [n] float32
    num_candidates: int,
) -> torch.Tensor:  # [n] float32
    """The reference's top-k/top-p thresholds of these rows, after its min-p mask."""
    scaled.masked_fill_(scaled < floor[:, None], float("-inf"))
    identity = torch.arange(scaled.shape[0], dtype=torch.int32, device=scaled.device)
    return top_k_top_p_thresholds(scaled, identity, top_k, top_p, num_candidates)
