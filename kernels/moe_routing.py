"""Router top-k of a mixture-of-experts layer: softmax over the experts, the top_k
largest probabilities and their expert ids, optionally renormalised to sum to 1.

    router_logits: [num_tokens, num_experts]  ->  topk_weights [num_tokens, top_k] float32,
                                                  topk_ids [num_tokens, top_k] int32

Qwen3-MoE renormalises when `norm_topk_prob` is set; gpt-oss's top-k of the logits followed
by a softmax over the k values equals renormalize=True. The Triton kernel holds a block of
token rows with all their experts in registers (one launch, no sort); it selects on the
logits, which order the experts exactly as the probabilities do, so rounding in the
softmax cannot reorder near-equal experts.
"""

from __future__ import annotations

import torch

from kernels._checks import check_dtype_and_rank, check_triton_device, need_triton
from kernels._triton import HAS_TRITON, tl, triton

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_TILE_ELEMENTS = 4096  # token rows x padded experts held by one program

if HAS_TRITON:

    @triton.jit
    def _moe_route_kernel(
        logits_ptr,
        weights_ptr,
        ids_ptr,
        num_tokens,
        num_experts,
        logits_stride,
        TOP_K: tl.constexpr,
        TOP_K_PAD: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        EXPERTS_PAD: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, EXPERTS_PAD)
        row_ok = rows < num_tokens
        mask = row_ok[:, None] & (experts[None, :] < num_experts)
        logits = tl.load(
            logits_ptr + rows[:, None].to(tl.int64) * logits_stride + experts[None, :],
            mask=mask,
            other=-float("inf"),
        ).to(tl.float32)
        row_max = tl.max(logits, axis=1)
        denom = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)
        slots = tl.arange(0, TOP_K_PAD)
        chosen_w = tl.zeros([BLOCK_T, TOP_K_PAD], dtype=tl.float32)
        chosen_id = tl.zeros([BLOCK_T, TOP_K_PAD], dtype=tl.int32)
        remaining = logits
        for slot in tl.static_range(TOP_K):
            best, best_id = tl.max(
                remaining, axis=1, return_indices=True, return_indices_tie_break_left=True
            )
            prob = tl.exp(best - row_max) / denom
            chosen_w = tl.where(slots[None, :] == slot, prob[:, None], chosen_w)
            chosen_id = tl.where(slots[None, :] == slot, best_id[:, None], chosen_id)
            remaining = tl.where(experts[None, :] == best_id[:, None], -float("inf"), remaining)
        if RENORMALIZE:
            chosen_w = chosen_w / tl.sum(chosen_w, axis=1)[:, None]
        out_offsets = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
        out_mask = row_ok[:, None] & (slots[None, :] < TOP_K)
        tl.store(weights_ptr + out_offsets, chosen_w, mask=out_mask)
        tl.store(ids_ptr + out_offsets, chosen_id, mask=out_mask)


def _check_args(router_logits: torch.Tensor, top_k: int) -> tuple[int, int]:
    check_dtype_and_rank("router_logits", router_logits, _FLOAT_DTYPES, 2)
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    return num_tokens, num_experts


def moe_route_ref(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] float32 or model dtype
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32, [num_tokens, top_k] int32
    """Torch reference of `moe_route`."""
    _check_args(router_logits, top_k)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_route_triton(
    router_logits: torch.Tensor,  # [num_tokens, num_experts], rows contiguous
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32, [num_tokens, top_k] int32
    """Triton launcher of `moe_route`: one program per block of token rows."""
    need_triton("moe_route_triton")
    num_tokens, num_experts = _check_args(router_logits, top_k)
    check_triton_device("moe_route_triton", router_logits.device)
    if router_logits.stride(1) != 1:
        raise ValueError("router_logits rows must be contiguous")
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    experts_pad = triton.next_power_of_2(num_experts)
    block_t = max(1, min(64, _MAX_TILE_ELEMENTS // experts_pad))
    _moe_route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        weights,
        ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        EXPERTS_PAD=experts_pad,
    )
    return weights, ids


def moe_route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] float32 or model dtype
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32, [num_tokens, top_k] int32
    """(topk_weights, topk_ids) of softmax(router_logits): the Triton kernel on CUDA, the
    torch reference otherwise."""
    if HAS_TRITON and router_logits.is_cuda and router_logits.dim() == 2:
        if router_logits.stride(-1) == 1:
            return moe_route_triton(router_logits, top_k, renormalize)
    return moe_route_ref(router_logits, top_k, renormalize)
