"""fp8_gemv (weight-only FP8, activations unquantized): the reference against numpy, the
argument checks, the config heuristic, the Triton kernel vs the reference in the
interpreter (both scale layouts, bias, split-K, M of 1, 3, 16 and 20, partial blocks)
and on CUDA at Llama-3.1-8B's projection shapes, and a CUDA graph replay."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kernels import fp8_gemv as gemv
from kernels.fp8_gemv import (
    Fp8GemvConfig,
    fp8_gemv,
    fp8_gemv_config,
    fp8_gemv_ref,
    fp8_gemv_triton,
)
from kernels.fp8_quant import FP8_DTYPE, FP8_MAX, quantize_weight_per_channel
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
    needs_triton,
)


def fp8_cuda_test(test: Callable[..., None]) -> Callable[..., None]:
    """A `gpu` test that also needs fp8 conversions (compute capability 8.9+)."""
    has_fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    needs_fp8 = pytest.mark.skipif(not has_fp8, reason="needs compute capability >= 8.9")
    return cuda_test(needs_fp8(test))


def _weight(
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


def _activations(num_tokens: int, depth: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(num_tokens * 7 + depth)
    x = torch.randn(num_tokens, depth, generator=generator)
    x *= torch.exp(torch.rand(num_tokens, 1, generator=generator) * 4)  # rows differ in scale
    if dtype == torch.float16:
        x *= 2**-10  # keeps sums over thousands of products inside float16's range
    return x.to(dtype).to(device)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Errors measured against the output's largest value: the sums over K mix signs, so an
    output can be far smaller than the products it adds up, whose rounding its error
    follows. A wrong scale, row or block errs by the output's own size."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(expected).all(), "the case overflows the output dtype"
    scale = float(expected.float().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * scale)


def test_reference_matches_numpy() -> None:
    x = _activations(3, 300, torch.float32, "cpu")
    bias = torch.randn(200)
    x_np = x.numpy().astype(np.float64)
    w_fp8, w_scale = _weight(200, 300, False, "cpu")
    w_np = w_fp8.float().numpy().astype(np.float64) * w_scale.numpy()[:, None]
    expected = x_np @ w_np.T + bias.numpy()
    for scale in (w_scale, w_scale[:, None]):
        _assert_close(
            fp8_gemv_ref(x, w_fp8, scale, bias=bias), torch.from_numpy(expected).float(), 1e-6
        )
    wb_fp8, block_scale = _weight(200, 300, True, "cpu")
    wb_np = wb_fp8.float().numpy().astype(np.float64)
    expected_b = np.zeros((3, 200))
    for nb in range(2):  # a sum of 128 x 128 block products, each times its scale
        for kb in range(3):
            n, k = slice(nb * 128, (nb + 1) * 128), slice(kb * 128, (kb + 1) * 128)
            expected_b[:, n] += (x_np[:, k] @ wb_np[n, k].T) * float(block_scale[nb, kb])
    out = fp8_gemv_ref(x, wb_fp8, block_scale=block_scale)
    _assert_close(out, torch.from_numpy(expected_b).float(), 1e-6)
    # Without Triton on CUDA the launcher is the reference, in x's dtype.
    x_bf16 = x.bfloat16()
    assert torch.equal(
        fp8_gemv(x_bf16, wb_fp8, block_scale=block_scale),
        fp8_gemv_ref(x_bf16, wb_fp8, block_scale=block_scale),
    )


def test_bad_arguments_name_the_culprit() -> None:
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w_fp8, w_scale = torch.zeros(128, 256, dtype=FP8_DTYPE), torch.ones(128)
    with pytest.raises(ValueError, match="must share K"):
        fp8_gemv(x, w_fp8[:, :128], w_scale)
    with pytest.raises(ValueError, match="exactly one of"):
        fp8_gemv(x, w_fp8)
    with pytest.raises(ValueError, match="exactly one of"):
        fp8_gemv(x, w_fp8, w_scale, torch.ones(1, 2))
    with pytest.raises(ValueError, match="w_scale must be a float32"):
        fp8_gemv(x, w_fp8, w_scale.half())
    with pytest.raises(ValueError, match=r"w_scale must be \[128\] or \[128, 1\]"):
        fp8_gemv(x, w_fp8, torch.ones(256))
    with pytest.raises(ValueError, match=r"block_scale must be \[1, 2\]"):
        fp8_gemv(x, w_fp8, block_scale=torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"bias must be \[128\]"):
        fp8_gemv(x, w_fp8, w_scale, bias=torch.ones(4))
    with pytest.raises(ValueError, match="x must be torch.bfloat16"):
        fp8_gemv(x.to(torch.int32), w_fp8, w_scale)
    with pytest.raises(ValueError, match="w_fp8 must be torch.float8_e4m3fn"):
        fp8_gemv(x, w_fp8.bfloat16(), w_scale)
    with pytest.raises(ValueError, match="x must be 2-D"):
        fp8_gemv(x[0], w_fp8, w_scale)


@needs_triton
def test_triton_launcher_refuses_bad_configs_and_cpu_tensors() -> None:
    x, w_fp8 = torch.zeros(2, 256), torch.zeros(128, 256, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fp8_gemv_triton(x, w_fp8, torch.ones(128))
    bad = Fp8GemvConfig(16, 256, 1)  # block_k 256 > 128 with block scales
    with pytest.raises(ValueError, match="block_n, block_k <= 128"):
        gemv._check_config(bad, blockwise=True)
    with pytest.raises(ValueError, match="tl.dot needs"):
        gemv._check_config(Fp8GemvConfig(8, 128, 1), blockwise=False)
    with pytest.raises(ValueError, match="powers of two"):
        gemv._check_config(Fp8GemvConfig(24, 128, 1), blockwise=False)


@pytest.mark.parametrize("blockwise", [False, True])
def test_config_fits_the_kernel_and_fills_the_gpu(blockwise: bool) -> None:
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (1024, 4096), (200, 300)]
    for num_tokens in range(1, 17):
        for num_out, depth in shapes:
            config = fp8_gemv_config(num_tokens, num_out, depth, blockwise=blockwise)
            gemv._check_config(config, blockwise)
            programs = -(-num_out // config.block_n) * config.split_k
            k_steps = -(-depth // config.block_k)
            # split until ~4 programs per SM, unless a split would get under 4 K steps
            assert programs >= 4 * 132 or k_steps // (2 * config.split_k) < 4
            assert config.split_k == 1 or k_steps // config.split_k >= 4
    down = fp8_gemv_config(1, 4096, 14336, blockwise=blockwise)
    assert down.split_k > 1  # 4096 columns alone leave the GPU half idle


@contextlib.contextmanager
def _ieee_float32_matmul() -> Iterator[None]:
    """The reference's float32 matmul in full precision, whatever another test set
    (TF32 on CUDA would err by 2^-11)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def compare(cases: list[tuple[int, int, int, str, bool, bool, tuple | None]], device: str) -> None:
    """fp8_gemv_triton vs fp8_gemv_ref on (M, N, K, x dtype, blockwise, bias, config)
    cases; config None takes fp8_gemv_config's."""
    interpreted = device == "cpu"
    if interpreted:
        assert_interpreted(gemv._gemv_kernel, gemv._split_k_sum_kernel)
    for num_tokens, num_out, depth, dtype_name, blockwise, with_bias, config in cases:
        dtype = getattr(torch, dtype_name)
        x = _activations(num_tokens, depth, dtype, device)
        w_fp8, scale = _weight(num_out, depth, blockwise, device)
        bias = torch.randn(num_out).to(dtype).to(device) * 10 if with_bias else None
        scales = {"block_scale": scale} if blockwise else {"w_scale": scale}
        with _ieee_float32_matmul():
            expected = fp8_gemv_ref(x, w_fp8, bias=bias, **scales)
        cfg = None if config is None else Fp8GemvConfig(*config)
        got = fp8_gemv_triton(x, w_fp8, bias=bias, config=cfg, **scales)
        # Tolerance: both sum the products (exact for 16-bit x: e4m3 x bf16 fits float32's
        # mantissa) in float32 and round once; the order of the additions and where the
        # scale is applied differ. float32 output: 1e-5 of the largest output. 16-bit
        # output: the two may round to neighbours, 2^-8 of a value for bf16; the
        # interpreter truncates float32 to bf16 (GPUs round), one more step.
        rtol = 1e-5 if dtype == torch.float32 else (2**-6 if interpreted else 2**-7)
        try:
            _assert_close(got, expected, rtol)
        except AssertionError as error:
            raise AssertionError(
                f"case {num_tokens, num_out, depth, dtype_name, blockwise, with_bias, config}"
            ) from error
        if not interpreted:  # deterministic: split-K partials are added in a fixed order
            assert torch.equal(got, fp8_gemv_triton(x, w_fp8, bias=bias, config=cfg, **scales))


