"""moe_route: the definition, Triton vs reference."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_routing import moe_route, moe_route_ref, moe_route_triton
from tests.kernels._triton_interpreter import assert_interpreted, triton_vs_reference_tests


def test_reference_is_softmax_then_topk() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 1.0]])
    weights, ids = moe_route_ref(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.dtype == torch.int32 and ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    renormalised, same_ids = moe_route(logits, 2, renormalize=True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(renormalised, weights / weights.sum(-1, keepdim=True))


def test_renormalize_equals_gpt_oss_softmax_over_the_top_logits() -> None:
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    top_logits, top_ids = torch.topk(logits, 4, dim=-1)
    weights, ids = moe_route_ref(logits.bfloat16(), 4, renormalize=True)
    assert torch.equal(ids.long(), torch.topk(logits.bfloat16().float(), 4).indices)
    expected = torch.softmax(logits.bfloat16().float().gather(1, ids.long()), dim=-1)
    torch.testing.assert_close(weights, expected)
    assert weights.dtype == torch.float32 and torch.equal(ids.long(), top_ids)


def test_top_k_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="top_k"):
        moe_route_ref(torch.zeros(2, 4), 5, renormalize=True)
    with pytest.raises(ValueError, match="2-D"):
        moe_route_ref(torch.zeros(4), 1, renormalize=True)


def _compare(cases: list[tuple[int, int, int]], device: str) -> None:
    if device == "cpu":
        from kernels import moe_routing as module

        assert_interpreted(module._moe_route_kernel)
    generator = torch.Generator().manual_seed(1)
    for num_tokens, num_experts, top_k in cases:
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(num_tokens, num_experts, generator=generator) * 3).to(dtype)
            logits = logits.to(device)
            for renormalize in (False, True):
                weights, ids = moe_route_triton(logits, top_k, renormalize)
                ref_weights, _ = moe_route_ref(logits, top_k, renormalize)
                torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
                # ids may differ only between experts of equal probability
                probs = torch.softmax(logits.float(), dim=-1)
                chosen = probs.gather(1, ids.long())
                if renormalize:
                    chosen = chosen / chosen.sum(-1, keepdim=True)
                torch.testing.assert_close(chosen, ref_weights, rtol=1e-5, atol=1e-6)
                assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "duplicate expert ids"
    # well separated logits: exactly torch.topk's ids, in its order
    logits = torch.randperm(64, generator=generator).float().view(4, 16).to(device) * 0.5
    assert torch.equal(moe_route_triton(logits, 4, True)[1], moe_route_ref(logits, 4, True)[1])
    # equal logits: distinct ids all the same
    ties = torch.zeros(3, 8, device=device)
    weights, ids = moe_route_triton(ties, 4, False)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 8))


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"cases": [(1, 8, 2), (17, 8, 4), (3, 128, 8), (5, 32, 4)], "device": "cpu"},
        on_cuda={
            "cases": [(1, 32, 4), (64, 128, 8), (2048, 128, 8), (2048, 32, 4)],
            "device": "cuda",
        },
    )
)
