"""From the fused qkv projection to attention's inputs: one kernel per layer and step.

qkv rows are [q heads | k heads | v heads] (num_heads, num_kv_heads, num_kv_heads heads
of head_dim). For token t at position pos = positions[t]:
- q and k heads: optionally RMSNorm over head_dim with q_norm / k_norm weights (Qwen3),
  then the rotary embedding in the rotate_half layout, with cos/sin = cos_cache[pos] /
  sin_cache[pos] (float32 tables of head_dim // 2 columns) cast to the model dtype;
- k (normed and rotated) and v are written into the paged KV cache at slot_mapping[t]
  (kv_cache[0] keys, kv_cache[1] values; a negative slot is padding and writes nothing);
  a float8_e4m3fn cache gets k / k_scale and v / v_scale, quantized as kernels/kv_write.py
  does (the model-dtype k is what is quantized, so both paths store the same bytes);
- q comes back as a contiguous [num_tokens, num_heads, head_dim] tensor.
Every multiply and add of the norm and the rotary is rounded to the model dtype where the
eager torch ops round, so the kernel and the reference agree to float32 rounding. One
launch replaces about thirty small kernels (two norms, the cos/sin lookups, the rotary's
halves and concatenations, the KV write).
"""

import torch

from kernels._checks import check_dtype_and_rank, check_triton_device, need_triton
from kernels._kv_fp8 import check_kv_scales, is_fp8_kv
from kernels._triton import HAS_TRITON, tl, triton
from kernels.kv_write import kv_write_ref
from kernels.rms_norm import add_rms_norm_ref

