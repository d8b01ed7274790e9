"""fp8_gemv_w8a8 (FP8 weights times activations quantized in the kernel): the reference
quantizes x as the FP8 GEMMs of larger batches do (their references give its products),
argument checks, the Triton kernel against the reference in the interpreter (both scale
layouts, a static input scale, bias, split-K, M of 1, 3, 16 and 20, partial blocks) and on
CUDA at Llama-3.1-8B's projection shapes, its distance from the unquantized product, and a
CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_gemv_w8a8 as w8a8
from kernels.fp8_gemm import fp8_gemm_blockwise_ref, fp8_gemm_rowwise_ref
from kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv_ref
from kernels.fp8_gemv_w8a8 import (
    fp8_gemv_w8a8,
    fp8_gemv_w8a8_ref,
    fp8_gemv_w8a8_triton,
    quantize_activations_ref,
    w8a8_gemv_config,
)
from kernels.fp8_quant import FP8_DTYPE, quantize_per_token_group_ref, quantize_per_token_ref
from tests.kernels._fp8_gemv_cases import (
    assert_close_to_largest,
    check_graph_replay_follows_new_input,
    fp8_cuda_test,
    ieee_float32_matmul,
    random_activations,
    random_weight,
)
from tests.kernels._triton_interpreter import assert_interpreted, interpreted_test, needs_triton

Case = tuple[int, int, int, str, str, bool, tuple | None]
"""(M, N, K, x dtype, scales: "block" | "channel" | "static", bias, config or None)."""


def _scales(kind: str, num_out: int, depth: int, device: str) -> tuple[torch.Tensor, dict]:
    w_fp8, scale = random_weight(num_out, depth, kind == "block", device)
    if kind == "block":
        return w_fp8, {"block_scale": scale}
    if kind == "static":
        return w_fp8, {"w_scale": scale, "input_scale": torch.tensor([1.0], device=device)}
    return w_fp8, {"w_scale": scale}


@pytest.mark.parametrize("kind", ["block", "channel", "static"])
def test_reference_is_the_large_batch_gemm_on_the_same_quantized_x(kind: str) -> None:
    """A token's products are those the FP8 GEMMs of larger steps compute: the same
    quantized activations (per token and 128 columns for block scales, per token or the
    static scale otherwise) times the same weights."""
    x = random_activations(5, 300, torch.float32, "cpu")
    w_fp8, scales = _scales(kind, 200, 300, "cpu")
    bias = torch.randn(200)
    with ieee_float32_matmul():
        got = fp8_gemv_w8a8_ref(x, w_fp8, bias=bias if kind != "block" else None, **scales)
        if kind == "block":
            x_fp8, x_scale = quantize_per_token_group_ref(x, 128)
            expected = fp8_gemm_blockwise_ref(
                x_fp8, x_scale, w_fp8, scales["block_scale"], torch.float32
            )
        else:
            x_fp8, x_scale = quantize_per_token_ref(x, scales.get("input_scale"))
            expected = fp8_gemm_rowwise_ref(
                x_fp8, x_scale, w_fp8, scales["w_scale"], bias, torch.float32
            )
    assert_close_to_largest(got, expected, 1e-6)
    # x really is quantized: e4m3 keeps 3 mantissa bits, so most values move.
    x_seen = quantize_activations_ref(x, kind == "block", scales.get("input_scale"))
    assert (x_seen != x).float().mean() > 0.5
    assert torch.allclose(x_seen, x, rtol=2**-4, atol=1e-3 * float(x.abs().max()))


def test_bad_arguments_name_the_culprit() -> None:
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w_fp8, w_scale = torch.zeros(128, 256, dtype=FP8_DTYPE), torch.ones(128)
    block_scale = torch.ones(1, 2)
    with pytest.raises(ValueError, match="must share K"):
        fp8_gemv_w8a8(x, w_fp8[:, :128], w_scale)
    with pytest.raises(ValueError, match="exactly one of"):
        fp8_gemv_w8a8(x, w_fp8)
    with pytest.raises(ValueError, match="input_scale goes with per-channel weights"):
        fp8_gemv_w8a8(x, w_fp8, block_scale=block_scale, input_scale=torch.ones(1))
    with pytest.raises(ValueError, match="input_scale must be one float32"):
        fp8_gemv_w8a8(x, w_fp8, w_scale, input_scale=torch.ones(2))


@needs_triton
def test_triton_launcher_refuses_bad_configs_and_cpu_tensors() -> None:
    x, w_fp8 = torch.zeros(2, 256), torch.zeros(128, 256, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fp8_gemv_w8a8_triton(x, w_fp8, torch.ones(128))
    for config, reason in (
        (Fp8GemvConfig(64, 64, 1), "block_k must be 128"),
        (Fp8GemvConfig(256, 128, 1), "block_n, block_k <= 128"),
    ):
        with pytest.raises(ValueError, match=reason):
            w8a8._check_w8a8_config(config)


def test_config_uses_whole_groups_and_fills_the_gpu() -> None:
    for num_out, depth in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (200, 300)]:
        config = w8a8_gemv_config(1, num_out, depth)
        w8a8._check_w8a8_config(config)
        programs = -(-num_out // config.block_n) * config.split_k
        assert programs >= 4 * 132 or -(-depth // 128) // (2 * config.split_k) < 4


def compare(cases: list[Case], device: str) -> None:
    """fp8_gemv_w8a8_triton against fp8_gemv_w8a8_ref."""
    interpreted = device == "cpu"
    if interpreted:
        assert_interpreted(w8a8._w8a8_gemv_kernel)
    for num_tokens, num_out, depth, dtype_name, kind, with_bias, config in cases:
        dtype = getattr(torch, dtype_name)
        x = random_activations(num_tokens, depth, dtype, device)
        w_fp8, scales = _scales(kind, num_out, depth, device)
        bias = torch.randn(num_out).to(dtype).to(device) * 10 if with_bias else None
        with ieee_float32_matmul():
            expected = fp8_gemv_w8a8_ref(x, w_fp8, bias=bias, **scales)
        cfg = None if config is None else Fp8GemvConfig(*config)
        got = fp8_gemv_w8a8_triton(x, w_fp8, bias=bias, config=cfg, **scales)
        # Both multiply the same e4m3 values (the kernel quantizes x as the reference does,
        # bit for bit) and add in float32, in another order; a GPU's FP8 MMA adds each K
        # step's 128 products at reduced precision, about 2^-13 of their magnitude. 16-bit
        # outputs may round to neighbours (2^-8 for bf16; the interpreter truncates).
        rtol = 1e-5 if interpreted else 2**-10
        if dtype != torch.float32:
            rtol = max(rtol, 2**-6 if interpreted else 2**-7)
        try:
            assert_close_to_largest(got, expected, rtol)
        except AssertionError as error:
            case = (num_tokens, num_out, depth, dtype_name, kind, with_bias, config)
            raise AssertionError(f"case {case}") from error
        if not interpreted:
            assert torch.equal(got, fp8_gemv_w8a8_triton(x, w_fp8, bias=bias, config=cfg, **scales))


def _interpreter_cases() -> list[Case]:
    """Every M in {1, 3, 16} meets each shape and scale kind, with split-K on and off, bias
    on and off, bf16 and float32 x; 16-row weight tiles for the interpreter's sake."""
    cases: list[Case] = []
    configs = [(16, 128, 1), (32, 128, 2), (16, 128, 4)]
    shapes = [(200, 300), (256, 256), (130, 520)]  # partial blocks; whole; K past 4 blocks
    for m_index, num_tokens in enumerate((1, 3, 16)):
        for index, (num_out, depth) in enumerate(shapes):
            for kind_index, kind in enumerate(("block", "channel", "static")):
                config = configs[(m_index + index + kind_index) % len(configs)]
                dtype = ("bfloat16", "float32")[(index + num_tokens) % 2]
                with_bias = (index + kind_index) % 2 == 1
                cases.append((num_tokens, num_out, depth, dtype, kind, with_bias, config))
    cases.append((2, 96, 4096, "float16", "channel", True, None))  # the heuristic: split-K
    cases.append((20, 64, 256, "bfloat16", "block", True, (16, 128, 2)))  # two 16-row tiles
    return cases


