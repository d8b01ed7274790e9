"""What the FP8 GEMV tests share (test_fp8_gemv.py, test_fp8_gemv_w8a8.py): random e4m3
weights under per-channel or 128 x 128 block scales, activations whose rows differ in
scale, a tolerance measured against the output's largest value, and the CUDA marker."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

from kernels.fp8_quant import FP8_DTYPE, FP8_MAX, quantize_weight_per_channel
from tests.kernels._triton_interpreter import cuda_test


def fp8_cuda_test(test: Callable[..., None]) -> Callable[..., None]:
    """A `gpu` test that also needs fp8 conversions (compute capability 8.9+)."""
    has_fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    needs_fp8 = pytest.mark.skipif(not has_fp8, reason="needs compute capability >= 8.9")
    return cuda_test(needs_fp8(test))


def random_weight(
    num_out: int, depth: int, blockwise: bool, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """w_fp8 [N, K] and its scale ([N], or [N/128, K/128] blocks). Rows or blocks differ
    in magnitude by up to 100x, so a scale read from the wrong row or block shows."""
    generator = torch.Generator().manual_seed(seed)
    if not blockwise:
        w = torch.randn(num_out, depth, generator=generator)
        w *= torch.exp(torch.rand(num_out, 1, generator=generator) * 4.6)
        w_fp8, w_scale = quantize_weight_per_channel(w)
        return w_fp8.to(device), w_scale.to(device)
    grid = (-(-num_out // 128), -(-depth // 128))
    block_scale = torch.exp(torch.rand(grid, generator=generator) * 4.6) / FP8_MAX
    w = torch.randn(num_out, depth, generator=generator) * 100
    w_fp8 = w.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8.to(device), block_scale.to(device)


def random_activations(
    num_tokens: int, depth: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(num_tokens * 7 + depth)
    x = torch.randn(num_tokens, depth, generator=generator)
    x *= torch.exp(torch.rand(num_tokens, 1, generator=generator) * 4)  # rows differ in scale
    if dtype == torch.float16:
        x *= 2**-10  # keeps sums over thousands of products inside float16's range
    return x.to(dtype).to(device)


def assert_close_to_largest(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Errors measured against the output's largest value: the sums over K mix signs, so an
    output can be far smaller than the products it adds up, whose rounding its error
    follows. A wrong scale, row or block errs by the output's own size."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(expected).all(), "the case overflows the output dtype"
    scale = float(expected.float().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * scale)


@contextlib.contextmanager
def ieee_float32_matmul() -> Iterator[None]:
    """The reference's float32 matmul in full precision, whatever another test set
    (TF32 on CUDA would err by 2^-11)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def check_graph_replay_follows_new_input(gemv: Callable[..., torch.Tensor]) -> None:
    """`gemv` (x, w_fp8, w_scale, block_scale=, bias=) captured in a CUDA graph at the down
    projection's shape (split-K: two kernels in the graph), both scale layouts: a replay
    after x changed gives what an eager call gives."""
    num_out, depth = 4096, 14336
    x = random_activations(1, depth, torch.bfloat16, "cuda")
    w_fp8, w_scale = random_weight(num_out, depth, False, "cuda")
    wb_fp8, block_scale = random_weight(num_out, depth, True, "cuda")
    bias = torch.randn(num_out, device="cuda").bfloat16()

    def forward() -> list[torch.Tensor]:
        return [gemv(x, w_fp8, w_scale, bias=bias), gemv(x, wb_fp8, block_scale=block_scale)]

    before = forward()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    x.copy_(random_activations(1, depth, torch.bfloat16, "cuda") * -0.5)
    graph.replay()
    torch.cuda.synchronize()
    for replayed, eager, old in zip(captured, forward(), before, strict=True):
        assert not torch.equal(replayed, old), "the replay did not follow the new input"
        assert torch.equal(replayed, eager)
