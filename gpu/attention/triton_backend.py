"""Attention over the paged KV cache with the Triton kernels in `kernels/`.

On CUDA tensors `paged_attention` is one launch for a mixed batch of prefill chunks and
decodes (no host sync, so it can be captured in a CUDA graph); the model writes the step's
keys and values beforehand, fused into its qkv prologue. `forward` writes them itself
(`kv_write`). A float8 cache is quantized by the writes and dequantized inside the kernel
(kernels/_kv_fp8.py). On other devices the same calls run the kernels' torch references.
"""

from __future__ import annotations

import torch

from gpu.attention.base import AttentionMetadata
from kernels.kv_write import kv_write
from kernels.paged_attention import paged_attention


class TritonAttentionBackend:
    """AttentionBackend on the Triton paged-attention kernels."""

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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are undefined
        kv_write(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        return self.attend(
            query, kv_cache, metadata, scale, sliding_window=sliding_window, sinks=sinks,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are undefined
        num_reqs = metadata.num_reqs
        return paged_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.block_table,
            metadata.seq_lens[:num_reqs],
            metadata.query_start_loc[: num_reqs + 1],
            scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            query_tile=metadata.query_tile,
            sliding_window=sliding_window,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
        )
