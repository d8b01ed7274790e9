"""Tile sizes, grid and context splits of kernels/paged_attention.py's Triton launch."""

import functools
import math
from typing import NamedTuple

import torch

from kernels._triton import triton

MAX_WINDOW = 2**30  # any longer window sees every key; keeps the kernel's argument int32


class Tiling(NamedTuple):
    block_m: int  # rows of a query tile: query heads of a kv head x block_q tokens
    block_q: int
    tile_n: int  # keys per KV tile
    head_dim_padded: int
    num_kv_splits: int
    one_q_block_per_req: bool
    grid: tuple[int, int, int]  # (query blocks, kv heads, context splits)


def choose_tiling(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    num_kv_heads: int,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int | None,
    num_kv_splits: int | None,
    kv_tile_len: int | None,
    query_tile: int | None,
    sliding_window: int | None,
) -> Tiling:
    """The tiles and grid of paged_attention_triton's launch (None knobs: the heuristics)."""
    num_tokens, num_heads, head_dim = query.shape
    group_size = num_heads // num_kv_heads
    is_decode = max_query_len <= 1
    block_m = max(query_tile or (16 if is_decode else 64), triton.next_power_of_2(group_size))
    block_q = block_m // group_size
    tile_n = kv_tile_len or 64
    if num_kv_splits is None:  # only a decode-only batch may split its context
        num_kv_splits = (
            default_num_kv_splits(
                query.device, num_reqs * num_kv_heads, max_seq_len, tile_n, sliding_window
            )
            if is_decode
            else 1
        )
    if num_kv_splits > 1 and not is_decode:
        raise ValueError(
            f"num_kv_splits={num_kv_splits} needs max_query_len <= 1, got {max_query_len}"
        )
    one_q_block_per_req = max_query_len <= block_q
    num_q_blocks = num_reqs if one_q_block_per_req else num_tokens // block_q + num_reqs
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    grid = (num_q_blocks, num_kv_heads, num_kv_splits)
    return Tiling(
        block_m, block_q, tile_n, head_dim_padded, num_kv_splits, one_q_block_per_req, grid
    )


def default_num_kv_splits(
    device: torch.device,
    num_programs: int,
    max_seq_len: int | None,
    tile_n: int,
    sliding_window: int | None = None,
) -> int:
    """Enough splits to give every SM about two programs, while each split keeps >= 4 of
    the tiles a decode reads (with a window: its keys, one partial tile more at most)."""
    if device.type != "cuda":
        return 1
    wanted = math.ceil(2 * _num_sms(device) / max(num_programs, 1))
    max_kv_len = max_seq_len
    if sliding_window is not None:
        window_kv_len = sliding_window + tile_n - 1
        max_kv_len = window_kv_len if max_seq_len is None else min(max_seq_len, window_kv_len)
    if max_kv_len is not None:
        wanted = min(wanted, math.ceil(max_kv_len / (4 * tile_n)))
    return max(1, min(wanted, 32))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
