"""The attention backends against dense causal attention over each request's full K/V
history, across steps that mix prefill chunks, decodes, new requests and padding tokens:
TorchAttentionBackend; TritonAttentionBackend on CPU tensors, where it runs the kernels'
torch references; the same backend with its Triton kernels in Triton's interpreter; and
both on CUDA."""

from __future__ import annotations

import pytest
import torch

from gpu.attention.base import AttentionBackend
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.attention.triton_backend import TritonAttentionBackend
from tests.gpu._paged_kv_batch import PagedKVBook
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    interpreted_test,
)

NUM_BLOCKS = 40
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
# (request, new tokens) per step: prefill chunks, then a mixed step with a new request,
# then decodes only; the 1-token prompt of "c" is a prefill that looks like a decode.
STEPS = [
    [("a", 5), ("b", 9), ("c", 1)],
    [("a", 1), ("b", 4), ("c", 1), ("d", 6)],
    [("d", 1), ("a", 1), ("b", 1), ("c", 1)],
]


def _dense_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_dim], this chunk's keys last
    values: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
) -> torch.Tensor:  # [query_len, num_heads, head_dim] float64
    group = query.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * SCALE
    query_len, seq_len = query.shape[0], keys.shape[0]
    future = torch.arange(seq_len)[None, :] > torch.arange(seq_len - query_len, seq_len)[:, None]
    return torch.einsum(
        "hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(-1), values
    )


def _run_steps(
    backend: AttentionBackend,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> None:
    generator = torch.Generator().manual_seed(0)
    book = PagedKVBook(NUM_BLOCKS, block_size, seed=5)
    kv_cache = torch.zeros(
        2, NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, dtype=dtype, device=device
    )
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for step, scheduled in enumerate(STEPS):
        num_padding = 2 if step == 2 else 0
        positions, metadata = book.step(scheduled, num_padding_tokens=num_padding, device=device)
        num_tokens = len(positions)
        query, key, value = (
            torch.randn(num_tokens, n, HEAD_DIM, generator=generator).to(dtype)
            for n in (num_heads, num_kv_heads, num_kv_heads)
        )
        cache_before = kv_cache.clone()
        out = backend.forward(
            query.to(device), key.to(device), value.to(device), kv_cache, metadata, SCALE
        ).cpu()
        assert out.shape == query.shape and out.dtype == dtype
        start = 0
        for req, num_new in scheduled:
            old_keys, old_values = history.get(req, (key[:0], value[:0]))
            keys = torch.cat([old_keys, key[start : start + num_new]])
            values = torch.cat([old_values, value[start : start + num_new]])
            history[req] = (keys, values)
            expected = _dense_attention(query[start : start + num_new], keys, values)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(
                out[start : start + num_new].double(), expected, rtol=tolerance, atol=tolerance
            )
            start += num_new
        _assert_only_scheduled_slots_written(
            cache_before, kv_cache, metadata.slot_mapping, key, value
        )


def _assert_only_scheduled_slots_written(
    before: torch.Tensor,
    after: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = after.shape[3:]
    expected = before.cpu().clone()  # key/value are host tensors; the cache may be on a GPU
    valid = slot_mapping.cpu() >= 0
    expected[0].view(-1, num_kv_heads, head_dim)[slot_mapping.cpu()[valid]] = key[valid]
    expected[1].view(-1, num_kv_heads, head_dim)[slot_mapping.cpu()[valid]] = value[valid]
    assert torch.equal(after.cpu(), expected)


@pytest.mark.parametrize(
    "backend_cls",
    [
        pytest.param(TorchAttentionBackend, id="torch"),
        pytest.param(TritonAttentionBackend, id="triton_backend_on_torch_references"),
    ],
)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (9, 3)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_backend_matches_dense_causal_attention(
    backend_cls: type, num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    _run_steps(backend_cls(), num_heads, num_kv_heads, block_size)


def check_triton_backend_with_interpreted_kernels() -> None:
    """Runs in a child process with TRITON_INTERPRET=1 (see tests/kernels/_triton_interpreter):
    the backend's calls go to the Triton launchers, which the dispatchers only pick on CUDA."""
    from gpu.attention import triton_backend
    from kernels import kv_write, paged_attention

    assert_interpreted(kv_write._kv_write_kernel, paged_attention._paged_attention_kernel)
    # The child runs other checks after this one: the patches end with it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_backend, "kv_write", kv_write.kv_write_triton)
        patch.setattr(triton_backend, "paged_attention", paged_attention.paged_attention_triton)
        for num_heads, num_kv_heads, block_size in ((4, 2, 4), (9, 3, 16)):
            _run_steps(triton_backend.TritonAttentionBackend(), num_heads, num_kv_heads, block_size)


test_triton_backend_with_its_kernels_in_the_interpreter_matches_dense_attention = interpreted_test(
    __file__, "check_triton_backend_with_interpreted_kernels"
)


def test_padding_rows_of_torch_backend_are_zero() -> None:
    book = PagedKVBook(NUM_BLOCKS, 4)
    _, metadata = book.step([("a", 3)], num_padding_tokens=2)
    kv_cache = torch.zeros(2, NUM_BLOCKS, 4, 2, HEAD_DIM)
    query, key = torch.randn(5, 4, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    out = TorchAttentionBackend().forward(query, key, key, kv_cache, metadata, SCALE)
    assert torch.equal(out[3:], torch.zeros(2, 4, HEAD_DIM))
    assert out[:3].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, TritonAttentionBackend])
def test_backend_on_cuda_matches_dense_causal_attention(
    backend_cls: type, dtype: torch.dtype
) -> None:
    _run_steps(backend_cls(), 8, 2, 16, dtype=dtype, device="cuda")
