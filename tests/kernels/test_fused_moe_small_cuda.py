"""fused_moe on a GPU: the interpreter's small cases, the grouping and the early exit of
blocks past the padded count, and CUDA-graph replay following new routing."""

from __future__ import annotations

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
from tests.kernels._fused_moe_cuda import (
    has_fp8_conversions,
    needs_fp8,
    return_cached_memory,  # noqa: F401  (an autouse fixture)
)
from tests.kernels._triton_interpreter import cuda_test


@cuda_test
def test_small_cases_and_grouping_on_cuda() -> None:
    fp8_ok = has_fp8_conversions()
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