if HAS_TRITON:
    from kernels._kv_fp8 import quantize_e4m3

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _norm_and_rotate(
        x1, x2, cos, sin, norm_weight_ptr, eps, head_dim,
        HAS_NORM: tl.constexpr, DTYPE: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    ):  # fmt: skip
        """x1, x2: [heads, HALF_P2] float32 halves of each head; cos, sin: [HALF_P2]."""
        if HAS_NORM:
            inv_rms = tl.math.rsqrt(
                (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim + eps
            )
            cols = tl.arange(0, HALF_P2)
            weight1 = tl.load(norm_weight_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
            weight2 = tl.load(norm_weight_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(
                tl.float32
            )
            x1 = _round(weight1[None, :] * _round(x1 * inv_rms[:, None], DTYPE), DTYPE)
            x2 = _round(weight2[None, :] * _round(x2 * inv_rms[:, None], DTYPE), DTYPE)
        out1 = _round(_round(x1 * cos[None, :], DTYPE) - _round(x2 * sin[None, :], DTYPE), DTYPE)
        out2 = _round(_round(x2 * cos[None, :], DTYPE) + _round(x1 * sin[None, :], DTYPE), DTYPE)
        return out1, out2

    @triton.jit
    def _qkv_prologue_kernel(
        qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, kv_cache_ptr,
        slot_mapping_ptr, query_ptr, k_scale_ptr, v_scale_ptr,
        qkv_stride, table_stride, kv_stride, query_stride, eps, num_heads, num_kv_heads, head_dim,
        HAS_NORM: tl.constexpr, DTYPE: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
        HEADS_P2: tl.constexpr, KV_HEADS_P2: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        position = tl.load(positions_ptr + token)
        cols = tl.arange(0, HALF_P2)
        in_half = cols < HALF
        cos = _round(
            tl.load(cos_ptr + position * table_stride + cols, mask=in_half, other=0.0), DTYPE
        )
        sin = _round(
            tl.load(sin_ptr + position * table_stride + cols, mask=in_half, other=0.0), DTYPE
        )
        row_ptr = qkv_ptr + token * qkv_stride

        heads = tl.arange(0, HEADS_P2)
        q_mask = (heads < num_heads)[:, None] & in_half[None, :]
        q_offs = heads[:, None] * head_dim + cols[None, :]
        q1 = tl.load(row_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(row_ptr + q_offs + HALF, mask=q_mask, other=0.0).to(tl.float32)
        q1, q2 = _norm_and_rotate(
            q1, q2, cos, sin, q_norm_ptr, eps, head_dim, HAS_NORM, DTYPE, HALF, HALF_P2
        )
        out_ptr = query_ptr + token * query_stride + q_offs
        tl.store(out_ptr, q1.to(DTYPE), mask=q_mask)
        tl.store(out_ptr + HALF, q2.to(DTYPE), mask=q_mask)

        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            kv_heads = tl.arange(0, KV_HEADS_P2)
            kv_valid = kv_heads < num_kv_heads
            k_mask = kv_valid[:, None] & in_half[None, :]
            k_offs = num_heads * head_dim + kv_heads[:, None] * head_dim + cols[None, :]
            k1 = tl.load(row_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
            k2 = tl.load(row_ptr + k_offs + HALF, mask=k_mask, other=0.0).to(tl.float32)
            k1, k2 = _norm_and_rotate(
                k1, k2, cos, sin, k_norm_ptr, eps, head_dim, HAS_NORM, DTYPE, HALF, HALF_P2
            )
            dims = tl.arange(0, HEAD_DIM_P2)
            v_mask = kv_valid[:, None] & (dims < head_dim)[None, :]
            v_offs = kv_heads[:, None] * head_dim + dims[None, :]
            value = tl.load(row_ptr + (num_heads + num_kv_heads) * head_dim + v_offs, mask=v_mask)
            if KV_FP8:  # k1, k2 hold model-dtype values already (rounded by _norm_and_rotate)
                k_scale = tl.load(k_scale_ptr)
                k1 = quantize_e4m3(k1, k_scale)
                k2 = quantize_e4m3(k2, k_scale)
                value = quantize_e4m3(value, tl.load(v_scale_ptr))
            cache_dtype = kv_cache_ptr.dtype.element_ty
            slot_ptr = kv_cache_ptr + slot * (num_kv_heads * head_dim)
            key_ptr = slot_ptr + kv_heads[:, None] * head_dim + cols[None, :]
            tl.store(key_ptr, k1.to(cache_dtype), mask=k_mask)
            tl.store(key_ptr + HALF, k2.to(cache_dtype), mask=k_mask)
            tl.store(slot_ptr + kv_stride + v_offs, value.to(cache_dtype), mask=v_mask)


def _check_args(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    if qkv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"qkv must be float32, bfloat16 or float16, got {qkv.dtype}")
    check_dtype_and_rank("qkv", qkv, qkv.dtype, 2)
    num_tokens = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv rows must hold {num_heads} + 2 x {num_kv_heads} heads of an even "
            f"head_dim {head_dim}, got width {qkv.shape[1]}"
        )
    check_dtype_and_rank("positions", positions, torch.int64, 1)
    check_dtype_and_rank("slot_mapping", slot_mapping, (torch.int32, torch.int64), 1)
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"positions {tuple(positions.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must have one entry per qkv row ({num_tokens})"
        )
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_dtype_and_rank(name, table, torch.float32, 2)
        if table.shape[1] != head_dim // 2 or table.stride(1) != 1:
            raise ValueError(
                f"{name} must be [max_positions, {head_dim // 2}] with contiguous rows"
            )
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None:
            check_dtype_and_rank(name, weight, qkv.dtype, 1)
            if weight.shape[0] != head_dim:
                raise ValueError(f"{name} must have head_dim={head_dim} entries")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    expected = (
        2,
        kv_cache.shape[1] if kv_cache.dim() == 5 else -1,
        kv_cache.shape[2] if kv_cache.dim() == 5 else -1,
        num_kv_heads,
        head_dim,
    )
    cache_dtype_ok = kv_cache.dtype == qkv.dtype or is_fp8_kv(kv_cache.dtype)
    if kv_cache.dim() != 5 or tuple(kv_cache.shape) != expected or not cache_dtype_ok:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}] "
            f"of {qkv.dtype} (or float8_e4m3fn), got {tuple(kv_cache.shape)} {kv_cache.dtype}"
        )
    check_kv_scales(kv_cache.dtype, kv_cache.device, k_scale, v_scale)


def apply_rotary_ref(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], contiguous
    """The rotary embedding with transformers' `x * cos + rotate_half(x) * sin` arithmetic,
    on half-width tensors."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qkv_prologue_ref(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim] or None (no q/k norm)
    k_norm_weight: torch.Tensor | None,  # [head_dim] or None
    eps: float,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = padding
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_scale: torch.Tensor | None = None,  # [] float32: a float8 cache holds k / k_scale
    v_scale: torch.Tensor | None = None,  # [] float32: a float8 cache holds v / v_scale
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Torch reference of `qkv_prologue` (the model's unfused ops)."""
    _check_args(
        qkv,
        positions,
        cos_cache,
        sin_cache,
        q_norm_weight,
        k_norm_weight,
        kv_cache,
        slot_mapping,
        num_heads,
        num_kv_heads,
        head_dim,
        k_scale,
        v_scale,
    )
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    query = query.view(num_tokens, num_heads, head_dim)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None and k_norm_weight is not None:
        query = add_rms_norm_ref(query, None, q_norm_weight, eps)[0]
        key = add_rms_norm_ref(key, None, k_norm_weight, eps)[0]
    cos = cos_cache.index_select(0, positions).to(qkv.dtype).unsqueeze(1)
    sin = sin_cache.index_select(0, positions).to(qkv.dtype).unsqueeze(1)
    query = apply_rotary_ref(query, cos, sin)
    kv_write_ref(apply_rotary_ref(key, cos, sin), value, kv_cache, slot_mapping, k_scale, v_scale)
    return query


def qkv_prologue_triton(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rows contiguous
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim] or None
    k_norm_weight: torch.Tensor | None,  # [head_dim] or None
    eps: float,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [num_tokens]
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_scale: torch.Tensor | None = None,  # [] float32: a float8 cache holds k / k_scale
    v_scale: torch.Tensor | None = None,  # [] float32: a float8 cache holds v / v_scale
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton launcher of `qkv_prologue`: one program per token, all heads at once."""
    need_triton("qkv_prologue_triton")
    _check_args(
        qkv,
        positions,
        cos_cache,
        sin_cache,
        q_norm_weight,
        k_norm_weight,
        kv_cache,
        slot_mapping,
        num_heads,
        num_kv_heads,
        head_dim,
        k_scale,
        v_scale,
    )
    check_triton_device("qkv_prologue_triton", qkv.device)
    if qkv.stride(1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("qkv rows and kv_cache must be contiguous")
    num_tokens = qkv.shape[0]
    query = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    has_norm = q_norm_weight is not None
    kv_fp8 = is_fp8_kv(kv_cache.dtype)  # without it the scale pointers are placeholders
    dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[
        qkv.dtype
    ]
    _qkv_prologue_kernel[(num_tokens,)](
        qkv, positions, cos_cache, sin_cache,
        q_norm_weight if has_norm else cos_cache, k_norm_weight if has_norm else cos_cache,
        kv_cache, slot_mapping, query,
        k_scale if kv_fp8 else cos_cache, v_scale if kv_fp8 else cos_cache,
        qkv.stride(0), cos_cache.stride(0), kv_cache.stride(0), query.stride(0), eps,
        num_heads, num_kv_heads, head_dim,
        HAS_NORM=has_norm, DTYPE=dtype, HALF=head_dim // 2,
        HALF_P2=triton.next_power_of_2(head_dim // 2), HEADS_P2=triton.next_power_of_2(num_heads),
        KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim), KV_FP8=kv_fp8,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return query


def qkv_prologue(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    q_norm_weight: torch.Tensor | None,  # [head_dim] or None
    k_norm_weight: torch.Tensor | None,  # [head_dim] or None
    eps: float,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = padding
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_scale: torch.Tensor | None = None,  # [] float32: a float8 cache holds k / k_scale
    v_scale: torch.Tensor | None = None,  # [] float32: a float8 cache holds v / v_scale
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Norm q/k, rotate them, write k/v to the KV cache, return q (see the module doc):
    the Triton kernel on CUDA, the torch reference otherwise."""
    impl = (
        qkv_prologue_triton
        if HAS_TRITON and qkv.is_cuda and qkv.stride(-1) == 1
        else qkv_prologue_ref
    )
    return impl(
        qkv,
        positions,
        cos_cache,
        sin_cache,
        q_norm_weight,
        k_norm_weight,
        eps,
        kv_cache,
        slot_mapping,
        num_heads,
        num_kv_heads,
        head_dim,
        k_scale,
        v_scale,
    )
