"""A minimal stand-in for the scheduler and input preparation, for attention and model
tests: it hands out KV blocks in shuffled (non-contiguous) order and builds the flat
varlen batch (positions, slot_mapping, block table, AttentionMetadata) for one step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu.attention.base import AttentionMetadata, allocate_kv_cache


@dataclass(slots=True)
class PagedKVBook:
    """Which blocks each request holds and how many of its tokens are cached."""

    num_blocks: int
    block_size: int
    seed: int = 0
    free_blocks: list[int] = field(default_factory=list)
    blocks_by_req: dict[str, list[int]] = field(default_factory=dict)
    num_computed_by_req: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free_blocks = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free_blocks)

    def step(
        self,
        num_new_tokens_by_req: list[tuple[str, int]],
        num_padding_tokens: int = 0,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, AttentionMetadata]:  # positions [num_tokens] int64, metadata
        """Schedule `num_new_tokens` for each (request, count) and advance their computed counts."""
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        for req, num_new in num_new_tokens_by_req:
            start = self.num_computed_by_req.get(req, 0)
            seq_len = start + num_new
            blocks = self._ensure_blocks(req, seq_len)
            for pos in range(start, seq_len):
                positions.append(pos)
                slots.append(
                    blocks[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            seq_lens.append(seq_len)
            query_start_loc.append(query_start_loc[-1] + num_new)
            self.num_computed_by_req[req] = seq_len
        num_actual = len(positions)
        positions += [0] * num_padding_tokens
        slots += [-1] * num_padding_tokens
        max_blocks = max(len(self.blocks_by_req[req]) for req, _ in num_new_tokens_by_req)
        block_table = np.zeros((len(seq_lens), max_blocks), dtype=np.int32)
        for row, (req, _) in enumerate(num_new_tokens_by_req):
            blocks = self.blocks_by_req[req]
            block_table[row, : len(blocks)] = blocks
        query_start_loc_np = np.array(query_start_loc, dtype=np.int32)
        seq_lens_np = np.array(seq_lens, dtype=np.int32)
        metadata = AttentionMetadata(
            num_actual_tokens=num_actual,
            num_reqs=len(seq_lens),
            max_query_len=int(np.diff(query_start_loc_np).max()),
            max_seq_len=int(seq_lens_np.max()),
            query_start_loc=torch.from_numpy(query_start_loc_np).to(device),
            seq_lens=torch.from_numpy(seq_lens_np).to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_table=torch.from_numpy(block_table).to(device),
            query_start_loc_cpu=query_start_loc_np,
            seq_lens_cpu=seq_lens_np,
        )
        return torch.tensor(positions, dtype=torch.int64, device=device), metadata

    def _ensure_blocks(self, req: str, seq_len: int) -> list[int]:
        blocks = self.blocks_by_req.setdefault(req, [])
        while len(blocks) * self.block_size < seq_len:
            if not self.free_blocks:
                raise RuntimeError("test KV cache is out of blocks; allocate more")
            blocks.append(self.free_blocks.pop())
        return blocks


def model_kv_caches(
    config: Any, num_blocks: int, block_size: int, device: str = "cpu"
) -> list[torch.Tensor]:  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
    """float32 KV caches for every layer of a gpu.models ModelConfig."""
    return allocate_kv_cache(
        config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
        torch.float32, device,
    )  # fmt: skip


def greedy_decode(
    model: Any,
    config: Any,
    prompts: list[torch.Tensor],
    arrival_steps: list[int],
    num_new_tokens: int,
    num_blocks: int,
    block_size: int,
    device: str = "cpu",
) -> list[list[int]]:
    """Continuous batching by hand over a DecoderModel: request i is prefilled at step
    arrival_steps[i], then decodes one token per step alongside the others until it has
    num_new_tokens."""
    book = PagedKVBook(num_blocks, block_size, seed=3)
    kv_caches = model_kv_caches(config, num_blocks, block_size, device)
    outputs: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(out) < num_new_tokens for out in outputs):
        running = [
            i
            for i, out in enumerate(outputs)
            if arrival_steps[i] <= step and len(out) < num_new_tokens
        ]
        new_ids = [prompts[i] if not outputs[i] else torch.tensor(outputs[i][-1:]) for i in running]
        positions, metadata = book.step(
            [(f"req{i}", len(ids)) for i, ids in zip(running, new_ids)], device=device
        )
        hidden = model(torch.cat(new_ids).to(device), positions, kv_caches, metadata)
        last_rows = torch.from_numpy(metadata.query_start_loc_cpu[1:] - 1).long().to(device)
        next_ids = model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()
        for i, token in zip(running, next_ids, strict=True):
            outputs[i].append(token)
        step += 1
    return outputs
