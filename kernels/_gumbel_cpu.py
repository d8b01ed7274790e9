"""The CPU path of kernels/gumbel_sample.py: `gumbel_sample_ref`'s draws, bit for bit,
with noise for a few tokens of each row instead of the whole vocabulary.

A sampled row draws argmax_v fl(s_v + g_v) (s: its scores after the temperature and the
threshold, g: the noise), the first such v on ties. The noise never exceeds `max_noise`
(the largest value it takes over its 2**23 inputs, computed with the same float32 logs),
and rounding is monotone, so once some tokens' noised scores are known, with best L, a
token with fl(s_v + max_noise) < L has fl(s_v + g_v) < L: it cannot be drawn. So for
each such row:
1. candidates: the tokens of the 64-token blocks whose max lies within CANDIDATE_SPAN of
   the row's max score; their noised scores give L (finite: the row's max is among them);
2. contenders: the tokens that may still reach L (`_reach_cut`), the winner among them;
   their noised scores are computed exactly as the reference computes them.
The noise reaches 16.6 where it typically lies near 0.6, so at temperature 1 the
contenders are the tokens within about 15 of the max: 2-20% of the embedded model's
49152, against every token in the reference (whose 150 rows took 670 ms a step).

Rows whose max score is not finite (a NaN, +inf, or every token at -inf) take the
reference's dense draw; greedy rows take the argmax, as in the reference.
"""

from __future__ import annotations

import torch

from kernels._gumbel_hash import (
    as_int32,
    gumbel_noise_ref,
    max_noise,
    mix32_int32_,
    noise_of_top_bits,
    step_key_ref,
    token_factors_int32,
)

BLOCK = 64
CANDIDATE_SPAN = 3.0
"""Step 1 takes the blocks whose max lies within this of the row's max score (any span
is exact; this one keeps step 1 to a few blocks a row while its L comes close to the
row's final max)."""
_CUT_MARGIN = 1e-4
"""Relative margin of `_reach_cut`, far above float32 rounding (2**-24)."""


def draw_cpu(
    scores: torch.Tensor,  # [num_rows, vocab_size] float32: after temperature and threshold
    is_greedy: torch.Tensor,  # [num_rows] bool
    row_seed: torch.Tensor,  # [num_rows] int64: each logit row's request seed
    positions: torch.Tensor,  # [num_rows] int64
) -> torch.Tensor:  # [num_rows] int64
    """`gumbel_sample_ref`'s draw of `scores` (see the module doc)."""
    num_rows, vocab_size = scores.shape
    if num_rows == 0 or bool(is_greedy.all()):
        return scores.argmax(dim=1)
    sampled = torch.empty(num_rows, dtype=torch.int64, device=scores.device)
    block_max = (
        scores.view(num_rows, -1, BLOCK).amax(dim=2) if vocab_size % BLOCK == 0 else None
    )  # [num_rows, vocab_size / BLOCK]
    row_max = (scores if block_max is None else block_max).amax(dim=1)
    sparse = ~is_greedy & torch.isfinite(row_max)
    dense = ~is_greedy & ~sparse
    if bool(is_greedy.any()):
        rows = is_greedy.nonzero().squeeze(1)
        sampled[rows] = scores[rows].argmax(dim=1)
    if bool(dense.any()):
        rows = dense.nonzero().squeeze(1)
        noise = gumbel_noise_ref(row_seed[rows], positions[rows], vocab_size)
        sampled[rows] = (scores[rows] + noise).argmax(dim=1)
    if bool(sparse.any()):
        keys = as_int32(step_key_ref(row_seed, positions))
        # A NaN selects nothing: the rows drawn above take no part below.
        row_max = torch.where(sparse, row_max, float("nan"))
        best = _candidate_best(scores, block_max, row_max, keys)
        reaches = torch.ge(scores, _reach_cut(best)[:, None].expand_as(scores))
        rows, tokens = reaches.nonzero(as_tuple=True)
        _first_argmax_into(sampled, rows, tokens, _noised_at(scores, rows, tokens, keys))
    return sampled


def _candidate_best(
    scores: torch.Tensor,  # [num_rows, vocab_size] float32
    block_max: torch.Tensor | None,  # [num_rows, vocab_size / BLOCK] float32
    row_max: torch.Tensor,  # [num_rows] float32; NaN: a row left out
    keys: torch.Tensor,  # [num_rows] int32
) -> torch.Tensor:  # [num_rows] float32: step 1's L; NaN where left out
    """The best noised score among each row's candidates (step 1 of the module doc)."""
    cut = row_max[:, None] - CANDIDATE_SPAN
    if block_max is None:
        rows, tokens = torch.ge(scores, cut.expand_as(scores)).nonzero(as_tuple=True)
    else:
        rows, blocks = (block_max >= cut).nonzero(as_tuple=True)
        offsets = torch.arange(BLOCK, device=scores.device)
        tokens = (blocks[:, None] * BLOCK + offsets).view(-1)
        rows = rows.repeat_interleave(BLOCK)
    best = torch.full_like(row_max, float("-inf"))
    best.scatter_reduce_(0, rows, _noised_at(scores, rows, tokens, keys), "amax")
    return torch.where(torch.isnan(row_max), row_max, best)


def _reach_cut(
    best: torch.Tensor,  # [num_rows] float32, finite or NaN
) -> torch.Tensor:  # [num_rows] float32
    """A score below which no token reaches `best`: s < cut implies
    fl(s + max_noise) < best (a NaN cut: no token)."""
    best64 = best.double()
    cut64 = best64 - max_noise(best.device) - _CUT_MARGIN * (best64.abs() + 1.0)
    # float32 rounds to nearest: one step down keeps the cut at or below cut64
    return torch.nextafter(cut64.float(), torch.tensor(float("-inf"), device=best.device))


def _noised_at(
    scores: torch.Tensor,  # [num_rows, vocab_size] float32, contiguous
    rows: torch.Tensor,  # [n] int64
    tokens: torch.Tensor,  # [n] int64
    keys: torch.Tensor,  # [num_rows] int32: each row's step key
) -> torch.Tensor:  # [n] float32
    """The noised scores at (rows, tokens), as the reference computes them."""
    vocab_size = scores.shape[1]
    factors = token_factors_int32(vocab_size, scores.device)
    hashed = keys.index_select(0, rows) ^ factors.index_select(0, tokens)
    top_bits = torch.bitwise_right_shift(mix32_int32_(hashed), 9).bitwise_and_(0x7FFFFF)
    flat = rows * vocab_size + tokens
    return scores.view(-1).index_select(0, flat) + noise_of_top_bits(top_bits)


def _first_argmax_into(
    sampled: torch.Tensor,  # [num_rows] int64, written at the rows present in `rows`
    rows: torch.Tensor,  # [n] int64, ascending
    tokens: torch.Tensor,  # [n] int64
    noised: torch.Tensor,  # [n] float32, no NaN
) -> None:
    """Each row's first token of largest noised score, as argmax picks it."""
    best = torch.full(sampled.shape, float("-inf"), device=noised.device)
    best.scatter_reduce_(0, rows, noised, "amax")
    is_best = noised == best.index_select(0, rows)
    first = torch.full_like(sampled, -1)
    first.scatter_reduce_(0, rows[is_best], tokens[is_best], "amin", include_self=False)
    present = torch.unique_consecutive(rows)
    sampled[present] = first[present]
