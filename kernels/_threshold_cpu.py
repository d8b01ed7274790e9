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
- top-p rows without such a top-k mask the tail that cannot change the softmax's sums
  (NEGLIGIBLE_SPAN below the 16th largest value) to -inf, which sorts 3x faster, and
  take the softmax and cumulative sum of the head alone: the masses ahead of the tail are
  the reference's, so a row whose kept set ends ahead of it has the reference's
  threshold, and any other row is redone in full;
- the others (top-k alone with a k near the vocabulary, a row with a NaN or an infinite
  logit) run the reference's ops on their rows alone.
Every op works row by row, so a subset of rows gets the values the whole batch would.
"""

from __future__ import annotations

import torch

from kernels.temperature import apply_temperature_ref
from kernels.top_k_top_p import thresholds_of_ranked, top_k_top_p_thresholds

MIN_CANDIDATES = 16
"""Fewest top-k candidates to take: a softmax over fewer sums them in another order."""
NEGLIGIBLE_SPAN = 18.0
"""A value this far below a row's 16th largest has exp(value - max) under 2**-25 of every
lane's running sum in the reference's softmax (each lane starts with one of the 16
largest): adding it rounds back to the same sum, as adding 0 does. 17.3 would do; the
rest covers exp's rounding."""
MAX_HEAD_FRACTION = 2
"""Top-p rows mask their tails while the widest head holds at most vocab_size / this
values (at temperature 1 most of a row lies within NEGLIGIBLE_SPAN of the top)."""
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
    finite = ranked & torch.isfinite(row_max)
    few = finite & (kept_by_k <= vocab_size // MAX_CANDIDATES_FRACTION)
    nucleus = finite & ~few & (row_top_p < 1.0) & (vocab_size > MIN_CANDIDATES)
    top = torch.full_like(floor, float("-inf"))
    for group in (few, nucleus, ranked & ~few & ~nucleus):
        group_rows = group.nonzero().squeeze(1)
        if group_rows.numel() == 0:
            continue
        masked = _min_p_masked(scaled.index_select(0, group_rows), floor[group_rows])
        k, p = row_top_k[group_rows], row_top_p[group_rows]
        if group is few:
            num_candidates = min(vocab_size, max(MIN_CANDIDATES, int(kept_by_k[group_rows].max())))
            top[group_rows] = _top_thresholds(masked, k, p, num_candidates)
        elif group is nucleus:
            top[group_rows] = _nucleus_thresholds(masked, k, p)
        else:
            top[group_rows] = _top_thresholds(masked, k, p, vocab_size)
    return torch.maximum(floor, top)


def _min_p_masked(
    scaled: torch.Tensor,  # [n, vocab_size] float32, a copy: masked in place
    floor: torch.Tensor,  # [n] float32: each row's min-p threshold
) -> torch.Tensor:  # scaled
    return scaled.masked_fill_(scaled < floor[:, None], float("-inf"))


def _nucleus_thresholds(
    scaled: torch.Tensor,  # [n, vocab_size] float32, min-p masked
    top_k: torch.Tensor,  # [n] int32
    top_p: torch.Tensor,  # [n] float32 < 1
) -> torch.Tensor:  # [n] float32
    """The reference's top-p thresholds of rows with every max finite. A row whose head
    (its finite values down to NEGLIGIBLE_SPAN below the 16th largest) is narrow sorts a
    copy with the rest masked to -inf, which sorts faster, and the reference's ops run on
    the widest such head alone; a row whose kept set may reach past its head is redone in
    full, as are the rows whose heads are wide (most of a row at temperature 1)."""
    vocab_size = scaled.shape[1]
    cut = torch.topk(scaled, MIN_CANDIDATES, dim=-1).values[:, -1] - NEGLIGIBLE_SPAN
    # -inf is never in a head, even below a row whose 16th largest is -inf
    is_head = scaled >= cut.clamp(min=torch.finfo(torch.float32).min)[:, None]
    head_sizes = is_head.view(torch.uint8).sum(dim=-1, dtype=torch.int32).long()
    narrow = head_sizes * MAX_HEAD_FRACTION <= vocab_size
    top = torch.empty_like(cut)
    full = (~narrow).nonzero().squeeze(1)
    narrow_rows = narrow.nonzero().squeeze(1)
    if narrow_rows.numel():
        heads = scaled.index_select(0, narrow_rows)
        heads.masked_fill_(~is_head.index_select(0, narrow_rows), float("-inf"))
        ranked = torch.sort(heads, dim=-1, descending=True).values
        sizes = head_sizes.index_select(0, narrow_rows)
        width = max(MIN_CANDIDATES, int(sizes.max()))
        found = thresholds_of_ranked(ranked[:, :width], top_k[narrow_rows], top_p[narrow_rows])
        top[narrow_rows] = found
        smallest_in_head = ranked.gather(1, (sizes - 1)[:, None]).squeeze(1)
        # a row with no finite value below its cut (fewer than 16 finite) lost nothing
        may_reach_tail = (found <= smallest_in_head) & (
            cut.index_select(0, narrow_rows) > float("-inf")
        )
        full = torch.cat([full, narrow_rows[may_reach_tail]])
    if full.numel():
        top[full] = _top_thresholds(
            scaled.index_select(0, full), top_k[full], top_p[full], vocab_size
        )
    return top


def _top_thresholds(
    scaled: torch.Tensor,  # [n, vocab_size] float32, min-p masked
    top_k: torch.Tensor,  # [n] int32
    top_p: torch.Tensor,  # [n] float32
    num_candidates: int,
) -> torch.Tensor:  # [n] float32
    """The reference's top-k/top-p thresholds of these rows."""
    identity = torch.arange(scaled.shape[0], dtype=torch.int32, device=scaled.device)
    return top_k_top_p_thresholds(scaled, identity, top_k, top_p, num_candidates)
