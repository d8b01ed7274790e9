"""What the fused MoE CUDA test files share: the model-shaped cases, the FP8 marker and a
fixture that hands cached memory back. The CUDA tests are split over three files so the GPU
lane can deal them to different parts: compiling every tile they use took one part of the
lane past its time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

GPT_OSS_20B = dict(
    shape=(0, 2880, 2880, 32, 4), dtype="bfloat16", activation="swiglu_clamped", mxfp4=True
)
QWEN3_30B = dict(shape=(0, 2048, 768, 128, 8), dtype="bfloat16", activation="silu", bias=False)


def at_num_tokens(case: dict, num_tokens: int) -> dict:
    return {**case, "shape": (num_tokens, *case["shape"][1:])}


def has_fp8_conversions() -> bool:
    """e4m3 conversions: compute capability >= 8.9."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(
    not has_fp8_conversions(), reason="needs compute capability >= 8.9 (e4m3 conversions)"
)


@pytest.fixture(autouse=True)
def return_cached_memory() -> Iterator[None]:
    """Model-shaped cases cache gigabytes in torch's allocator; the GPU lane runs other test
    processes beside this one, which need that memory back. Imported by each file."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
