from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.kv_write import kv_write, kv_write_ref, kv_write_triton
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)

NUM_KV_HEADS, HEAD_DIM = 2, 8


def _inputs(
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """key/value as strided views of a fused qkv row (as the model produces them), a
    random cache, and distinct random slots; tokens 1, 4, 7, ... are padding (slot -1)."""
    generator = torch.Generator().manual_seed(num_tokens)
    row = num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, 4 * row, generator=generator).to(dtype).to(device)
    key = qkv[:, 2 * row : 3 * row].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 3 * row :].view(num_tokens, num_kv_heads, head_dim)
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(cache_shape, generator=generator).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[1::3] = -1
    return key, value, kv_cache, slots.to(device)


def test_ref_writes_rows_at_slots_and_skips_padding() -> None:
    key, value, kv_cache, slots = _inputs(7, 4, 4, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    before = kv_cache.clone()
    kv_write_ref(key, value, kv_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, 4)
            assert torch.equal(kv_cache[0, block, offset], key[token])
            assert torch.equal(kv_cache[1, block, offset], value[token])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(kv_cache.flatten(1, 2)[:, untouched], before.flatten(1, 2)[:, untouched])


def test_dispatcher_uses_reference_on_cpu() -> None:
    key, value, kv_cache, slots = _inputs(9, 8, 4, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    expected = kv_cache.clone()
    kv_write_ref(key, value, expected, slots)
    kv_write(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda k, v, c, s: (k[:, :1], v, c, s), "key must be"),
        (lambda k, v, c, s: (k, v.half(), c, s), "value dtype"),
        (lambda k, v, c, s: (k, v, c[0], s), "kv_cache must be"),
        (lambda k, v, c, s: (k, v, c, s.float()), "slot_mapping must be"),
        (lambda k, v, c, s: (k, v, c, s[:-1]), "num_tokens=6"),
        (lambda k, v, c, s: (k.transpose(1, 2), v, c, s), "key must be"),
    ],
)
def test_bad_arguments_raise_clear_errors(
    change: Callable[..., tuple[torch.Tensor, ...]], message: str
) -> None:
    args = change(*_inputs(7, 4, 4, NUM_KV_HEADS, HEAD_DIM, torch.float32))
    for fn in (kv_write_ref, kv_write_triton):
        with pytest.raises(ValueError, match=message):
            fn(*args)


def check_interpreted_kernel_matches_reference() -> None:
    """Runs in a child process with TRITON_INTERPRET=1 (see _triton_interpreter)."""
    from kernels import kv_write as module

    assert_interpreted(module._kv_write_kernel)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for slot_dtype in (torch.int64, torch.int32):
            key, value, kv_cache, slots = _inputs(11, 6, 4, 3, 8, dtype)
            expected = kv_cache.clone()
            kv_write_ref(key, value, expected, slots)
            module.kv_write_triton(key, value, kv_cache, slots.to(slot_dtype))
            assert torch.equal(kv_cache, expected), (dtype, slot_dtype)


test_triton_kernel_matches_reference_in_interpreter = interpreted_test(
    __file__, "check_interpreted_kernel_matches_reference"
)


@cuda_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 257, 4096])
def test_triton_kernel_matches_reference_on_cuda(dtype: torch.dtype, num_tokens: int) -> None:
    key, value, kv_cache, slots = _inputs(num_tokens, 2048, 16, 8, 128, dtype, device="cuda")
    expected = kv_cache.clone()
    kv_write_ref(key, value, expected, slots)
    kv_write(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)
