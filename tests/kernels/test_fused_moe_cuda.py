"""fused_moe on a GPU at gpt-oss-20b (MXFP4 experts) and Qwen3-30B-A3B (bf16) shapes:
Triton against the reference. FP8 experts: test_fused_moe_fp8_cuda.py; the interpreter's
small cases, grouping and CUDA-graph replay: test_fused_moe_small_cuda.py."""

from __future__ import annotations

import pytest

from tests.kernels._fused_moe_cases import compare_fused
from tests.kernels._fused_moe_cuda import (
    GPT_OSS_20B,
    QWEN3_30B,
    at_num_tokens,
    return_cached_memory,  # noqa: F401  (an autouse fixture)
)
from tests.kernels._triton_interpreter import cuda_test


@cuda_test
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_gpt_oss_20b_shapes_on_cuda(num_tokens: int) -> None:
    compare_fused("cuda", [at_num_tokens(GPT_OSS_20B, num_tokens)])


@cuda_test
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_qwen3_30b_a3b_shapes_on_cuda(num_tokens: int) -> None:
    compare_fused("cuda", [at_num_tokens(QWEN3_30B, num_tokens)])
