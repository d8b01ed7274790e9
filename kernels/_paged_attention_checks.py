"""Argument checks of kernels/paged_attention.py (its launcher and reference): shapes,
dtypes, strides and devices, so that a wrong argument fails with a message naming it."""

from __future__ import annotations

import torch

from kernels._kv_fp8 import check_kv_scales, is_fp8_kv


def check_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The query, the paged caches (the query's dtype, or float8_e4m3fn with its two
    scales) and the index tensors (see paged_attention_ref)."""
    head_dim = query.shape[-1]
    if query.dim() != 3 or query.stride(2) != 1:
        raise ValueError(
            "query must be [num_tokens, num_heads, head_dim] with contiguous head_dim, "
            f"got {tuple(query.shape)} strides {query.stride()}"
        )
    if key_cache.dim() != 4 or key_cache.shape[3] != head_dim or key_cache.stride(3) != 1:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim={head_dim}] "
            f"with contiguous head_dim, got {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(
            f"value_cache {tuple(value_cache.shape)} strides {value_cache.stride()} must match "
            f"key_cache {tuple(key_cache.shape)} strides {key_cache.stride()}"
        )
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(
            f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {key_cache.shape[2]}"
        )
    dtypes = (query.dtype, key_cache.dtype, value_cache.dtype)
    cache_dtype = query.dtype if not is_fp8_kv(key_cache.dtype) else key_cache.dtype
    if (
        key_cache.dtype != cache_dtype
        or value_cache.dtype != cache_dtype
        or query.dtype not in (torch.float16, torch.bfloat16, torch.float32)
    ):
        raise ValueError(
            "query/key_cache/value_cache must share one of float16/bfloat16/float32 (or both "
            f"caches be float8_e4m3fn), got {dtypes}"
        )
    check_kv_scales(key_cache.dtype, query.device, k_scale, v_scale)
    check_index_args(query.device, block_table, seq_lens, query_start_loc)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.device != query.device:
            raise ValueError(f"{name} is on {cache.device} but query is on {query.device}")


def check_window_and_sinks(
    query: torch.Tensor, sliding_window: int | None, sinks: torch.Tensor | None
) -> None:
    """sliding_window: None or an int >= 1; sinks: None or [num_heads] on query's device."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if sinks is None:
        return
    num_heads = query.shape[1]
    if (
        not isinstance(sinks, torch.Tensor)
        or sinks.shape != (num_heads,)
        or sinks.dtype not in (torch.float32, torch.float16, torch.bfloat16)
        or not sinks.is_contiguous()
        or sinks.device != query.device
    ):
        got = (
            f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
            if isinstance(sinks, torch.Tensor)
            else type(sinks).__name__
        )
        raise ValueError(
            f"sinks must be a contiguous [num_heads={num_heads}] float32 (or float16/bfloat16) "
            f"tensor on {query.device}, got {got}"
        )


def check_index_args(
    device: torch.device,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """int32 index tensors on `device`, sized for num_reqs = len(seq_lens)."""
    num_reqs = seq_lens.shape[0]
    index_tensors = (
        ("block_table", block_table, 2),
        ("seq_lens", seq_lens, 1),
        ("query_start_loc", query_start_loc, 1),
    )
    for name, tensor, ndim in index_tensors:
        if tensor.dtype != torch.int32 or tensor.dim() != ndim or tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} must be a {ndim}-d int32 tensor with a contiguous last dim, "
                f"got {tensor.dtype} {tuple(tensor.shape)}"
            )
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {device}")
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"query_start_loc must be [num_reqs + 1] and block_table [>= num_reqs, ...] for "
            f"num_reqs={num_reqs} (from seq_lens), got {tuple(query_start_loc.shape)} and "
            f"{tuple(block_table.shape)}"
        )
