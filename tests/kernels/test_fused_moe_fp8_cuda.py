"""fused_moe on a GPU with FP8 experts at Qwen3-30B-A3B-FP8's shapes: Triton against the
reference, per-channel and 128x128 block scales."""

from __future__ import annotations

import pytest

from tests.kernels._fused_moe_cases import compare_fused
from tests.kernels._fused_moe_cuda import (
    QWEN3_30B,
    at_num_tokens,
    needs_fp8,
    return_cached_memory,  # noqa: F401  (an autouse fixture)
)
from tests.kernels._triton_interpreter import cuda_test


@cuda_test
@needs_fp8
@pytest.mark.parametrize("fp8", ["block", "channel"])
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_qwen3_30b_a3b_fp8_shapes_on_cuda(num_tokens: int, fp8: str) -> None:
    """Qwen3-30B-A3B-FP8's experts (intermediate 768: six 128-row blocks a half)."""
    compare_fused("cuda", [at_num_tokens({**QWEN3_30B, "fp8": fp8}, num_tokens)])
