"""Attention backend interface.

The model hands every attention layer a flat batch of tokens from many requests (varlen,
no padding to a rectangle). A backend writes the new keys and values into the paged KV
cache through `slot_mapping`, then attends each query token to its request's cached
history through `block_table` and `seq_lens`, causally within the request's chunk.

KV cache layout, one tensor per layer:
    kv_cache[0] = keys,   [num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache[1] = values, [num_blocks, block_size, num_kv_heads, head_dim]
Token `i` of a request lives at slot `block_table[req, i // block_size] * block_size +
i % block_size`; `slot_mapping[t]` is that slot for flat token `t` (-1 = padding, skipped).

The cache is in the model dtype (--kv-cache-dtype auto) or float8_e4m3fn (fp8): then it
holds keys / k_scale and values / v_scale, with the layer's float32 scalars k_scale and
v_scale (kernels/_kv_fp8.py), which every write and read of the cache takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    num_actual_tokens: int
    """Real tokens in the flat batch; anything after it is CUDA-graph padding."""
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device: computed tokens + this step's tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device
    query_start_loc_cpu: np.ndarray  # [num_reqs + 1] int32, known when the step is scheduled
    seq_lens_cpu: np.ndarray  # [num_reqs] int32
    query_tile: int | None = None
    """Rows of the Triton attention kernel's query tiles (None: its default for the batch)."""


class AttentionBackend(Protocol):
    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] float32 logits, not scaled
        k_scale: torch.Tensor | None = None,  # [] float32; needed by a float8 cache
        v_scale: torch.Tensor | None = None,  # [] float32; needed by a float8 cache
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attend over a cache that already holds this step's keys and values.

        sliding_window=W (>= 1): a query at position p sees keys p - W < k <= p (None: every
        k <= p). sinks: head h's learned logit sinks[h] joins its softmax denominator only,
        out = sum_k exp(s_k) v_k / (sum_k exp(s_k) + exp(sinks[h])) (gpt-oss; None: none)."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] float32 logits, not scaled
        k_scale: torch.Tensor | None = None,  # [] float32; needed by a float8 cache
        v_scale: torch.Tensor | None = None,  # [] float32; needed by a float8 cache
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write key/value into kv_cache at metadata.slot_mapping (quantized into a float8
        cache), then attend (as `attend`)."""
        ...


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""
    return [
        torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]