test_triton_matches_reference_in_interpreter = interpreted_test(
    __file__, "compare", kwargs={"cases": _interpreter_cases(), "device": "cpu"}
)


def check_division_is_correctly_rounded(device: str) -> None:
    """The kernel's division (a reciprocal, a multiply and one FMA correction) gives the
    correctly rounded quotient, bit for bit, on bf16 activations over their dynamic scales:
    a quotient one float32 step off would sometimes round to another e4m3 value."""
    import triton
    import triton.language as tl

    @triton.jit
    def divide_kernel(x_ptr, divisor_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
        divisor = tl.load(divisor_ptr + offs, mask=offs < n, other=1.0)
        out = w8a8._divide(x, divisor, tl.math.div_rn(1.0, divisor))
        tl.store(out_ptr + offs, out, mask=offs < n)

    if device == "cpu":
        assert_interpreted(divide_kernel)
    generator = torch.Generator().manual_seed(5)
    x = random_activations(64, 4096, torch.bfloat16, "cpu").float().flatten()
    divisor = x.view(64, 32, 128).abs().amax(-1).repeat_interleave(128, -1).flatten() / 448
    divisor *= torch.exp(torch.randn(divisor.shape, generator=generator) * 0.01)
    out = torch.empty_like(x, device=device)
    n = x.numel()
    divide_kernel[(triton.cdiv(n, 1024),)](
        x.to(device), divisor.to(device), out, n, BLOCK=1024, enable_fp_fusion=False
    )
    exact = x / divisor
    assert (x * (1.0 / divisor) != exact).sum() > n // 10  # a multiply alone is often off
    assert torch.equal(out.cpu(), exact)
    # The block scales: absmax / 448, from 448's reciprocal rounded to float32 once.
    absmax = x.abs()
    by_448 = torch.full_like(absmax, 448.0)
    divide_kernel[(triton.cdiv(n, 1024),)](
        absmax.to(device), by_448.to(device), out, n, BLOCK=1024, enable_fp_fusion=False
    )
    assert torch.equal(out.cpu(), absmax / 448.0)


test_division_is_correctly_rounded_in_interpreter = interpreted_test(
    __file__, "check_division_is_correctly_rounded", kwargs={"device": "cpu"}
)


@fp8_cuda_test
def test_division_is_correctly_rounded_on_cuda() -> None:
    check_division_is_correctly_rounded("cuda")


# Llama-3.1-8B: q/k/v fused, o, gate/up, down, k or v alone; plus partial blocks.
_MODEL_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096)]


