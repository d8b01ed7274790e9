"""Attention over the paged KV cache in plain torch: the CPU path and the reference for
the GPU backends.

Decode requests (one query token) are batched into one gather + matmul; longer chunks
run one `scaled_dot_product_attention` call per request. Loops are driven by the
metadata's CPU arrays, so nothing waits on the device.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionMetadata
from kernels.kv_write import kv_write_ref


class TorchAttentionBackend:
    """AttentionBackend in plain torch; scores and softmax are computed in float32."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are zero
        num_actual = metadata.num_actual_tokens
        kv_write_ref(
            key[:num_actual], value[:num_actual], kv_cache, metadata.slot_mapping[:num_actual]
        )
        return self.attend(query, kv_cache, metadata, scale)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are zero
        out = torch.zeros_like(query)
        query_start_loc = metadata.query_start_loc_cpu[: metadata.num_reqs + 1]
        query_lens = np.diff(query_start_loc)
        decode_reqs = np.flatnonzero(query_lens == 1)
        if decode_reqs.size:
            _decode_attention(query, kv_cache, metadata, decode_reqs, scale, out)
        for req in np.flatnonzero(query_lens > 1).tolist():
            start, end = int(query_start_loc[req]), int(query_start_loc[req + 1])
            out[start:end] = _chunk_attention(
                query[start:end],
                kv_cache,
                metadata.block_table[req],
                int(metadata.seq_lens_cpu[req]),
                scale,
            )
        return out


def _decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    reqs_np: np.ndarray,  # [num_decodes] request indices whose query length is 1
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
) -> None:
    num_decodes = reqs_np.size
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    group_size = query.shape[1] // num_kv_heads
    seq_lens_np = metadata.seq_lens_cpu[reqs_np]
    num_blocks = -(-int(seq_lens_np.max()) // block_size)
    device = query.device
    reqs = torch.from_numpy(reqs_np).to(device)
    tokens = torch.from_numpy(metadata.query_start_loc_cpu[reqs_np].astype(np.int64)).to(device)
    blocks = metadata.block_table.index_select(0, reqs)[:, :num_blocks].long()  # [n, num_blocks]
    # index_select of K and V at once is much faster on CPU than advanced indexing
    kv = kv_cache.index_select(1, blocks.flatten()).view(2, num_decodes, -1, num_kv_heads, head_dim)
    kv = kv.transpose(2, 3).float().contiguous()  # [2, n, kv_heads, max_len, head_dim]
    keys, values = kv[0], kv[1]
    queries = (
        query.index_select(0, tokens).float().view(num_decodes, num_kv_heads, group_size, head_dim)
    )
    scores = torch.matmul(queries, keys.transpose(2, 3)) * scale  # [n, kv_heads, group, max_len]
    key_pos = torch.arange(num_blocks * block_size, device=device)
    seq_lens = torch.from_numpy(seq_lens_np.astype(np.int64)).to(device)
    scores.masked_fill_((key_pos[None, :] >= seq_lens[:, None])[:, None, None, :], float("-inf"))
    rows = torch.matmul(scores.softmax(dim=-1), values)  # [n, kv_heads, group, head_dim]
    out.index_copy_(0, tokens, rows.view(num_decodes, -1, head_dim).to(out.dtype))


def _chunk_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row: torch.Tensor,  # [max_blocks_per_req] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len = query.shape[0]
    block_size = kv_cache.shape[2]
    blocks = block_table_row[: -(-seq_len // block_size)].long()
    kv = kv_cache.index_select(1, blocks).flatten(1, 2)[:, :seq_len].transpose(1, 2).float()
    keys, values = kv[0], kv[1]  # [num_kv_heads, seq_len, head_dim]
    queries = query.transpose(0, 1).float()
    context_len = seq_len - query_len
    mask = None
    if context_len:
        key_pos = torch.arange(seq_len, device=query.device)
        query_pos = context_len + torch.arange(query_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
    rows = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return rows.transpose(0, 1).to(query.dtype)