def _interpreter_cases() -> list[tuple[int, int, int, str, bool, bool, tuple | None]]:
    """Every M in {1, 3, 16} meets each shape and scale layout once, with split-K on and off,
    bias on and off, bf16 and float32 x; the tiles are small for the interpreter's sake."""
    cases: list[tuple[int, int, int, str, bool, bool, tuple | None]] = []
    configs = [(16, 64, 1), (32, 32, 4), (16, 128, 2), (32, 64, 1)]  # (block_n, block_k, split_k)
    shapes = [(200, 300), (256, 256), (130, 520)]  # partial blocks; whole; K past 4 blocks
    for m_index, num_tokens in enumerate((1, 3, 16)):
        for index, (num_out, depth) in enumerate(shapes):
            for blockwise in (False, True):
                config = configs[(m_index + index + blockwise) % len(configs)]
                dtype = ("bfloat16", "float32")[(index + num_tokens) % 2]
                with_bias = (index + blockwise) % 2 == 1
                cases.append((num_tokens, num_out, depth, dtype, blockwise, with_bias, config))
    cases.append((1, 300, 1000, "bfloat16", True, True, None))  # the heuristic's own tiles
    cases.append((2, 96, 4096, "float16", False, True, None))  # few tiles: split-K
    cases.append((20, 64, 256, "bfloat16", False, True, (16, 64, 2)))  # two 16-row tiles
    return cases


