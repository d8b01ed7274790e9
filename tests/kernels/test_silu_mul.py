"""silu_mul: the definition, Triton vs reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.silu_mul import silu_mul, silu_mul_ref, silu_mul_triton
from tests.kernels._fused_tolerance import assert_matches_reference
from tests.kernels._triton_interpreter import assert_interpreted, triton_vs_reference_tests


def test_reference_is_silu_of_the_first_half_times_the_second() -> None:
    gate_up = torch.randn(3, 10, dtype=torch.float64) * 4
    gate, up = gate_up[:, :5], gate_up[:, 5:]
    torch.testing.assert_close(silu_mul_ref(gate_up), gate / (1 + torch.exp(-gate)) * up)
    assert silu_mul(gate_up.float()).shape == (3, 5)


def test_odd_widths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_mul(torch.zeros(2, 7))
    assert torch.equal(
        silu_mul_ref(torch.zeros(2, 4, dtype=torch.bfloat16)),
        F.silu(torch.zeros(2, 2, dtype=torch.bfloat16)),
    )


def _compare(num_rows: int, intermediate: int, device: str) -> None:
    if device == "cpu":
        from kernels import silu_mul as module

        assert_interpreted(module._silu_mul_kernel)
    generator = torch.Generator().manual_seed(intermediate)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gate_up = (
            (torch.randn(num_rows, 2 * intermediate, generator=generator) * 4).to(dtype).to(device)
        )
        assert_matches_reference(silu_mul_triton(gate_up), silu_mul_ref(gate_up))


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 3, "intermediate": 1100, "device": "cpu"},
        on_cuda={"num_rows": 515, "intermediate": 3072, "device": "cuda"},
    )
)
