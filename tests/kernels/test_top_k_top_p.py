"""apply_top_k_top_p: hand-computed cases, Triton vs reference (interpreter and CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.top_k_top_p import (
    apply_top_k_top_p,
    apply_top_k_top_p_ref,
    apply_top_k_top_p_triton,
)
from tests.kernels._triton_interpreter import triton_vs_reference_tests

# Probabilities 0.4, 0.3, 0.2, 0.1 at shuffled token ids 2, 0, 3, 1.
LOGITS = torch.tensor([[math.log(0.3), math.log(0.1), math.log(0.4), math.log(0.2)]])


def _kept(top_k: int, top_p: float, num_candidates: int = 4) -> list[int]:
    logits = LOGITS.clone()
    apply_top_k_top_p(
        logits,
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([top_k], dtype=torch.int32),
        torch.tensor([top_p]),
        num_candidates,
    )
    return torch.nonzero(~torch.isinf(logits[0])).flatten().tolist()


def test_top_k_keeps_the_k_largest() -> None:
    assert _kept(top_k=2, top_p=1.0) == [0, 2]
    assert _kept(top_k=1, top_p=1.0, num_candidates=1) == [2]


def test_top_p_keeps_the_smallest_prefix_that_reaches_p() -> None:
    assert _kept(top_k=0, top_p=0.35) == [2]  # 0.4 alone reaches 0.35
    assert _kept(top_k=0, top_p=0.5) == [0, 2]  # 0.4 < 0.5, then 0.7
    assert _kept(top_k=0, top_p=0.75) == [0, 2, 3]  # 0.7 < 0.75, then 0.9


def test_top_p_renormalises_over_the_top_k_survivors() -> None:
    # Top 3 renormalised: 0.444, 0.333, 0.222; p 0.6 keeps two (0.444 < 0.6, 0.778 >= 0.6).
    assert _kept(top_k=3, top_p=0.6, num_candidates=3) == [0, 2]


def test_disabled_rows_are_untouched() -> None:
    assert _kept(top_k=0, top_p=1.0) == [0, 1, 2, 3]


def test_topk_candidates_and_full_sort_agree() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=generator) * 3
    top_k = torch.tensor([0, 10, 50, 7], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.8, 0.3, 1.0])
    idx_mapping = torch.tensor([1, 2, 3, 0, 2, 1], dtype=torch.int32)
    via_topk, via_sort = logits.clone(), logits.clone()
    apply_top_k_top_p_ref(via_topk, idx_mapping, top_k, top_p, num_candidates=50)
    apply_top_k_top_p_ref(via_sort, idx_mapping, top_k, top_p, num_candidates=500)
    assert torch.equal(via_topk, via_sort)
    assert (~torch.isinf(via_topk[3])).sum() == 500  # request row 0 filters nothing
    assert (~torch.isinf(via_topk[2])).sum() == 7


def test_bad_arguments_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="num_candidates"):
        apply_top_k_top_p(
            torch.zeros(1, 4),
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            torch.ones(1),
            0,
        )
    with pytest.raises(ValueError, match="top_k must be torch.int32"):
        apply_top_k_top_p(
            torch.zeros(1, 4), torch.zeros(1, dtype=torch.int32), torch.zeros(1), torch.ones(1), 4
        )


def _compare(num_rows: int, vocab_size: int, device: str, block_size: int | None) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    top_k = torch.tensor([0, 5, 40, 0, 20], dtype=torch.int32).to(device)
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.95]).to(device)
    idx_mapping = torch.randint(0, 5, (num_rows,), generator=generator, dtype=torch.int32).to(
        device
    )
    logits = (torch.randn(num_rows, vocab_size, generator=generator) * 3).to(device)
    for num_candidates in (vocab_size, 40):
        rows = idx_mapping if num_candidates == vocab_size else idx_mapping.clamp(min=1)
        expected, actual = logits.clone(), logits.clone()
        apply_top_k_top_p_ref(expected, rows, top_k, top_p, num_candidates)
        kwargs = {} if block_size is None else {"block_size": block_size}
        apply_top_k_top_p_triton(actual, rows, top_k, top_p, num_candidates, **kwargs)
        assert torch.equal(actual, expected)


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 5, "vocab_size": 300, "device": "cpu", "block_size": 128},
        on_cuda={"num_rows": 256, "vocab_size": 151936, "device": "cuda", "block_size": None},
    )
)
