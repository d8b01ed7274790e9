"""Attention over the paged KV cache in plain torch: the CPU path and the reference for
the GPU backends.

Decode requests (one query token) are batched into one gather and one pair of batched
matmuls per kv head; longer chunks run one `scaled_dot_product_attention` call per request
(plain float32 matmuls with attention sinks, which SDPA lacks). A sliding window gathers
only the blocks it covers. Loops are driven by the metadata's CPU arrays, so nothing waits
on the device. A float8 cache (torch stores and converts float8_e4m3fn on CPU too) is
gathered as float8, then converted to float32 and multiplied by its scale
(kernels/_kv_fp8.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionMetadata
from kernels._kv_fp8 import check_kv_scales, is_fp8_kv
from kernels.kv_write import kv_write_ref
from kernels.paged_attention import sink_softmax


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
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] float32 logits, not scaled
        k_scale: torch.Tensor | None = None,  # [] float32; needed by a float8 cache
        v_scale: torch.Tensor | None = None,  # [] float32; needed by a float8 cache
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are zero
        num_actual = metadata.num_actual_tokens
        kv_write_ref(
            key[:num_actual], value[:num_actual], kv_cache, metadata.slot_mapping[:num_actual],
            k_scale, v_scale,
        )  # fmt: skip
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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are zero
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        check_kv_scales(kv_cache.dtype, kv_cache.device, k_scale, v_scale)
        # (k_scale, v_scale) multiply the float32 keys and values read from a float8 cache
        kv_scales = None
        if is_fp8_kv(kv_cache.dtype):
            assert k_scale is not None and v_scale is not None  # checked above
            kv_scales = (k_scale, v_scale)
        out = torch.zeros_like(query)
        query_start_loc = metadata.query_start_loc_cpu[: metadata.num_reqs + 1]
        query_lens = np.diff(query_start_loc)
        decode_reqs = np.flatnonzero(query_lens == 1)
        if decode_reqs.size:
            _decode_attention(
                query, kv_cache, metadata, decode_reqs, scale, out, sliding_window, sinks,
                kv_scales,
            )  # fmt: skip
        for req in np.flatnonzero(query_lens > 1).tolist():
            start, end = int(query_start_loc[req]), int(query_start_loc[req + 1])
            out[start:end] = _chunk_attention(
                query[start:end],
                kv_cache,
                metadata.block_table[req],
                int(metadata.seq_lens_cpu[req]),
                scale,
                sliding_window,
                sinks,
                kv_scales,
            )
        return out


def _decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    reqs_np: np.ndarray,  # [num_decodes] request indices whose query length is 1
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
    sliding_window: int | None,
    sinks: torch.Tensor | None,  # [num_heads] float32
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,  # float8 cache: ([], []) float32
) -> None:
    num_decodes = reqs_np.size
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    group_size = query.shape[1] // num_kv_heads
    seq_lens_np = metadata.seq_lens_cpu[reqs_np].astype(np.int64)
    # Each decode gathers its blocks from the one holding its window's first key.
    first_blocks_np = np.zeros_like(seq_lens_np)
    if sliding_window is not None:
        first_blocks_np = np.maximum(seq_lens_np - sliding_window, 0) // block_size
    num_blocks = int((-(-seq_lens_np // block_size) - first_blocks_np).max())
    block_cols_np = first_blocks_np[:, None] + np.arange(num_blocks)  # [n, num_blocks]
    # Shorter spans run past their last block; those keys are masked, any block id will do.
    block_cols_np = np.minimum(block_cols_np, metadata.block_table.shape[1] - 1)
    device = query.device
    reqs = torch.from_numpy(reqs_np).to(device)
    tokens = torch.from_numpy(metadata.query_start_loc_cpu[reqs_np].astype(np.int64)).to(device)
    blocks = (
        metadata.block_table.index_select(0, reqs)
        .gather(1, torch.from_numpy(block_cols_np).to(device))
        .long()
    )  # [n, num_blocks]
    # index_select of K and V at once is much faster on CPU than advanced indexing
    kv = kv_cache.index_select(1, blocks.flatten()).view(2, num_decodes, -1, num_kv_heads, head_dim)
    queries = (
        query.index_select(0, tokens).float().view(num_decodes, num_kv_heads, group_size, head_dim)
    )
    key_pos_np = first_blocks_np[:, None] * block_size + np.arange(num_blocks * block_size)
    hidden_np = key_pos_np >= seq_lens_np[:, None]  # [n, max_len]
    if sliding_window is not None:
        hidden_np |= key_pos_np < (seq_lens_np - sliding_window)[:, None]
    hidden = torch.from_numpy(hidden_np).to(device)[:, None, :]  # [n, 1, max_len]
    sink_rows = None if sinks is None else sinks.view(num_kv_heads, group_size, 1)
    rows = torch.empty_like(queries)  # [n, kv_heads, group, head_dim] float32
    # One kv head at a time, the gathered keys are read in place (strided) by bmm: a
    # transposed copy of the whole context per layer cost more than the attention itself.
    # Each row's products and sums do not depend on the batch around it (SDPA's flash
    # kernel on the CPU does: its key blocks follow the batch's longest context).
    for head in range(num_kv_heads):
        keys, values = kv[0, :, :, head].float(), kv[1, :, :, head].float()  # [n, len, dim]
        if kv_scales is not None:
            keys, values = keys * kv_scales[0], values * kv_scales[1]
        scores = torch.bmm(queries[:, head], keys.transpose(1, 2)) * scale  # [n, group, len]
        scores.masked_fill_(hidden, float("-inf"))
        head_sinks = None if sink_rows is None else sink_rows[head]
        rows[:, head] = torch.bmm(sink_softmax(scores, head_sinks), values)
    out.index_copy_(0, tokens, rows.view(num_decodes, -1, head_dim).to(out.dtype))


def _chunk_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row: torch.Tensor,  # [max_blocks_per_req] int32
    seq_len: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,  # [num_heads] float32
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,  # float8 cache: ([], []) float32
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len, num_heads, head_dim = query.shape
    block_size = kv_cache.shape[2]
    context_len = seq_len - query_len
    # Keys from the first query's window start (0 without a window) to the chunk's end.
    kv_start = 0 if sliding_window is None else max(context_len - sliding_window + 1, 0)
    first_block = kv_start // block_size
    blocks = block_table_row[first_block : -(-seq_len // block_size)].long()
    kv = kv_cache.index_select(1, blocks).flatten(1, 2)
    kv = kv[:, kv_start - first_block * block_size : seq_len - first_block * block_size]
    keys, values = kv.transpose(1, 2).float()  # each [num_kv_heads, num_keys, head_dim]
    if kv_scales is not None:
        keys, values = keys * kv_scales[0], values * kv_scales[1]
    queries = query.transpose(0, 1).float()
    mask = None
    if context_len or sliding_window is not None:
        key_pos = torch.arange(kv_start, seq_len, device=query.device)
        query_pos = context_len + torch.arange(query_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    if sinks is None:
        rows = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        return rows.transpose(0, 1).to(query.dtype)
    # SDPA has no sink: the same attention with the sink column, per kv head group.
    num_kv_heads = keys.shape[0]
    grouped = queries.view(num_kv_heads, num_heads // num_kv_heads, query_len, head_dim)
    scores = torch.matmul(grouped, keys[:, None].transpose(2, 3)) * scale  # [kv, g, q, keys]
    if mask is None:
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril()
    scores.masked_fill_(~mask, float("-inf"))
    probs = sink_softmax(scores, sinks.view(num_kv_heads, -1, 1, 1))
    rows = torch.matmul(probs, values[:, None]).view(num_heads, query_len, head_dim)
    return rows.transpose(0, 1).to(query.dtype)
