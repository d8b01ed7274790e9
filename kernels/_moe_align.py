"""Token grouping for the fused MoE GEMMs: the num_tokens * top_k (token, slot) pairs sorted
by expert, each expert's segment padded to a multiple of block_m, so that every block of
block_m rows belongs to one expert.

    topk_ids: [num_tokens, top_k] int32  ->
      sorted_pair_ids  [max_rows] int32: pair index t * top_k + j, or num_pairs (padding)
      block_expert_ids [max_blocks] int32: expert of each block of block_m rows
      num_padded_rows  [1] int32: rows in use; blocks from num_padded_rows / block_m on are
                                  unused and hold garbage

All shapes are static (max_rows = block_m * max_blocks, max_blocks bounds the padded count)
and nothing is read back to the host, so the grouping can be captured in a CUDA graph.
Within an expert, pairs keep their ascending order (a stable sort), computed without atomics,
so the grouping is the same on every run. Two launches: per-expert counts, then per-expert
placement (each program rescans the ids; the scans are short next to the GEMMs).
Expert ids must lie in [0, num_experts): a pair with another id is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import HAS_TRITON, tl, triton

_MAX_SCAN_CHUNK = 1024


@dataclass(frozen=True)
class MoEGrouping:
    sorted_pair_ids: torch.Tensor  # [max_rows] int32
    block_expert_ids: torch.Tensor  # [max_blocks] int32
    num_padded_rows: torch.Tensor  # [1] int32
    block_m: int


def max_num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded blocks: each expert that receives c > 0 pairs takes
    ceil(c / block_m) blocks, and at most min(num_experts, num_pairs) experts receive any."""
    return triton_cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if HAS_TRITON:

    @triton.jit
    def _count_kernel(ids_ptr, counts_ptr, num_pairs, CHUNK: tl.constexpr):
        expert = tl.program_id(0)
        total = tl.zeros([CHUNK], dtype=tl.int32)
        for start in range(0, num_pairs, CHUNK):
            offsets = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offsets, mask=offsets < num_pairs, other=-1)
            total += (ids == expert).to(tl.int32)
        tl.store(counts_ptr + expert, tl.sum(total, axis=0))

    @triton.jit
    def _place_kernel(
        ids_ptr,
        counts_ptr,
        sorted_ptr,
        block_expert_ptr,
        num_padded_ptr,
        num_pairs,
        num_experts,
        BLOCK_M: tl.constexpr,
        EXPERTS_PAD: tl.constexpr,
        CHUNK: tl.constexpr,
        MAX_BLOCKS_PER_EXPERT: tl.constexpr,
    ):
        expert = tl.program_id(0)
        experts = tl.arange(0, EXPERTS_PAD)
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        seg_start = tl.sum(tl.where(experts < expert, padded, 0), axis=0)
        count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
        seg_len = tl.sum(tl.where(experts == expert, padded, 0), axis=0)
        if expert == 0:
            tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        blocks = tl.arange(0, MAX_BLOCKS_PER_EXPERT)
        tl.store(
            block_expert_ptr + seg_start // BLOCK_M + blocks,
            tl.zeros([MAX_BLOCKS_PER_EXPERT], dtype=tl.int32) + expert,
            mask=blocks < seg_len // BLOCK_M,
        )
        pad = tl.arange(0, BLOCK_M)
        tl.store(
            sorted_ptr + seg_start + count + pad,
            tl.zeros([BLOCK_M], dtype=tl.int32) + num_pairs,
            mask=pad < seg_len - count,
        )
        placed = seg_start
        for start in range(0, num_pairs, CHUNK):
            offsets = start + tl.arange(0, CHUNK)
            mine = tl.load(ids_ptr + offsets, mask=offsets < num_pairs, other=-1) == expert
            mine_int = mine.to(tl.int32)
            rank = tl.cumsum(mine_int, axis=0) - mine_int
            tl.store(sorted_ptr + placed + rank, offsets, mask=mine)
            placed += tl.sum(mine_int, axis=0)


def group_pairs_triton(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32, contiguous
    num_experts: int,
    block_m: int,
) -> MoEGrouping:
    """Triton grouping (two launches, no host sync)."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    max_blocks = max_num_blocks(num_pairs, num_experts, block_m)
    grouping = MoEGrouping(
        sorted_pair_ids=torch.empty(max_blocks * block_m, dtype=torch.int32, device=device),
        block_expert_ids=torch.empty(max_blocks, dtype=torch.int32, device=device),
        num_padded_rows=torch.empty(1, dtype=torch.int32, device=device),
        block_m=block_m,
    )
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    chunk = min(_MAX_SCAN_CHUNK, max(16, triton.next_power_of_2(num_pairs)))
    _count_kernel[(num_experts,)](topk_ids, counts, num_pairs, CHUNK=chunk)
    _place_kernel[(num_experts,)](
        topk_ids,
        counts,
        grouping.sorted_pair_ids,
        grouping.block_expert_ids,
        grouping.num_padded_rows,
        num_pairs,
        num_experts,
        BLOCK_M=block_m,
        EXPERTS_PAD=triton.next_power_of_2(num_experts),
        CHUNK=chunk,
        MAX_BLOCKS_PER_EXPERT=triton.next_power_of_2(triton_cdiv(num_pairs, block_m)),
    )
    return grouping


def group_pairs_ref(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] integer
    num_experts: int,
    block_m: int,
) -> MoEGrouping:
    """Torch reference of the grouping (reads counts back to the host); unused rows and
    blocks past num_padded_rows are filled with num_pairs and -1."""
    flat_ids = topk_ids.flatten().long()
    num_pairs = flat_ids.numel()
    max_blocks = max_num_blocks(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32)
    block_experts = torch.full((max_blocks,), -1, dtype=torch.int32)
    order = torch.argsort(flat_ids.cpu(), stable=True).to(torch.int32)
    counts = torch.bincount(flat_ids.cpu(), minlength=num_experts).tolist()
    row, taken = 0, 0
    for expert, count in enumerate(counts):
        sorted_ids[row : row + count] = order[taken : taken + count]
        num_blocks = triton_cdiv(count, block_m)
        block_experts[row // block_m : row // block_m + num_blocks] = expert
        row, taken = row + num_blocks * block_m, taken + count
    device = topk_ids.device
    return MoEGrouping(
        sorted_pair_ids=sorted_ids.to(device),
        block_expert_ids=block_experts.to(device),
        num_padded_rows=torch.tensor([row], dtype=torch.int32, device=device),
        block_m=block_m,
    )
