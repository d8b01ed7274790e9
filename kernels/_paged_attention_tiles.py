"""The inner pieces of kernels/paged_attention.py's Triton kernel: finding a program's
request, the online-softmax loop over KV tiles (where a float8 cache is converted to the
query's dtype) and the sink's term. Split out to keep that file readable; nothing else
calls them."""

from kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
        # Request r owns q blocks [query_start_loc[r] // BLOCK_Q + r, ...): strictly
        # increasing in r.
        left: tl.int32 = 0
        right = num_reqs
        while left < right:
            mid = (left + right) // 2
            mid_first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if mid_first_block <= q_block:
                left = mid + 1
            else:
                right = mid
        return left - 1

    @triton.jit
    def attend_tiles(
        q, query_pos, row_valid, key_head_ptr, value_head_ptr, block_table_row,
        tile_start, tile_end, kv_start, kv_len, sliding_window, scale_log2,
        stride_cache_block, stride_cache_slot,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
    ):  # fmt: skip
        """Online softmax of q [BLOCK_M, HEAD_DIM_PADDED] over KV tiles [tile_start, tile_end):
        returns the row max (log2 units), row sum and unnormalised output, all float32.
        Only keys in [kv_start, kv_len) are loaded (kv_start is used with HAS_WINDOW)."""
        offs_d = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = offs_d < HEAD_DIM
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
        for tile in range(tile_start, tile_end):
            offs_n = tile * TILE_N + tl.arange(0, TILE_N)
            key_valid = offs_n < kv_len
            if HAS_WINDOW:
                key_valid = key_valid & (offs_n >= kv_start)
            block_ids = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=key_valid, other=0).to(
                tl.int64
            )
            slot_offs = block_ids * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_slot
            kv_offs = slot_offs[:, None] + offs_d[None, :]
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            # From a float8 cache: to q's dtype (exact), unscaled (see the module doc)
            k = tl.load(key_head_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(value_head_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            visible = (
                row_valid[:, None] & key_valid[None, :] & (offs_n[None, :] <= query_pos[:, None])
            )
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > query_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def add_sink(m_i, l_i, acc, sink_log2):
        """Adds one logit per row (log2 units), with no value, to an online-softmax state."""
        m_new = tl.maximum(m_i, sink_log2)
        alpha = tl.math.exp2(m_i - m_new)
        return m_new, l_i * alpha + tl.math.exp2(sink_log2 - m_new), acc * alpha[:, None]
