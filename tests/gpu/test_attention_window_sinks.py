"""The attention backends with a sliding window and attention sinks against dense
attention over each request's full K/V history (transformers' masks and gpt-oss softmax,
tests/kernels/_dense_attention.py), across steps whose prefill chunks start beyond the
window or cross it, mixed with decodes far past it: TorchAttentionBackend (decode batching
and the per-request chunk path), TritonAttentionBackend on its torch references, the same
with its kernels in Triton's interpreter, and both on CUDA."""

from __future__ import annotations

import pytest
import torch

from gpu.attention.base import AttentionBackend
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.attention.triton_backend import TritonAttentionBackend
from tests.gpu._paged_kv_batch import PagedKVBook
from tests.kernels._dense_attention import dense_attention
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)

NUM_BLOCKS = 48
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
# (request, new tokens) per step. "a": a 7-token prompt, then a 6-token chunk whose context
# reaches past small windows, then decodes; "c": a 1-token prompt, then a 9-token chunk
# across the window boundary; "b" decodes while "d" arrives late.
STEPS = [
    [("a", 7), ("b", 11), ("c", 1)],
    [("a", 6), ("b", 1), ("c", 9), ("d", 2)],
    [("d", 1), ("a", 1), ("b", 1), ("c", 1)],
    [("a", 1), ("b", 8), ("c", 1), ("d", 12)],
]
# (sliding_window, with sinks)
VARIANTS = [(None, True), (5, False), (5, True), (1, True), (16, True), (37, True)]


def _run_steps(
    backend: AttentionBackend,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    sliding_window: int | None,
    with_sinks: bool,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> None:
    generator = torch.Generator().manual_seed(1)
    sinks = (torch.randn(num_heads, generator=generator) * 2).to(device) if with_sinks else None
    book = PagedKVBook(NUM_BLOCKS, block_size, seed=3)
    kv_cache = torch.zeros(
        2, NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, dtype=dtype, device=device
    )
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for step, scheduled in enumerate(STEPS):
        _, metadata = book.step(scheduled, num_padding_tokens=step % 2, device=device)
        num_tokens = metadata.slot_mapping.shape[0]
        query, key, value = (
            torch.randn(num_tokens, n, HEAD_DIM, generator=generator).to(dtype)
            for n in (num_heads, num_kv_heads, num_kv_heads)
        )
        out = backend.forward(
            query.to(device), key.to(device), value.to(device), kv_cache, metadata, SCALE,
            sliding_window=sliding_window, sinks=sinks,
        ).cpu()  # fmt: skip
        assert out.shape == query.shape and out.dtype == dtype
        start = 0
        for req, num_new in scheduled:
            old_keys, old_values = history.get(req, (key[:0], value[:0]))
            keys = torch.cat([old_keys, key[start : start + num_new]])
            values = torch.cat([old_values, value[start : start + num_new]])
            history[req] = (keys, values)
            expected = dense_attention(
                query[start : start + num_new], keys, values, SCALE, sliding_window,
                None if sinks is None else sinks.cpu(),
            )  # fmt: skip
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(
                out[start : start + num_new].double(), expected, rtol=tolerance, atol=tolerance,
                msg=lambda m, r=req, s=step: f"step {s} request {r}: {m}",
            )  # fmt: skip
            start += num_new


@pytest.mark.parametrize(
    "backend_cls",
    [
        pytest.param(TorchAttentionBackend, id="torch"),
        pytest.param(TritonAttentionBackend, id="triton_backend_on_torch_references"),
    ],
)
@pytest.mark.parametrize("sliding_window,with_sinks", VARIANTS)
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 4), (8, 2, 4), (6, 2, 16)])
def test_backend_matches_dense_windowed_attention_with_sinks(
    backend_cls: type,
    sliding_window: int | None,
    with_sinks: bool,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
) -> None:
    _run_steps(backend_cls(), num_heads, num_kv_heads, block_size, sliding_window, with_sinks)


def test_torch_backend_without_window_or_sinks_is_unchanged_by_a_window_over_everything() -> None:
    def outputs(**kwargs: object) -> list[torch.Tensor]:
        book = PagedKVBook(NUM_BLOCKS, 4, seed=3)
        kv_cache = torch.zeros(2, NUM_BLOCKS, 4, 2, HEAD_DIM)
        generator = torch.Generator().manual_seed(2)
        results = []
        for scheduled in STEPS:
            _, metadata = book.step(scheduled)
            num_tokens = metadata.slot_mapping.shape[0]
            query = torch.randn(num_tokens, 4, HEAD_DIM, generator=generator)
            key = torch.randn(num_tokens, 2, HEAD_DIM, generator=generator)
            backend = TorchAttentionBackend()
            results.append(backend.forward(query, key, key, kv_cache, metadata, SCALE, **kwargs))
        return results

    for plain, windowed in zip(outputs(), outputs(sliding_window=1000), strict=True):
        assert torch.equal(plain, windowed)


def check_triton_backend_with_interpreted_kernels() -> None:
    """Runs in a child process with TRITON_INTERPRET=1 (see tests/kernels/_triton_interpreter)."""
    from gpu.attention import triton_backend
    from kernels import kv_write, paged_attention

    assert_interpreted(kv_write._kv_write_kernel, paged_attention._paged_attention_kernel)
    # The child runs other checks after this one: the patches end with it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_backend, "kv_write", kv_write.kv_write_triton)
        patch.setattr(triton_backend, "paged_attention", paged_attention.paged_attention_triton)
        for sliding_window, with_sinks in ((5, True), (16, False), (None, True)):
            _run_steps(triton_backend.TritonAttentionBackend(), 8, 2, 4, sliding_window, with_sinks)


test_triton_backend_with_window_and_sinks_in_the_interpreter = interpreted_test(
    __file__, "check_triton_backend_with_interpreted_kernels"
)


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window,with_sinks", VARIANTS)
@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, TritonAttentionBackend])
def test_backend_on_cuda_matches_dense_windowed_attention_with_sinks(
    backend_cls: type, sliding_window: int | None, with_sinks: bool, dtype: torch.dtype
) -> None:
    _run_steps(backend_cls(), 8, 2, 16, sliding_window, with_sinks, dtype=dtype, device="cuda")
