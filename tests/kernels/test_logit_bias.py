"""apply_logit_bias: bias and min_tokens suppression by hand, Triton vs reference."""

from __future__ import annotations

import pytest
import torch

from kernels.logit_bias import (
    apply_logit_bias,
    apply_logit_bias_ref,
    apply_logit_bias_triton,
)
from tests.kernels._triton_interpreter import triton_vs_reference_tests

NEG_INF = float("-inf")


def _tables() -> dict[str, torch.Tensor]:
    # Request row 0: bias {1: +2, 3: -1}, min_tokens 2, stop ids {0, 3}; row 1: nothing.
    return {
        "num_logit_bias": torch.tensor([2, 0], dtype=torch.int32),
        "logit_bias_token_ids": torch.tensor([[1, 3, 0, 0], [2, 2, 2, 2]], dtype=torch.int32),
        "logit_bias_values": torch.tensor([[2.0, -1.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]]),
        "min_tokens": torch.tensor([2, 0], dtype=torch.int32),
        "num_stop_token_ids": torch.tensor([2, 0], dtype=torch.int32),
        "stop_token_ids": torch.tensor([[0, 3], [1, 1]], dtype=torch.int32),
    }


def test_bias_then_stop_suppression_until_min_tokens() -> None:
    logits = torch.zeros(4, 5)
    idx_mapping = torch.tensor([0, 0, 1, 0], dtype=torch.int32)
    num_output_tokens = torch.tensor([0, 2, 0, 1], dtype=torch.int32)
    apply_logit_bias(logits, idx_mapping, num_output_tokens, **_tables())
    assert logits.tolist() == [
        [NEG_INF, 2.0, 0.0, NEG_INF, 0.0],  # 0 < 2 outputs: stop ids 0 and 3 forbidden
        [0.0, 2.0, 0.0, -1.0, 0.0],  # min_tokens reached: bias only
        [0.0, 0.0, 0.0, 0.0, 0.0],  # row 1: entries past its counts are ignored
        [NEG_INF, 2.0, 0.0, NEG_INF, 0.0],
    ]


def test_positive_bias_does_not_revive_a_suppressed_stop_token() -> None:
    tables = _tables()
    tables["logit_bias_values"][0, 1] = 100.0  # token 3 is also a stop id
    logits = torch.zeros(1, 5)
    apply_logit_bias_ref(
        logits, torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), **tables
    )
    assert logits[0, 3] == NEG_INF


def test_bad_arguments_name_the_culprit() -> None:
    tables = _tables()
    tables["logit_bias_values"] = tables["logit_bias_values"][:, :3].contiguous()
    with pytest.raises(ValueError, match="logit_bias_values must have size 4 in dim 1"):
        apply_logit_bias(
            torch.zeros(1, 5),
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
            **tables,
        )


def _random_tables(
    num_reqs: int, vocab_size: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    bias_width, stop_width = 64, 8
    return {
        "num_logit_bias": torch.tensor([0, 3, 64, 1, 40][:num_reqs], dtype=torch.int32),
        "logit_bias_token_ids": torch.stack(
            [torch.randperm(vocab_size, generator=generator)[:bias_width] for _ in range(num_reqs)]
        ).to(torch.int32),
        "logit_bias_values": torch.randn(num_reqs, bias_width, generator=generator) * 10,
        "min_tokens": torch.tensor([0, 4, 2, 1, 3][:num_reqs], dtype=torch.int32),
        "num_stop_token_ids": torch.tensor([0, 2, 8, 1, 5][:num_reqs], dtype=torch.int32),
        "stop_token_ids": torch.randint(
            0, vocab_size, (num_reqs, stop_width), generator=generator, dtype=torch.int32
        ),
    }


def _compare(num_rows: int, vocab_size: int, device: str) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    tables = {name: t.to(device) for name, t in _random_tables(5, vocab_size, generator).items()}
    idx_mapping = torch.randint(0, 5, (num_rows,), generator=generator, dtype=torch.int32).to(
        device
    )
    num_output_tokens = torch.randint(0, 5, (num_rows,), generator=generator, dtype=torch.int32).to(
        device
    )
    logits = torch.randn(num_rows, vocab_size, generator=generator).to(device)
    original = logits.clone()
    expected = logits.clone()
    apply_logit_bias_ref(expected, idx_mapping, num_output_tokens, **tables)
    apply_logit_bias_triton(logits, idx_mapping, num_output_tokens, **tables)
    assert torch.equal(logits, expected)
    # The case exercises both halves: biased entries and suppressed stop tokens.
    assert ((expected != original) & ~torch.isinf(expected)).any() and torch.isinf(expected).any()


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 6, "vocab_size": 300, "device": "cpu"},
        on_cuda={"num_rows": 256, "vocab_size": 151936, "device": "cuda"},
    )
)