test_triton_matches_reference_in_interpreter = interpreted_test(
    __file__, "compare", kwargs={"cases": _interpreter_cases(), "device": "cpu"}
)


# Llama-3.1-8B: q/k/v fused, o, gate/up halves, down, k or v alone; plus partial blocks.
_MODEL_SHAPES = [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]


@fp8_cuda_test
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 16])
def test_triton_matches_reference_on_cuda(num_tokens: int) -> None:
    cases: list[tuple[int, int, int, str, bool, bool, tuple | None]] = []
    for index, (num_out, depth) in enumerate(_MODEL_SHAPES + [(200, 1000)]):
        for blockwise in (False, True):
            with_bias = (index + blockwise) % 2 == 0
            cases.append((num_tokens, num_out, depth, "bfloat16", blockwise, with_bias, None))
    cases.append((num_tokens, 4096, 4096, "float32", False, True, None))
    cases.append((num_tokens, 4096, 4096, "float16", True, False, None))
    compare(cases, "cuda")
    compare(_interpreter_cases(), "cuda")


@fp8_cuda_test
def test_cuda_graph_replay_follows_new_input() -> None:
    num_out, depth = 4096, 14336  # split-K: two kernels in the graph
    x = _activations(1, depth, torch.bfloat16, "cuda")
    w_fp8, w_scale = _weight(num_out, depth, False, "cuda")
    wb_fp8, block_scale = _weight(num_out, depth, True, "cuda")
    bias = torch.randn(num_out, device="cuda").bfloat16()

    def forward() -> list[torch.Tensor]:
        return [
            fp8_gemv(x, w_fp8, w_scale, bias=bias),
            fp8_gemv(x, wb_fp8, block_scale=block_scale),
        ]

    before = forward()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    x.copy_(_activations(1, depth, torch.bfloat16, "cuda") * -0.5)
    graph.replay()
    torch.cuda.synchronize()
    for replayed, eager, old in zip(captured, forward(), before, strict=True):
        assert not torch.equal(replayed, old), "the replay did not follow the new input"
        assert torch.equal(replayed, eager)
