"""Attention over the paged KV cache for a flat varlen batch (prefill chunks and decodes).

Request r owns query rows query_start_loc[r]:query_start_loc[r + 1] (q_len rows) and
seq_lens[r] cached tokens, the last q_len of which are this chunk's own keys. Query row i
(absolute position seq_len - q_len + i) attends to key positions 0..seq_len - q_len + i,
read from slot block_table[r, pos // block_size] * block_size + pos % block_size.
Query head h reads kv head h // (num_heads // num_kv_heads) (GQA). With a sliding window W,
query position p sees only keys k with p - W < k <= p, and no KV slot (nor block table
entry) below the window of a chunk's first query is read. With sinks, head h's learned
logit sinks[h] (not scaled) joins the softmax denominator only (gpt-oss):
out = sum_k exp(s_k) v_k / (sum_k exp(s_k) + exp(sinks[h])).
A float8_e4m3fn cache (kernels/_kv_fp8.py) holds key / k_scale and value / v_scale: the
attention is that of the keys cache * k_scale and the values cache * v_scale.

The Triton kernel packs the query heads of one kv head, for BLOCK_Q tokens of one
request, into the M dimension of a tile, so a decode program reads each K/V block once
for the whole head group; online softmax with float32 accumulation. Decode-only batches
with few (request, kv head) pairs split the context over more programs and merge the
partial results in a second kernel, which adds the sink (so it counts once). A window
skips every KV tile below the first query row's window start. From a float8 cache the
kernel converts K and V tiles to the query's dtype (exact: e4m3 fits bf16/fp16/fp32),
folds k_scale into the softmax scale and multiplies v_scale into the unnormalised output
(both are linear), so the inner loop does no extra multiply.
"""

import math

import torch

