"""fused_moe on a GPU: Triton against the reference at gpt-oss-20b and Qwen3-30B-A3B
shapes (bf16, MXFP4 and FP8 experts) and on the interpreter's small cases, the grouping and
the early exit of blocks past the padded count, and CUDA-graph replay following new routing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels.fused_moe import fused_moe, fused_moe_ref
from tests.kernels._fused_moe_cases import (
    SWIGLU,
    _assert_close_to_reference,
    _case,
    _interpreter_cases,
    check_blocks_past_the_padded_count_exit,
    compare_fused,
    compare_grouping,
)
from tests.kernels._triton_interpreter import cuda_test

_GPT_OSS_20B = dict(
    shape=(0, 2880, 2880, 32, 4), dtype="bfloat16", activation="swiglu_clamped", mxfp4=True
)
_QWEN3_30B = dict(shape=(0, 2048, 768, 128, 8), dtype="bfloat16", activation="silu", bias=False)


@pytest.fixture(autouse=True)
def _return_cached_memory() -> Iterator[None]:
    """Model-shaped cases cache gigabytes in torch's allocator; the GPU lane runs other test
    processes beside this one, which need that memory back."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _at(case: dict, num_tokens: int) -> dict:
    return {**case, "shape": (num_tokens, *case["shape"][1:])}


@cuda_test
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_gpt_oss_20b_shapes_on_cuda(num_tokens: int) -> None:
    compare_fused("cuda", [_at(_GPT_OSS_20B, num_tokens)])


@cuda_test
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_qwen3_30b_a3b_shapes_on_cuda(num_tokens: int) -> None:
    compare_fused("cuda", [_at(_QWEN3_30B, num_tokens)])


def _has_fp8_conversions() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(
    not _has_fp8_conversions(), reason="needs compute capability >= 8.9 (e4m3 conversions)"
)


@cuda_test
@needs_fp8
@pytest.mark.parametrize("fp8", ["block", "channel"])
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_qwen3_30b_a3b_fp8_shapes_on_cuda(num_tokens: int, fp8: str) -> None:
    """Qwen3-30B-A3B-FP8's experts (intermediate 768: six 128-row blocks a half)."""
    compare_fused("cuda", [_at({**_QWEN3_30B, "fp8": fp8}, num_tokens)])


@cuda_test
def test_small_cases_and_grouping_on_cuda() -> None:
    fp8_ok = _has_fp8_conversions()  # e4m3 conversions: compute capability >= 8.9
    compare_fused("cuda", [c for c in _interpreter_cases() if fp8_ok or "fp8" not in c])
    compare_grouping("cuda", [(1, 128, 8, 16), (2048, 128, 8, 128), (4096, 32, 4, 64)])
    check_blocks_past_the_padded_count_exit("cuda")


@cuda_test
@pytest.mark.parametrize("kind", ["plain", "mxfp4", pytest.param("fp8_block", marks=needs_fp8)])
def test_cuda_graph_replay_follows_new_routing(kind: str) -> None:
    num_tokens, num_experts, top_k = 8, 32, 4
    weights = {"plain": {}, "mxfp4": {"mxfp4": True}, "fp8_block": {"fp8": "block"}}[kind]
    x, w, ids, w13, w2, b13, b2 = _case(
        num_tokens, 256, 128, num_experts, top_k, torch.bfloat16, device="cuda", **weights
    )
    fused_moe(x, w, ids, w13, w2, b13, b2, SWIGLU)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w, ids, w13, w2, b13, b2, SWIGLU)
    generator = torch.Generator().manual_seed(7)
    for replay in range(4):
        routing = torch.rand(num_tokens, num_experts, generator=generator).argsort(-1)[:, :top_k]
        if replay == 3:
            routing[:] = torch.arange(top_k)  # every token to the same experts
        ids.copy_(routing.to(torch.int32))
        w.copy_(torch.softmax(torch.randn(num_tokens, top_k, generator=generator), -1))
        x.copy_(torch.randn(num_tokens, 256, generator=generator))
        graph.replay()
        _assert_close_to_reference(out, fused_moe_ref(x, w, ids, w13, w2, b13, b2, SWIGLU))
