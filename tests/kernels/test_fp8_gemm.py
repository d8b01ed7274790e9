"""fp8_gemm: the references against numpy (scales, partial blocks, bias), argument checks,
the block-scaled Triton kernel vs reference (interpreter and CUDA), torch._scaled_mm vs
reference on CUDA, and both GEMMs with their quantizers replayed from a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kernels import fp8_gemm
from kernels.fp8_gemm import (
    fp8_gemm_blockwise,
    fp8_gemm_blockwise_ref,
    fp8_gemm_blockwise_triton,
    fp8_gemm_rowwise,
    fp8_gemm_rowwise_ref,
)
from kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_per_channel,
)
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def fp8_cuda_test(test: Callable[..., None]) -> Callable[..., None]:
    """A `gpu` test that also needs fp8 tensor cores (compute capability 8.9+)."""
    reason = "needs fp8 tensor cores (compute capability >= 8.9)"
    needs_fp8 = pytest.mark.skipif(not _has_fp8_gpu(), reason=reason)
    return cuda_test(needs_fp8(test))


def _blockwise_weight(
    num_out: int, depth: int, block: tuple[int, int], device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight whose blocks differ in magnitude by up to 100x (so a scale read from
    the wrong block shows), quantized per block as the Hugging Face fp8 checkpoints are."""
    generator = torch.Generator().manual_seed(seed)
    grid = (-(-num_out // block[0]), -(-depth // block[1]))
    magnitude = torch.exp(torch.rand(grid, generator=generator) * 4.6)
    per_value = magnitude.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    w = torch.randn(num_out, depth, generator=generator) * per_value[:num_out, :depth]
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:num_out, :depth] = w
    absmax = padded.view(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3))
    scale_inv = absmax / FP8_MAX
    scale_values = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    w_fp8 = (w / scale_values[:num_out, :depth]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8.to(device), scale_inv.to(device)


def _activations(num_tokens: int, depth: int, device: str, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, depth, generator=generator)
    x *= torch.exp(torch.rand(num_tokens, 1, generator=generator) * 4)  # rows differ in scale
    return x.to(torch.bfloat16).to(device)


def test_rowwise_reference_matches_numpy() -> None:
    a_fp8, a_scale = quantize_per_token(_activations(5, 48, "cpu"))
    w_fp8, w_scale = quantize_weight_per_channel(torch.randn(24, 48) * torch.rand(24, 1) * 9)
    bias = torch.randn(24)
    a_np = a_fp8.float().numpy().astype(np.float64) * a_scale.numpy()
    w_np = w_fp8.float().numpy().astype(np.float64) * w_scale.numpy()[:, None]
    expected = a_np @ w_np.T + bias.numpy()
    for w_scale_form in (w_scale, w_scale[:, None]):
        out = fp8_gemm_rowwise_ref(a_fp8, a_scale, w_fp8, w_scale_form, bias, torch.float32)
        _assert_close_to_reference(out, torch.from_numpy(expected).float(), 1e-5)
    out_bf16 = fp8_gemm_rowwise(a_fp8, a_scale, w_fp8, w_scale, None, torch.bfloat16)
    assert out_bf16.dtype == torch.bfloat16 and out_bf16.shape == (5, 24)
    np.testing.assert_allclose(
        out_bf16.float().numpy(), expected - bias.numpy(), rtol=2**-8, atol=1e-3
    )


@pytest.mark.parametrize(("shape", "block"), [((7, 300, 200), (128, 128)), ((3, 64, 96), (48, 32))])
def test_blockwise_reference_matches_a_sum_over_blocks(
    shape: tuple[int, int, int], block: tuple[int, int]
) -> None:
    num_tokens, depth, num_out = shape
    x = _activations(num_tokens, depth, "cpu")
    a_fp8, a_scale = quantize_per_token_group(x, block[1])
    w_fp8, w_scale = _blockwise_weight(num_out, depth, block, "cpu")
    a_np, w_np = a_fp8.float().numpy().astype(np.float64), w_fp8.float().numpy()
    expected = np.zeros((num_tokens, num_out))
    for kb in range(a_scale.shape[1]):
        k = slice(kb * block[1], (kb + 1) * block[1])
        for nb in range(w_scale.shape[0]):
            n = slice(nb * block[0], (nb + 1) * block[0])
            partial = a_np[:, k] @ w_np[n, k].T
            expected[:, n] += partial * a_scale[:, kb, None].numpy() * float(w_scale[nb, kb])
    out = fp8_gemm_blockwise_ref(a_fp8, a_scale, w_fp8, w_scale, torch.float32, block)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # Against the unquantized activations: each moved by at most 2^-4 of itself (e4m3's
    # half step), so each output by at most 2^-4 of the sum of |products|.
    w = (
        w_fp8.float()
        * w_scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:num_out, :depth]
    )
    bound = (x.float().abs() @ w.abs().T) * 2**-4 + 1e-3
    assert torch.all((out - x.float() @ w.T).abs() <= bound)
    cpu_out = fp8_gemm_blockwise(a_fp8, a_scale, w_fp8, w_scale, torch.bfloat16, block)
    assert torch.equal(cpu_out, out.bfloat16())