from kernels._kv_fp8 import is_fp8_kv
from kernels._paged_attention_checks import check_args, check_window_and_sinks
from kernels._paged_attention_tiling import MAX_WINDOW, Tiling, choose_tiling
from kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from kernels._paged_attention_tiles import add_sink, attend_tiles, find_request

    _LOG2_E = tl.constexpr(math.log2(math.e))  # sinks are natural-log logits; the kernel uses exp2

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr,
        query_ptr, key_cache_ptr, value_cache_ptr,
        block_table_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
        scale_log2, num_reqs, num_heads, num_splits, sliding_window,
        stride_query_token, stride_query_head, stride_out_token, stride_out_head,
        stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table_req,
        NUM_QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr,
        SPLIT_KV: tl.constexpr, ONE_Q_BLOCK_PER_REQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
    ):  # fmt: skip
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if ONE_Q_BLOCK_PER_REQ:  # every query fits one block: skip the search
            req = tl.program_id(0)
            query_start = tl.load(query_start_loc_ptr + req)
            q_block_in_req = 0
        else:
            req = find_request(query_start_loc_ptr, tl.program_id(0), num_reqs, BLOCK_Q)
            query_start = tl.load(query_start_loc_ptr + req)
            q_block_in_req = tl.program_id(0) - (query_start // BLOCK_Q + req)
        query_len = tl.load(query_start_loc_ptr + req + 1) - query_start
        if q_block_in_req * BLOCK_Q >= query_len:
            return
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - query_len

        # Row m of the tile is token m // G of this q block, query head m % G of kv_head.
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_PADDED)
        token_in_chunk = q_block_in_req * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
        head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
        row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (token_in_chunk < query_len)
        dim_valid = offs_d < HEAD_DIM
        token = (query_start + token_in_chunk).to(tl.int64)
        row_offs = token[:, None] * stride_query_token + head[:, None] * stride_query_head
        row_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(query_ptr + row_offs + offs_d[None, :], mask=row_mask, other=0.0)
        query_pos = context_len + token_in_chunk

        # Keys visible to some query row of this block: up to the last row's position and,
        # with a window, from the first row's window start. Their tiles are split into
        # num_splits ranges (a run-time value, so one compiled kernel serves every count).
        kv_len = tl.minimum(seq_len, context_len + (q_block_in_req + 1) * BLOCK_Q)
        num_tiles = tl.cdiv(kv_len, TILE_N)
        kv_start = 0
        first_tile = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(context_len + q_block_in_req * BLOCK_Q - sliding_window + 1, 0)
            first_tile = kv_start // TILE_N
        tiles_per_split = tl.cdiv(num_tiles - first_tile, num_splits)
        tile_start = first_tile + split * tiles_per_split
        tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

        block_table_row = block_table_ptr + req.to(tl.int64) * stride_block_table_req
        if KV_FP8:  # scores of the stored keys times k_scale: the keys' true scores
            scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        m_i, l_i, acc = attend_tiles(
            q, query_pos, row_valid, key_cache_ptr + kv_head * stride_cache_head,
            value_cache_ptr + kv_head * stride_cache_head, block_table_row, tile_start, tile_end,
            kv_start, kv_len, sliding_window, scale_log2, stride_cache_block, stride_cache_slot,
            HEAD_DIM, HEAD_DIM_PADDED, BLOCK_SIZE, BLOCK_M, TILE_N, DOT_PRECISION, HAS_WINDOW,
        )  # fmt: skip
        if KV_FP8:  # acc is linear in V; the splits' partial sums too, so the merge is unchanged
            acc = acc * tl.load(v_scale_ptr)

        if not SPLIT_KV:
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
                m_i, l_i, acc = add_sink(m_i, l_i, acc, sink * _LOG2_E)
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            out_offs = (
                token[:, None] * stride_out_token
                + head[:, None] * stride_out_head
                + offs_d[None, :]
            )
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
        else:
            partial_row = (token * num_heads + head) * num_splits + split
            tl.store(partial_max_ptr + partial_row, m_i, mask=row_valid)
            tl.store(partial_sum_ptr + partial_row, l_i, mask=row_valid)
            acc_offs = partial_row[:, None] * HEAD_DIM_PADDED + offs_d[None, :]
            tl.store(partial_acc_ptr + acc_offs, acc, mask=row_valid[:, None])

    @triton.jit
    def _merge_splits_kernel(
        out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, query_start_loc_ptr, sinks_ptr,
        num_heads, num_splits, stride_out_token, stride_out_head,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, NUM_SPLITS_PADDED: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        req = tl.program_id(0)
        head = tl.program_id(1)
        token = tl.load(query_start_loc_ptr + req).to(tl.int64)
        if tl.load(query_start_loc_ptr + req + 1) == token:
            return
        offs_s = tl.arange(0, NUM_SPLITS_PADDED)
        offs_d = tl.arange(0, HEAD_DIM_PADDED)
        split_valid = offs_s < num_splits
        partial_row = (token * num_heads + head) * num_splits + offs_s
        split_max = tl.load(partial_max_ptr + partial_row, mask=split_valid, other=float("-inf"))
        split_sum = tl.load(partial_sum_ptr + partial_row, mask=split_valid, other=0.0)
        max_all = tl.max(split_max, axis=0)
        if HAS_SINKS:  # the splits hold no sink: it joins the denominator here, once
            sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2_E
            max_all = tl.maximum(max_all, sink)
        weight = tl.math.exp2(split_max - tl.where(max_all == float("-inf"), 0.0, max_all))
        total = tl.sum(weight * split_sum, axis=0)
        if HAS_SINKS:
            total += tl.math.exp2(sink - max_all)
        split_acc = tl.load(
            partial_acc_ptr + partial_row[:, None] * HEAD_DIM_PADDED + offs_d[None, :],
            mask=split_valid[:, None],
            other=0.0,
        )
        out = tl.sum(weight[:, None] * split_acc, axis=0) / tl.where(total == 0.0, 1.0, total)
        out_offs = token * stride_out_token + head * stride_out_head + offs_d
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [>= num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32 logits, not scaled
    k_scale: torch.Tensor | None = None,  # [] float32, float8 caches only
    v_scale: torch.Tensor | None = None,  # [] float32, float8 caches only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows of no request are zero
    """Plain torch paged attention, one request at a time, in float32 (syncs on a GPU).
    Like the kernel, it reads no key below the chunk's first window."""
    check_args(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, k_scale, v_scale
    )
    check_window_and_sinks(query, sliding_window, sinks)
    out = torch.zeros_like(query)
    block_size = key_cache.shape[1]
    group_size = query.shape[1] // key_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for req, seq_len in enumerate(lens):
        start, end = starts[req], starts[req + 1]
        if end == start:
            continue
        query_pos = seq_len - (end - start) + torch.arange(end - start, device=query.device)
        kv_start = (
            0 if sliding_window is None else max(seq_len - (end - start) - sliding_window + 1, 0)
        )
        positions = torch.arange(kv_start, seq_len, device=query.device)
        slots = (
            block_table[req, positions // block_size].long() * block_size + positions % block_size
        )
        keys = key_cache.flatten(0, 1)[slots].float().repeat_interleave(group_size, dim=1)
        values = value_cache.flatten(0, 1)[slots].float().repeat_interleave(group_size, dim=1)
        if is_fp8_kv(key_cache.dtype):
            assert k_scale is not None and v_scale is not None  # check_args made sure
            keys, values = keys * k_scale, values * v_scale
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), keys) * scale
        scores.masked_fill_(positions[None, :] > query_pos[:, None], float("-inf"))
        if sliding_window is not None:
            outside = positions[None, :] <= query_pos[:, None] - sliding_window
            scores.masked_fill_(outside, float("-inf"))
        probs = sink_softmax(scores, None if sinks is None else sinks[:, None, None])
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out


def sink_softmax(
    scores: torch.Tensor,  # [..., num_keys] float32, masked keys at -inf
    sinks: torch.Tensor | None,  # broadcastable to [..., 1]: one logit per row, or None
) -> torch.Tensor:  # [..., num_keys] float32
    """Softmax over the keys whose denominator also holds exp(sink) (gpt-oss attention
    sinks): the sink logit joins the row, the softmax runs, the sink column is dropped."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [>= num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    kv_tile_len: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    query_tile: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32 logits, not scaled
    k_scale: torch.Tensor | None = None,  # [] float32 on the device, float8 caches only
    v_scale: torch.Tensor | None = None,  # [] float32 on the device, float8 caches only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows of no request are undefined
    """Triton launcher. max_query_len must bound every request's query length; the
    next keyword arguments are tuning knobs (None = heuristic). Splitting the context
    (num_kv_splits > 1) is only allowed when max_query_len <= 1. query_tile sets the rows of
    a program's query tile (query heads of a kv head x tokens; default 16 for decodes, 64
    otherwise): a mixed batch of mostly decodes reads its KV best with decode-sized tiles.
    sliding_window and sinks are as in the module docstring (None = off); a float8 cache
    needs k_scale and v_scale."""
    check_args(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, k_scale, v_scale
    )
    check_window_and_sinks(query, sliding_window, sinks)
    tiling = choose_tiling(
        query, key_cache.shape[2], seq_lens.shape[0], max_query_len, max_seq_len,
        num_kv_splits, kv_tile_len, query_tile, sliding_window,
    )  # fmt: skip
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    _launch(
        out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, tiling,
        sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _launch(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], num_tokens > 0
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [>= num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, num_reqs > 0
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
    tiling: Tiling,
    *,
    sliding_window: int | None,
    sinks: torch.Tensor | None,  # [num_heads] float32
    k_scale: torch.Tensor | None,  # [] float32
    v_scale: torch.Tensor | None,  # [] float32
    num_warps: int | None,
    num_stages: int | None,
) -> None:
    """The attention kernel and, with the context split, the kernel merging the splits."""
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    num_kv_splits, head_dim_padded = tiling.num_kv_splits, tiling.head_dim_padded
    partial_shape = (num_tokens, num_heads, num_kv_splits)
    partial_max = partial_sum = partial_acc = out  # placeholders, unused with one split
    if num_kv_splits > 1:
        partial_max = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
        partial_acc = torch.empty(
            (*partial_shape, head_dim_padded), dtype=torch.float32, device=query.device
        )
    window = 0 if sliding_window is None else min(sliding_window, MAX_WINDOW)
    sinks_arg = out if sinks is None else sinks  # placeholder pointer without HAS_SINKS
    kv_fp8 = is_fp8_kv(key_cache.dtype)
    k_scale_arg = k_scale if kv_fp8 else out  # placeholder pointers without KV_FP8
    v_scale_arg = v_scale if kv_fp8 else out
    _paged_attention_kernel[tiling.grid](
        out, partial_acc, partial_max, partial_sum,
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, sinks_arg,
        k_scale_arg, v_scale_arg,
        scale * math.log2(math.e), num_reqs, num_heads, num_kv_splits, window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        NUM_QUERIES_PER_KV=num_heads // key_cache.shape[2], HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded, BLOCK_SIZE=key_cache.shape[1], BLOCK_Q=tiling.block_q,
        BLOCK_M=tiling.block_m, TILE_N=tiling.tile_n,
        SPLIT_KV=num_kv_splits > 1, ONE_Q_BLOCK_PER_REQ=tiling.one_q_block_per_req,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, KV_FP8=kv_fp8,
        num_warps=num_warps or 4, num_stages=num_stages or (3 if tiling.block_m <= 16 else 2),
    )  # fmt: skip
    if num_kv_splits > 1:
        _merge_splits_kernel[(num_reqs, num_heads)](
            out, partial_acc, partial_max, partial_sum, query_start_loc, sinks_arg,
            num_heads, num_kv_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded,
            NUM_SPLITS_PADDED=triton.next_power_of_2(num_kv_splits), HAS_SINKS=sinks is not None,
        )  # fmt: skip


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [>= num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int | None = None,
    query_tile: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32 logits, not scaled
    k_scale: torch.Tensor | None = None,  # [] float32, float8 caches only
    v_scale: torch.Tensor | None = None,  # [] float32, float8 caches only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Paged attention: the Triton kernel on CUDA tensors, the torch reference otherwise.
    sliding_window=W: query position p sees keys p - W < k <= p (None: all k <= p).
    sinks: head h's logit joins its softmax denominator (None: no sink). A float8 cache
    holds keys / k_scale and values / v_scale."""
    if HAS_TRITON and query.is_cuda:
        return paged_attention_triton(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, query_tile=query_tile,
            sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return paged_attention_ref(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
        sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
