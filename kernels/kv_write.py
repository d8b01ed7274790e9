"""Write this step's keys and values into the paged KV cache.

kv_cache[0][slot // block_size, slot % block_size] = key[t] and likewise kv_cache[1] for
value, with slot = slot_mapping[t]; tokens whose slot is negative (padding) are skipped.
A float8_e4m3fn cache stores key / k_scale and value / v_scale, clamped to +-448 and
rounded to nearest even (kernels/_kv_fp8.py); any other cache stores them as they are.
"""

import torch

from kernels._kv_fp8 import check_kv_scales, is_fp8_kv, quantize_kv_ref
from kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from kernels._kv_fp8 import quantize_e4m3

    @triton.jit
    def _kv_write_kernel(
        key_ptr,
        value_ptr,
        kv_cache_ptr,
        slot_mapping_ptr,
        k_scale_ptr,
        v_scale_ptr,
        stride_key_token,
        stride_value_token,
        stride_cache_kv,
        ROW_SIZE: tl.constexpr,  # num_kv_heads * head_dim
        BLOCK: tl.constexpr,
        KV_FP8: tl.constexpr,  # quantize into a float8 cache with the scales
    ):
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        offsets = tl.arange(0, BLOCK)
        mask = offsets < ROW_SIZE
        # One program copies a whole token row (all kv heads) for both K and V.
        key_row = tl.load(key_ptr + token.to(tl.int64) * stride_key_token + offsets, mask=mask)
        value_row = tl.load(
            value_ptr + token.to(tl.int64) * stride_value_token + offsets, mask=mask
        )
        if KV_FP8:
            key_row = quantize_e4m3(key_row, tl.load(k_scale_ptr))
            value_row = quantize_e4m3(value_row, tl.load(v_scale_ptr))
        cache_row = kv_cache_ptr + slot * ROW_SIZE + offsets
        tl.store(cache_row, key_row.to(kv_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(
            cache_row + stride_cache_kv, value_row.to(kv_cache_ptr.dtype.element_ty), mask=mask
        )


def kv_write_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [] float32: a float8 cache holds key / k_scale
    v_scale: torch.Tensor | None = None,  # [] float32: a float8 cache holds value / v_scale
) -> None:
    """Plain torch version of `kv_write` (boolean indexing syncs on a GPU)."""
    _check_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    is_written = slot_mapping >= 0
    slots = slot_mapping[is_written]
    key, value = key[is_written], value[is_written]
    if is_fp8_kv(kv_cache.dtype):
        assert k_scale is not None and v_scale is not None  # _check_args made sure
        key, value = quantize_kv_ref(key, k_scale), quantize_kv_ref(value, v_scale)
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = key
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = value


def kv_write_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [] float32, read on the device (float8 cache)
    v_scale: torch.Tensor | None = None,  # [] float32, read on the device (float8 cache)
) -> None:
    """Triton launcher of `kv_write`: one program per token."""
    _check_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row_size = kv_cache.shape[3] * kv_cache.shape[4]
    kv_fp8 = is_fp8_kv(kv_cache.dtype)
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        k_scale if kv_fp8 else slot_mapping,  # placeholder pointers without KV_FP8
        v_scale if kv_fp8 else slot_mapping,
        key.stride(0),
        value.stride(0),
        kv_cache.stride(0),
        ROW_SIZE=row_size,
        BLOCK=triton.next_power_of_2(row_size),
        KV_FP8=kv_fp8,
    )


def kv_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [] float32 (a float8 cache needs it)
    v_scale: torch.Tensor | None = None,  # [] float32 (a float8 cache needs it)
) -> None:
    """Write key/value rows into kv_cache at slot_mapping: Triton on CUDA, torch otherwise."""
    if HAS_TRITON and kv_cache.is_cuda:
        kv_write_triton(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    else:
        kv_write_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def _check_args(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    row_shape = tuple(kv_cache.shape[3:])
    num_tokens = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    # A float8 cache takes keys and values in any model dtype; others take their own dtype.
    fp8 = is_fp8_kv(kv_cache.dtype)
    model_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for name, tensor in (("key", key), ("value", value)):
        if (
            tensor.dim() != 3
            or tuple(tensor.shape[1:]) != row_shape
            or tensor.shape[0] != num_tokens
        ):
            raise ValueError(
                f"{name} must be [num_tokens={num_tokens}, {row_shape[0]}, {row_shape[1]}] to "
                f"match slot_mapping and kv_cache, got {tuple(tensor.shape)}"
            )
        if tensor.stride(2) != 1 or tensor.stride(1) != row_shape[1]:
            raise ValueError(
                f"{name} must be contiguous within a token row, got strides {tensor.stride()}"
            )
        if tensor.dtype != kv_cache.dtype and not (fp8 and tensor.dtype in model_dtypes):
            raise ValueError(
                f"{name} dtype {tensor.dtype} differs from kv_cache dtype {kv_cache.dtype}"
            )
        if tensor.device != kv_cache.device:
            raise ValueError(f"{name} is on {tensor.device} but kv_cache is on {kv_cache.device}")
    if (
        slot_mapping.dtype not in (torch.int32, torch.int64)
        or slot_mapping.device != kv_cache.device
    ):
        raise ValueError(
            f"slot_mapping must be int32/int64 on {kv_cache.device}, got {slot_mapping.dtype} on "
            f"{slot_mapping.device}"
        )
    check_kv_scales(kv_cache.dtype, kv_cache.device, k_scale, v_scale)
