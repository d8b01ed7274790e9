"""add_rms_norm: the definition, the fused residual add, Triton vs reference."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import add_rms_norm, add_rms_norm_ref, add_rms_norm_triton
from tests.kernels._fused_tolerance import assert_matches_reference
from tests.kernels._triton_interpreter import assert_interpreted, triton_vs_reference_tests

EPS = 1e-6


def _inputs(
    num_rows: int, hidden: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=generator) * 3
    residual = torch.randn(num_rows, hidden, generator=generator) * 10
    weight = torch.randn(hidden, generator=generator)
    return x.to(dtype).to(device), residual.to(dtype).to(device), weight.to(dtype).to(device)


def test_reference_is_rms_norm_of_the_sum_and_returns_the_sum() -> None:
    x, residual, weight = _inputs(4, 32, torch.float64)
    normed, new_residual = add_rms_norm_ref(x, residual, weight, EPS)
    total = x + residual
    expected = weight * total / torch.sqrt(total.pow(2).mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(normed, expected)
    assert torch.equal(new_residual, total)
    normed_alone, same = add_rms_norm_ref(x, None, weight, EPS)
    assert same is x
    torch.testing.assert_close(
        normed_alone, weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    )


def test_bf16_reference_rounds_where_transformers_rounds() -> None:
    x, residual, weight = _inputs(3, 64, torch.bfloat16)
    normed, new_residual = add_rms_norm_ref(x, residual, weight, EPS)
    total = residual + x  # the model's bf16 add
    variance = total.float().pow(2).mean(-1, keepdim=True)
    expected = weight * (total.float() * torch.rsqrt(variance + EPS)).to(torch.bfloat16)
    assert torch.equal(new_residual, total) and torch.equal(normed, expected)


def test_bad_arguments_name_the_culprit() -> None:
    x, residual, weight = _inputs(2, 8, torch.float32)
    with pytest.raises(ValueError, match="weight has 4 entries"):
        add_rms_norm(x, None, weight[:4], EPS)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm(x, residual.double(), weight, EPS)
    with pytest.raises(ValueError, match="must match x"):
        add_rms_norm(x, residual[:1], weight, EPS)


def _compare(num_rows: int, hidden: int, device: str) -> None:
    if device == "cpu":
        from kernels import rms_norm as module

        assert_interpreted(module._rms_norm_kernel)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, residual, weight = _inputs(num_rows, hidden, dtype, device, seed=hidden)
        for res in (None, residual):
            expected, expected_residual = add_rms_norm_ref(x, res, weight, EPS)
            actual, actual_residual = add_rms_norm_triton(x, res, weight, EPS)
            assert_matches_reference(actual, expected)
            if res is not None:  # one rounded add: exact wherever bf16 rounds to nearest
                assert_matches_reference(actual_residual, expected_residual)


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 5, "hidden": 40, "device": "cpu"},
        on_cuda={"num_rows": 1031, "hidden": 1024, "device": "cuda"},
    )
)