def test_bad_arguments_name_the_culprit() -> None:
    a_fp8 = torch.zeros(4, 256, dtype=FP8_DTYPE)
    w_fp8 = torch.zeros(128, 256, dtype=FP8_DTYPE)
    a_scale, w_scale = torch.ones(4, 1), torch.ones(128)
    with pytest.raises(ValueError, match="must share K"):
        fp8_gemm_rowwise(a_fp8, a_scale, w_fp8[:, :128], w_scale, None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"a_scale must be \[4, 1\]"):
        fp8_gemm_rowwise(a_fp8, torch.ones(4), w_fp8, w_scale, None, torch.bfloat16)
    with pytest.raises(ValueError, match="w_scale must be a float32"):
        fp8_gemm_rowwise(a_fp8, a_scale, w_fp8, w_scale.half(), None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"bias must be \[128\]"):
        fp8_gemm_rowwise(a_fp8, a_scale, w_fp8, w_scale, torch.ones(4), torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_gemm_rowwise(a_fp8, a_scale, w_fp8, w_scale, None, torch.int32)
    with pytest.raises(ValueError, match="a_fp8 must be torch.float8_e4m3fn"):
        fp8_gemm_rowwise(a_fp8.float(), a_scale, w_fp8, w_scale, None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"a_scale must be \[4, 2\]"):
        fp8_gemm_blockwise(a_fp8, a_scale, w_fp8, torch.ones(1, 2), torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_scale must be \[1, 2\]"):
        fp8_gemm_blockwise(a_fp8, torch.ones(4, 2), w_fp8, torch.ones(2, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="block_k a power of two"):
        fp8_gemm_blockwise(a_fp8, a_scale, w_fp8, w_scale, torch.bfloat16, (128, 100))


def _assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Errors are measured against the output's largest value: the sums over K mix signs, so
    an output element can be far smaller than the products it adds up, and its absolute
    error follows those products, not itself. A scale taken from the wrong row, column or
    block errs by the output's own size."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = float(expected.float().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * scale)


# Tolerances on a GPU: bf16 output rounds to 2^-9 of a value; the fp8 tensor cores add
# each 128-product block with ~14 mantissa bits before the kernel scales it in float32
# (the reference adds in float32 throughout), about 2^-14 of the block's magnitude. 2^-7
# leaves margin for both and still catches any wrong scale. fp32 output: only the latter.
_BF16_RTOL, _FP32_RTOL = 2**-7, 2**-10


def compare_blockwise(cases: list[tuple[int, int, int, tuple[int, int]]], device: str) -> None:
    """fp8_gemm_blockwise_triton vs the reference on (M, N, K, block) cases."""
    interpreted = device == "cpu"
    if interpreted:
        assert_interpreted(fp8_gemm._blockwise_kernel)
    for num_tokens, num_out, depth, block in cases:
        a_fp8, a_scale = quantize_per_token_group(_activations(num_tokens, depth, "cpu"), block[1])
        a_fp8, a_scale = a_fp8.to(device), a_scale.to(device)
        w_fp8, w_scale = _blockwise_weight(num_out, depth, block, device)
        # the interpreter truncates float32 to bf16 (GPUs round): one more step
        for out_dtype, rtol in (
            (torch.float32, 1e-5 if interpreted else _FP32_RTOL),
            (torch.bfloat16, 2**-6 if interpreted else _BF16_RTOL),
        ):
            args = (a_fp8, a_scale, w_fp8, w_scale, out_dtype, block)
            _assert_close_to_reference(
                fp8_gemm_blockwise_triton(*args), fp8_gemm_blockwise_ref(*args), rtol
            )


_INTERPRETER_CASES = [
    (1, 200, 300, (128, 128)),  # decode; N and K with partial blocks
    (7, 256, 256, (128, 128)),
    (40, 130, 384, (128, 128)),  # BLOCK_M 64: rows past M masked
    (20, 100, 96, (96, 32)),  # a 64-column tile spans two weight blocks
]


test_blockwise_triton_matches_reference_in_interpreter = interpreted_test(
    __file__, "compare_blockwise", kwargs={"cases": _INTERPRETER_CASES, "device": "cpu"}
)


_MODEL_SHAPES = [(2048, 1024), (576, 2048), (1024, 2048)]  # (N, K): MLP-like, MLA-like


@fp8_cuda_test
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_blockwise_triton_matches_reference_on_cuda(num_tokens: int) -> None:
    cases = [(num_tokens, n, k, (128, 128)) for n, k in _MODEL_SHAPES]
    compare_blockwise(cases + [(num_tokens, 200, 1000, (128, 128))], "cuda")
    compare_blockwise(_INTERPRETER_CASES, "cuda")


@fp8_cuda_test
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rowwise_scaled_mm_matches_reference_on_cuda(num_tokens: int) -> None:
    for num_out, depth in _MODEL_SHAPES:
        a_fp8, a_scale = quantize_per_token(_activations(num_tokens, depth, "cuda"))
        w = torch.randn(num_out, depth, device="cuda") * torch.rand(num_out, 1, device="cuda")
        w_fp8, w_scale = quantize_weight_per_channel(w)
        for bias_dtype in (None, torch.bfloat16, torch.float32):
            bias = (
                None if bias_dtype is None else torch.randn(num_out, device="cuda").to(bias_dtype)
            )
            for out_dtype, rtol in ((torch.bfloat16, _BF16_RTOL), (torch.float16, _BF16_RTOL)):
                args = (a_fp8, a_scale, w_fp8, w_scale, bias, out_dtype)
                _assert_close_to_reference(
                    fp8_gemm_rowwise(*args), fp8_gemm_rowwise_ref(*args), rtol
                )
        args = (a_fp8, a_scale, w_fp8, w_scale[:, None], None, torch.float32)
        _assert_close_to_reference(fp8_gemm_rowwise(*args), fp8_gemm_rowwise_ref(*args), _FP32_RTOL)


def _replay_with_new_input(
    forward: Callable[[], Any], x: torch.Tensor, new_x: torch.Tensor
) -> tuple[Any, Any, Any]:
    """forward() run eagerly (compiling the Triton kernels outside the capture), captured
    in a CUDA graph, and replayed after x is overwritten with new_x: (the eager outputs
    before, the replay's outputs, forward() run eagerly on new_x)."""
    before = forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    return before, captured, forward()


@fp8_cuda_test
@pytest.mark.parametrize("num_tokens", [64, 77, 333, 2048])
def test_blockwise_cublas_path_matches_reference_on_hopper(num_tokens: int) -> None:
    """Token-major activation scales from prefill-sized M route to cuBLASLt (where its
    probe passes: asserted on Hopper, where it was measured; M not a multiple of 4 padded),
    and both routes stay as close to the reference as the Triton kernel does."""
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for num_out, depth in _MODEL_SHAPES + [(4096, 4096)]:
        x = _activations(num_tokens, depth, "cuda")
        w_fp8, w_scale = _blockwise_weight(num_out, depth, (128, 128), "cuda")
        a_fp8, a_scale = quantize_per_token_group(x, 128, scale_m_major=True)
        routed = fp8_gemm._takes_cublas_blockwise(
            a_fp8, a_scale, w_fp8, w_scale, torch.bfloat16, (128, 128)
        )
        # cuBLASLt's recipe takes whole 128-row weight blocks (576 rows: Triton); on other
        # GPUs the route is whatever the probe found (only Hopper's was measured)
        expected = num_out % 128 == 0
        assert routed == expected or not hopper, f"{num_out} x {depth}: routed: {routed}"
        args = (a_fp8, a_scale, w_fp8, w_scale, torch.bfloat16, (128, 128))
        _assert_close_to_reference(
            fp8_gemm_blockwise(*args), fp8_gemm_blockwise_ref(*args), _BF16_RTOL
        )
    # captured in a CUDA graph, the replay follows new input
    static_x = x.clone()

    def forward() -> torch.Tensor:
        g_fp8, g_scale = quantize_per_token_group(static_x, 128, scale_m_major=True)
        return fp8_gemm_blockwise(g_fp8, g_scale, w_fp8, w_scale, torch.bfloat16)

    new_x = _activations(num_tokens, depth, "cuda", seed=9)
    _, captured, eager = _replay_with_new_input(forward, static_x, new_x)
    _assert_close_to_reference(captured, eager, 2**-8)


@fp8_cuda_test
def test_cuda_graph_replay_follows_new_input() -> None:
    num_tokens, num_out, depth = 7, 576, 1024
    x = _activations(num_tokens, depth, "cuda")
    w_fp8, w_scale = quantize_weight_per_channel(torch.randn(num_out, depth, device="cuda"))
    wb_fp8, wb_scale = _blockwise_weight(num_out, depth, (128, 128), "cuda")
    bias = torch.randn(num_out, device="cuda").bfloat16()
    static_scale = torch.tensor([0.02], device="cuda")

    def forward() -> list[torch.Tensor]:
        a_fp8, a_scale = quantize_per_token(x)
        s_fp8, s_scale = quantize_per_token(x, static_scale)
        g_fp8, g_scale = quantize_per_token_group(x)
        return [
            fp8_gemm_rowwise(a_fp8, a_scale, w_fp8, w_scale, bias, torch.bfloat16),
            fp8_gemm_rowwise(s_fp8, s_scale, w_fp8, w_scale, None, torch.bfloat16),
            fp8_gemm_blockwise(g_fp8, g_scale, wb_fp8, wb_scale, torch.bfloat16),
        ]

    new_x = _activations(num_tokens, depth, "cuda", seed=5)
    before, captured, eager = _replay_with_new_input(forward, x, new_x)
    for replayed, expected, old in zip(captured, eager, before, strict=True):
        assert not torch.equal(replayed, old), "the replay did not follow the new input"
        # the same kernels on the same data; cuBLASLt may pick another algorithm in capture
        _assert_close_to_reference(replayed, expected, 2**-8)
    assert torch.equal(captured[2], eager[2])  # Triton: deterministic
