"""Write this step's keys and values into the paged KV cache.

kv_cache[0][slot // block_size, slot % block_size] = key[t] and likewise kv_cache[1] for
value, with slot = slot_mapping[t]; tokens whose slot is negative (padding) are skipped.
"""

import torch

from kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _kv_write_kernel(
        key_ptr,
        value_ptr,
        kv_cache_ptr,
        slot_mapping_ptr,
        stride_key_token,
        stride_value_token,
        stride_cache_kv,
        ROW_SIZE: tl.constexpr,  # num_kv_heads * head_dim
        BLOCK: tl.constexpr,
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
        cache_row = kv_cache_ptr + slot * ROW_SIZE + offsets
        tl.store(cache_row, key_row, mask=mask)
        tl.store(cache_row + stride_cache_kv, value_row, mask=mask)


def kv_write_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Plain torch version of `kv_write` (boolean indexing syncs on a GPU)."""
    _check_args(key, value, kv_cache, slot_mapping)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    is_written = slot_mapping >= 0
    slots = slot_mapping[is_written]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = key[is_written]
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = value[is_written]


def kv_write_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Triton launcher of `kv_write`: one program per token."""
    _check_args(key, value, kv_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row_size = kv_cache.shape[3] * kv_cache.shape[4]
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        kv_cache.stride(0),
        ROW_SIZE=row_size,
        BLOCK=triton.next_power_of_2(row_size),
    )


def kv_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Write key/value rows into kv_cache at slot_mapping: Triton on CUDA, torch otherwise."""
    if HAS_TRITON and kv_cache.is_cuda:
        kv_write_triton(key, value, kv_cache, slot_mapping)
    else:
        kv_write_ref(key, value, kv_cache, slot_mapping)


def _check_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
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
        if tensor.dtype != kv_cache.dtype:
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