@fp8_cuda_test
@pytest.mark.parametrize("num_tokens", [1, 3, 16])
def test_triton_matches_reference_on_cuda(num_tokens: int) -> None:
    cases: list[Case] = []
    for index, (num_out, depth) in enumerate(_MODEL_SHAPES + [(200, 1000)]):
        for kind in ("block", "channel"):
            with_bias = (index + len(kind)) % 2 == 0
            cases.append((num_tokens, num_out, depth, "bfloat16", kind, with_bias, None))
    cases.append((num_tokens, 4096, 4096, "bfloat16", "static", False, None))
    cases.append((num_tokens, 4096, 4096, "float16", "block", False, (128, 128, 2)))
    compare(cases, "cuda")
    compare(_interpreter_cases(), "cuda")


@fp8_cuda_test
@pytest.mark.parametrize("kind", ["block", "channel"])
def test_quantized_activations_stay_near_the_unquantized_product(kind: str) -> None:
    """What quantizing x costs at gate/up's shape: within e4m3's rounding of x (3 mantissa
    bits, errors that mostly cancel over 4,096 products) of the weight-only product."""
    x = random_activations(1, 4096, torch.bfloat16, "cuda")
    w_fp8, scales = _scales(kind, 28672, 4096, "cuda")
    exact = fp8_gemv_ref(x.float(), w_fp8, **scales)
    got = fp8_gemv_w8a8(x, w_fp8, **scales).float()
    relative = float((got - exact).norm() / exact.norm())
    assert 1e-4 < relative < 0.05, relative


@fp8_cuda_test
def test_cuda_graph_replay_follows_new_input() -> None:
    check_graph_replay_follows_new_input(fp8_gemv_w8a8)
