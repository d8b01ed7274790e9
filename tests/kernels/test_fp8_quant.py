"""fp8_quant: the references against numpy (scales, rounding, saturation, partial groups,
zero rows, round trips), the weight helpers, Triton vs reference (interpreter and CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import fp8_quant
from kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALE,
    dequantize_blockwise,
    dequantize_per_channel,
    quantize_per_token,
    quantize_per_token_group,
    quantize_per_token_group_ref,
    quantize_per_token_group_triton,
    quantize_per_token_ref,
    quantize_per_token_triton,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)
from tests.kernels._triton_interpreter import assert_interpreted, triton_vs_reference_tests


def _np_e4m3(v: np.ndarray) -> np.ndarray:
    """v rounded to nearest even on the e4m3 grid after saturating at 448 (float64): the
    spacing is 2^(e - 3) in binade e >= -6, subnormals share binade -6's spacing."""
    v = np.clip(v.astype(np.float64), -FP8_MAX, FP8_MAX)
    with np.errstate(divide="ignore"):
        binade = np.maximum(np.floor(np.log2(np.abs(v))), -6)
    spacing = np.exp2(binade - 3)
    return np.round(v / spacing) * spacing  # np.round: ties to even


def _np_quantize(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return _np_e4m3(x.astype(np.float32) / scale.astype(np.float32))


def _np_scale(absmax: np.ndarray) -> np.ndarray:
    return np.maximum(absmax.astype(np.float32) / np.float32(FP8_MAX), np.float32(FP8_MIN_SCALE))


def _rows(dtype: torch.dtype, num_cols: int = 1000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(num_cols)
    x = torch.randn(6, num_cols, generator=generator) * 3
    x[1] = 0.0  # a zero row must not divide by zero
    x[2] *= 1e3  # large magnitudes (within float16's range)
    x[3] *= 1e-5  # tiny magnitudes
    x[4] *= 1e-2
    x[4, num_cols // 3] = 1e3  # one outlier: the rest of the row lands in e4m3's subnormals
    return x.to(dtype)


def _assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor | np.ndarray) -> None:
    assert actual.dtype == FP8_DTYPE
    expected_t = torch.as_tensor(expected).float()
    assert torch.equal(actual.float().cpu(), expected_t), "fp8 values differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_token_reference_matches_numpy(dtype: torch.dtype) -> None:
    x = _rows(dtype)
    x_fp8, scale = quantize_per_token_ref(x)
    x_np = x.float().numpy()
    expected_scale = _np_scale(np.abs(x_np).max(axis=1, keepdims=True))
    assert scale.dtype == torch.float32 and scale.shape == (6, 1)
    assert torch.equal(scale, torch.from_numpy(expected_scale))
    _assert_fp8_equal(x_fp8, _np_quantize(x_np, expected_scale))
    assert scale[1, 0] == np.float32(FP8_MIN_SCALE) and torch.all(x_fp8[1].float() == 0)
    assert torch.all(x_fp8.float().abs().amax(dim=1)[[0, 2, 3, 4, 5]] == FP8_MAX)
    assert torch.equal(quantize_per_token(x)[0].float(), x_fp8.float())  # CPU: the reference


def test_static_scale_is_used_for_every_row_and_saturates() -> None:
    x = torch.tensor([[1.0, -2.0, 100.0, 300.0], [0.0, 3.0, -1000.0, 0.1]])
    static_scale = torch.tensor([0.5])
    x_fp8, scale = quantize_per_token_ref(x, static_scale)
    assert scale.shape == (2, 1) and torch.all(scale == 0.5)
    # 200 lies halfway between 192 and 208: to even. 600 and -2000 saturate (torch's plain
    # cast would give NaN).
    assert x_fp8.float().tolist() == [[2.0, -4.0, 192.0, 448.0], [0.0, 6.0, -448.0, 0.203125]]
    _assert_fp8_equal(x_fp8, _np_quantize(x.numpy(), np.array(0.5, np.float32)))


def _round_trip_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Rounding moves a value by at most half its spacing: 2^-4 of itself in e4m3's normal
    # range (3 mantissa bits), half the subnormal spacing 2^-9 (x scale) below it.
    return torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_within_half_an_e4m3_step(dtype: torch.dtype) -> None:
    x = _rows(dtype, num_cols=333)
    x_fp8, scale = quantize_per_token_ref(x)
    error = (x_fp8.float() * scale - x.float()).abs()
    assert torch.all(error <= _round_trip_error_bound(x.float(), scale))
    absmax = x.float().abs().amax(dim=1, keepdim=True)
    assert torch.all(error <= absmax * 2**-4)

    g_fp8, g_scale = quantize_per_token_group_ref(x, 128)
    per_value = g_scale.repeat_interleave(128, dim=1)[:, :333]
    g_error = (g_fp8.float() * per_value - x.float()).abs()
    assert torch.all(g_error <= _round_trip_error_bound(x.float(), per_value))


@pytest.mark.parametrize(("num_cols", "group_size"), [(300, 128), (256, 128), (200, 64), (7, 4)])
def test_group_reference_matches_numpy(num_cols: int, group_size: int) -> None:
    x = _rows(torch.bfloat16, num_cols)
    x[5, -1] = 1e3  # only the last (possibly partial) group sees it
    x_fp8, scale = quantize_per_token_group_ref(x, group_size)
    num_groups = -(-num_cols // group_size)
    assert scale.shape == (6, num_groups) and scale.dtype == torch.float32
    x_np = x.float().numpy()
    expected_q = np.empty_like(x_np)
    for g in range(num_groups):
        cols = slice(g * group_size, (g + 1) * group_size)
        group_scale = _np_scale(np.abs(x_np[:, cols]).max(axis=1))
        assert torch.equal(scale[:, g], torch.from_numpy(group_scale))
        expected_q[:, cols] = _np_quantize(x_np[:, cols], group_scale[:, None])
    _assert_fp8_equal(x_fp8, expected_q)
    assert scale[5, -1] == np.float32(1e3) / np.float32(FP8_MAX)
    if num_groups > 1:
        assert scale[5, 0] < scale[5, -1]
    assert torch.equal(quantize_per_token_group(x, group_size)[1], scale)


def test_weight_per_channel_and_per_tensor() -> None:
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * torch.tensor(
        [[1.0], [10.0], [0.0], [1e-3], [300.0]]
    )
    w_fp8, scale = quantize_weight_per_channel(w)
    expected_scale = _np_scale(np.abs(w.numpy()).max(axis=1))
    assert scale.shape == (5,) and torch.equal(scale, torch.from_numpy(expected_scale))
    _assert_fp8_equal(w_fp8, _np_quantize(w.numpy(), expected_scale[:, None]))
    for form in (scale, scale[:, None]):
        restored = dequantize_per_channel(w_fp8, form, torch.float32)
        assert torch.all((restored - w).abs() <= _round_trip_error_bound(w, scale[:, None]))

    t_fp8, t_scale = quantize_weight_per_tensor(w)
    assert t_scale.shape == (1,) and t_scale.item() == pytest.approx(w.abs().max() / FP8_MAX)
    _assert_fp8_equal(t_fp8, _np_quantize(w.numpy(), t_scale.numpy()))
    forms: tuple[torch.Tensor | float, ...] = (t_scale, t_scale[0], float(t_scale))
    for tensor_scale in forms:
        expected = (t_fp8.float() * tensor_scale).bfloat16()
        assert torch.equal(dequantize_per_channel(t_fp8, tensor_scale), expected)


@pytest.mark.parametrize(("shape", "block"), [((300, 200), (128, 128)), ((256, 96), (64, 32))])
def test_dequantize_blockwise_multiplies_each_block_by_its_scale(
    shape: tuple[int, int], block: tuple[int, int]
) -> None:
    generator = torch.Generator().manual_seed(2)
    w_fp8 = (torch.randn(shape, generator=generator) * 40).to(FP8_DTYPE)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale_inv = torch.rand(grid, generator=generator) + 0.01
    w = dequantize_blockwise(w_fp8, scale_inv, block, torch.float32)
    rows, cols = np.arange(shape[0]) // block[0], np.arange(shape[1]) // block[1]
    expected = w_fp8.float().numpy() * scale_inv.numpy()[rows][:, cols]
    assert torch.equal(w, torch.from_numpy(expected))
    assert dequantize_blockwise(w_fp8, scale_inv, block).dtype == torch.bfloat16


def test_bad_arguments_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="x must be"):
        quantize_per_token(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_per_token(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="at least one column"):
        quantize_per_token_group(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="static_scale must be float32"):
        quantize_per_token(torch.zeros(2, 4), torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="one-element"):
        quantize_per_token(torch.zeros(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match="group_size"):
        quantize_per_token_group(torch.zeros(2, 4), 0)
    w_fp8 = torch.zeros(300, 200, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match=r"scale_inv must be \(3, 2\)"):
        dequantize_blockwise(w_fp8, torch.ones(2, 2))
    with pytest.raises(ValueError, match="scale must be"):
        dequantize_per_channel(w_fp8, torch.ones(200))
    with pytest.raises(ValueError, match="w_fp8 must be torch.float8_e4m3fn"):
        dequantize_per_channel(w_fp8.float(), 1.0)


def _compare(num_rows: int, num_cols: int, device: str) -> None:
    """Bit-exact: the kernels divide with correct rounding and round to nearest even as
    the reference does on the CPU (on CUDA, torch divides by a Python scalar as a product
    with its reciprocal, a last-bit difference that is the reference's, not the kernel's)."""
    if device == "cpu":
        assert_interpreted(fp8_quant._per_token_kernel, fp8_quant._per_group_kernel)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x_cpu = _rows(dtype, num_cols).repeat(-(-num_rows // 6), 1)[:num_rows]
        x = x_cpu.to(device)
        static_scale = torch.tensor([0.03])
        for static in (None, static_scale):
            got = quantize_per_token_triton(x, None if static is None else static.to(device))
            expected = quantize_per_token_ref(x_cpu, static)
            assert torch.equal(got[1].cpu(), expected[1])
            _assert_fp8_equal(got[0], expected[0])
        for group_size in (128, 64, 100):
            got = quantize_per_token_group_triton(x, group_size)
            expected = quantize_per_token_group_ref(x_cpu, group_size)
            assert torch.equal(got[1].cpu(), expected[1])
            _assert_fp8_equal(got[0], expected[0])
            m_major = quantize_per_token_group_triton(x, group_size, scale_m_major=True)
            assert m_major[1].stride() == (1, x.shape[0])
            assert torch.equal(m_major[1].cpu(), expected[1])
            _assert_fp8_equal(m_major[0], expected[0])


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_rows": 7, "num_cols": 1300, "device": "cpu"},
        on_cuda={"num_rows": 300, "num_cols": 7168, "device": "cuda"},
    )
)
