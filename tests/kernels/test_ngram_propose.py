"""ngram_propose: hand-checked histories, a plain-Python oracle on random histories,
argument checks, and Triton vs reference (interpreter and CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.ngram_propose import ngram_propose, ngram_propose_ref, ngram_propose_triton
from tests.kernels._triton_interpreter import triton_vs_reference_tests


def oracle(tokens: list[int], k: int, min_n: int, max_n: int, max_model_len: int) -> list[int]:
    """The module doc's rule, written as directly as possible: n from max_n down to min_n,
    of the earlier occurrences of the last n tokens that leave a token to draft the one
    that drafts the most, the latest of those."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > total:
            continue
        suffix = tokens[total - n :]
        starts = [s for s in range(total - n) if tokens[s : s + n] == suffix]
        if starts:
            num_drafts = [min(k, total - (s + n), max_model_len - total) for s in starts]
            _, start = max(zip(num_drafts, starts))
            num = min(k, total - (start + n), max_model_len - total)
            return tokens[start + n : start + n + max(num, 0)]
    return []


def _history(rows: list[list[int]], max_model_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    token_ids = torch.full((len(rows), max_model_len), 7777, dtype=torch.int32)
    for r, tokens in enumerate(rows):
        token_ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    total_len = torch.tensor([len(t) for t in rows], dtype=torch.int32)
    return token_ids, total_len


def _propose(
    impl,
    rows: list[list[int]],
    k: int,
    min_n: int,
    max_n: int,
    max_model_len: int = 32,
    order: list[int] | None = None,
    **kwargs,
) -> list[list[int]]:
    token_ids, total_len = _history(rows, max_model_len)
    order = list(range(len(rows))) if order is None else order
    idx_mapping = torch.tensor(order, dtype=torch.int32)
    drafts, num_drafts = impl(token_ids, total_len, idx_mapping, k, min_n, max_n, **kwargs)
    assert drafts.shape == (len(order), k) and drafts.dtype == torch.int32
    out = []
    for b in range(len(order)):
        n = int(num_drafts[b])
        assert (drafts[b, n:] == -1).all()
        out.append(drafts[b, :n].tolist())
    return out


CRAFTED = [
    # (tokens, k, min_n, max_n, max_model_len, expected drafts)
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, 32, [4, 2, 3]),  # vLLM's doc example: [2,3] matches, 3 follow
    ([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2, 1, 3, 32, [8, 5]),  # latest of two 3-gram hits
    ([5, 6, 7, 1, 6, 7, 2, 7], 3, 1, 3, 32, [1, 6, 7]),  # 1-gram [7]: the hit drafting 3
    ([5, 7, 1, 6, 0, 7, 2, 3, 7], 2, 1, 3, 32, [2, 3]),  # both hits draft 2: the latest
    ([5, 6, 7, 1, 6, 7, 2, 7], 3, 2, 3, 32, []),  # min_n 2: nothing
    ([4, 4, 4, 4], 3, 1, 2, 32, [4, 4]),  # a repeated token: the hit that leaves 2 tokens
    ([4, 4, 4, 4, 4, 4, 4], 3, 1, 2, 32, [4, 4, 4]),  # not the latest (1 token) nor earliest
    ([1, 2, 1, 2, 1, 2], 5, 2, 4, 32, [1, 2]),  # 4-gram [1,2,1,2] at start 0 (overlap)
    ([3], 2, 1, 1, 32, []),  # a single token has no earlier occurrence
    ([], 2, 1, 1, 32, []),  # empty row
    ([1, 2, 3, 1, 2], 4, 2, 2, 6, [3]),  # max_model_len - T = 1 caps the drafts
    ([1, 2, 3, 1, 2], 4, 2, 2, 5, []),  # a full context drafts nothing
    ([9, 1, 2, 3, 4, 5, 6, 1, 2], 3, 1, 5, 32, [3, 4, 5]),  # longest available n (2) wins
]


@pytest.mark.parametrize("case", CRAFTED, ids=[str(i) for i in range(len(CRAFTED))])
def test_crafted_histories(case) -> None:
    tokens, k, min_n, max_n, max_model_len, expected = case
    assert oracle(tokens, k, min_n, max_n, max_model_len) == expected
    got = _propose(ngram_propose, [tokens], k, min_n, max_n, max_model_len)
    assert got == [expected]


def test_longer_match_beats_a_later_shorter_one() -> None:
    # [7, 8] occurs at 0 (followed by 1) and the 1-gram [8] later at 5 (followed by 3):
    # the 2-gram is longer, so its continuation wins even though it is earlier.
    tokens = [7, 8, 1, 2, 0, 8, 3, 7, 8]
    assert _propose(ngram_propose, [tokens], 2, 1, 3) == [[1, 2]]


def test_rows_follow_idx_mapping() -> None:
    rows = [[1, 2, 3, 1, 2], [5, 5], [9, 8, 7, 6]]
    got = _propose(ngram_propose, rows, 2, 1, 2, order=[2, 0, 1, 0])
    assert got == [[], [3, 1], [5], [3, 1]]


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_oracle_on_random_histories(seed: int) -> None:
    rng = random.Random(seed)
    max_model_len = 48
    rows = [
        [rng.randrange(4 if r % 2 else 12) for _ in range(rng.randrange(0, 41))] for r in range(24)
    ]
    k, min_n = rng.randint(1, 6), rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    got = _propose(ngram_propose_ref, rows, k, min_n, max_n, max_model_len)
    assert got == [oracle(t, k, min_n, max_n, max_model_len) for t in rows]
    assert any(got), "the random histories should produce some drafts"


def test_bad_arguments_name_the_culprit() -> None:
    token_ids, total_len = _history([[1, 2]], 8)
    idx = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="token_ids must be torch.int32"):
        ngram_propose(token_ids.long(), total_len, idx, 2, 1, 2)
    with pytest.raises(ValueError, match="one length per request row"):
        ngram_propose(token_ids, torch.zeros(3, dtype=torch.int32), idx, 2, 1, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min .3. must not exceed"):
        ngram_propose(token_ids, total_len, idx, 2, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        ngram_propose(token_ids, total_len, idx, 0, 1, 2)


def _compare(num_rows: int, max_model_len: int, device: str, block_size: int | None) -> None:
    rng = random.Random(max_model_len)
    rows = [
        [rng.randrange(3 + r % 5) for _ in range(rng.randrange(0, max_model_len + 1))]
        for r in range(num_rows)
    ]
    rows += [CRAFTED[1][0], CRAFTED[4][0], CRAFTED[10][0]]
    token_ids, total_len = _history(rows, max_model_len)
    token_ids, total_len = token_ids.to(device), total_len.to(device)
    order = list(range(len(rows)))
    rng.shuffle(order)
    idx_mapping = torch.tensor(order, dtype=torch.int32, device=device)
    kwargs = {} if block_size is None else {"block_size": block_size}
    for k, min_n, max_n in ((3, 1, 3), (5, 2, 4), (1, 1, 1)):
        expected = ngram_propose_ref(token_ids, total_len, idx_mapping, k, min_n, max_n)
        actual = ngram_propose_triton(token_ids, total_len, idx_mapping, k, min_n, max_n, **kwargs)
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
        assert int(expected[1].sum()) > 0


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 9, "max_model_len": 40, "device": "cpu", "block_size": 16},
        on_cuda={"num_rows": 300, "max_model_len": 4096, "device": "cuda", "block_size": None},
    )
)
