"""MXFP4: known values, transformers' dequantization, quantize round trips, the Triton tile
dequantization."""

from __future__ import annotations

import pytest
import torch

from kernels._triton import HAS_TRITON, tl, triton
from kernels.fp8_experts import dequantize_fp8_experts, fp8_experts_from_mxfp4
from kernels.mxfp4 import E2M1_VALUES, MXFP4Tensor, dequantize_mxfp4, quantize_mxfp4
from tests.kernels._triton_interpreter import (
    assert_interpreted,
    cuda_test,
    interpreted_test,
)


def _random_mxfp4(shape: tuple[int, ...], seed: int, scale_range=(0, 255)) -> MXFP4Tensor:
    """Random [..., rows, cols] MXFP4 with scales drawn from scale_range."""
    generator = torch.Generator().manual_seed(seed)
    *prefix, num_rows, num_cols = shape
    blocks = torch.randint(0, 256, (*prefix, num_rows, num_cols // 32, 16), generator=generator)
    scales = torch.randint(*scale_range, (*prefix, num_rows, num_cols // 32), generator=generator)
    return MXFP4Tensor(blocks.to(torch.uint8), scales.to(torch.uint8))


def test_each_code_at_each_scale_has_its_value() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    # byte i holds code 2i % 16 (low nibble) then code (2i + 1) % 16: 32 values per group
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(2)  # [16]
    for k in (-127, -20, -1, 0, 1, 5, 127):
        t = MXFP4Tensor(packed.view(1, 1, 16), torch.tensor([[127 + k]], dtype=torch.uint8))
        expected = torch.tensor(E2M1_VALUES * 2, dtype=torch.float64) * 2.0**k
        assert t.shape == (1, 32)
        values = dequantize_mxfp4(t, torch.float32)
        # float64 -> float32 overflows to inf where the value does (k = 127, values >= 2)
        torch.testing.assert_close(values, expected.view(1, 32).float(), rtol=0, atol=0)
    low_first = MXFP4Tensor(
        torch.full((1, 1, 16), 0x72, dtype=torch.uint8), torch.full((1, 1), 128, dtype=torch.uint8)
    )
    assert dequantize_mxfp4(low_first, torch.bfloat16)[0, :2].tolist() == [2.0, 12.0]


def test_dequantize_equals_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    t = _random_mxfp4((3, 8, 64), seed=1)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        theirs = convert_moe_packed_tensors(t.blocks, t.scales, dtype=dtype)  # [3, 64, 8]
        ours = dequantize_mxfp4(t, dtype)
        assert ours.dtype == dtype and ours.shape == (3, 8, 64)
        torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=0, equal_nan=True)


def test_malformed_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="uint8"):
        MXFP4Tensor(torch.zeros(2, 1, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must match"):
        MXFP4Tensor(torch.zeros(2, 1, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))


def test_e2m1_values_times_powers_of_two_round_trip_exactly() -> None:
    t = _random_mxfp4((4, 6, 96), seed=2, scale_range=(100, 160))
    values = dequantize_mxfp4(t, torch.float32)
    again = quantize_mxfp4(values)
    assert again.shape == t.shape
    assert torch.equal(dequantize_mxfp4(again, torch.float32), values)
    assert torch.equal(quantize_mxfp4(values.to(torch.bfloat16)).blocks, again.blocks)


def test_quantize_error_is_bounded() -> None:
    w = torch.randn(5, 16, 128, generator=torch.Generator().manual_seed(3)) * 3
    q = quantize_mxfp4(w)
    error = (dequantize_mxfp4(q, torch.float32) - w).abs()
    group_amax = w.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    scale = torch.exp2(q.scales.float() - 127)[..., None]  # [..., G, 1]
    group_error = error.unflatten(-1, (-1, 32))
    # below 6 * scale the grid step is at most 2 * scale; above it the value saturates at 6
    in_range = w.abs().unflatten(-1, (-1, 32)) <= 6 * scale
    assert (group_error[in_range] <= scale.expand_as(group_error)[in_range]).all()
    assert (group_error <= group_amax / 2).all()
    assert ((group_amax / scale >= 4) & (group_amax / scale < 8)).all()
    assert error.square().mean().sqrt() < 0.2 * w.square().mean().sqrt()


def test_quantize_rounds_to_nearest_even_and_handles_zero_groups() -> None:
    # scale 2**0 (amax 4): midpoints 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    row = torch.zeros(1, 32)
    row[0, :8] = torch.tensor([4.0, 0.25, 0.75, 1.25, 2.5, 3.5, -5.0, -0.1])
    values = dequantize_mxfp4(quantize_mxfp4(row), torch.float32)
    assert values[0, :8].tolist() == [4.0, 0.0, 1.0, 1.0, 2.0, 4.0, -4.0, -0.0]
    zeros = quantize_mxfp4(torch.zeros(2, 64))
    assert torch.equal(dequantize_mxfp4(zeros, torch.float32), torch.zeros(2, 64))


if HAS_TRITON:

    @triton.jit
    def _dequant_tile_kernel(
        blocks_ptr, scales_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr
    ):
        """out [ROWS, COLS] from MXFP4 [ROWS, COLS // 32, 16], the tile transposed as the MoE
        GEMMs load it: [COLS // 2, ROWS] bytes, [COLS // 32, ROWS] scales."""
        rows = tl.arange(0, ROWS)
        byte_cols = tl.arange(0, COLS // 2)
        groups = tl.arange(0, COLS // 32)
        packed = tl.load(blocks_ptr + rows[None, :] * (COLS // 2) + byte_cols[:, None])
        scales = tl.load(scales_ptr + rows[None, :] * (COLS // 32) + groups[:, None])
        low, high = mxfp4_dequant_nibbles(packed, scales, out_ptr.dtype.element_ty)
        row_offsets = rows[None, :] * COLS + 2 * byte_cols[:, None]
        tl.store(out_ptr + row_offsets, low)
        tl.store(out_ptr + row_offsets + 1, high)

    from kernels.mxfp4 import mxfp4_dequant_nibbles


def compare_dequant_tile(device: str) -> None:
    if device == "cpu":
        assert_interpreted(_dequant_tile_kernel)
    t = _random_mxfp4((16, 64), seed=4)
    t = MXFP4Tensor(t.blocks.to(device), t.scales.to(device))
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        out = torch.empty(16, 64, dtype=dtype, device=device)
        _dequant_tile_kernel[(1,)](t.blocks, t.scales, out, ROWS=16, COLS=64)
        expected = dequantize_mxfp4(t, dtype)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


test_triton_dequant_tile_matches_reference_in_interpreter = interpreted_test(
    __file__, "compare_dequant_tile", kwargs={"device": "cpu"}
)


@cuda_test
def test_triton_dequant_tile_matches_reference_on_cuda() -> None:
    compare_dequant_tile("cuda")


@cuda_test
def test_quantize_on_cuda_equals_cpu() -> None:
    w = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(5))
    on_cpu, on_gpu = quantize_mxfp4(w), quantize_mxfp4(w.cuda())
    assert torch.equal(on_gpu.blocks.cpu(), on_cpu.blocks)
    assert torch.equal(on_gpu.scales.cpu(), on_cpu.scales)


def test_as_fp8_with_a_power_of_two_per_row_every_value_is_exact_within_its_rows_range() -> None:
    # scales within 14 binades of each row's largest: every value exact in e4m3 (--mxfp4-copy)
    w = _random_mxfp4((3, 8, 96), seed=4, scale_range=(114, 130))
    w.scales[1, 2] = 0  # a row of the smallest scale: exact on its own scale
    experts, num_rounded = fp8_experts_from_mxfp4(w)
    assert num_rounded == 0 and experts.scale.shape == (3, 8)
    exponents = torch.frexp(experts.scale)[1]
    assert torch.equal(experts.scale, torch.ldexp(torch.ones(3, 8), exponents - 1))
    assert torch.equal(
        dequantize_fp8_experts(experts, torch.float32), dequantize_mxfp4(w, torch.float32)
    )


def test_as_fp8_a_group_far_below_its_row_rounds_and_is_counted() -> None:
    w = _random_mxfp4((2, 4, 64), seed=5, scale_range=(126, 128))
    w.blocks[0, 1, 0] = 0x11  # every value of that group is the code 1 (0.5 x its scale)
    w.scales[0, 1, 0] = 127 - 30  # 2^-31: under e4m3's 2^-9 at the row's scale
    experts, num_rounded = fp8_experts_from_mxfp4(w)
    got = dequantize_fp8_experts(experts, torch.float32)
    want = dequantize_mxfp4(w, torch.float32)
    assert num_rounded == int((got != want).sum()) == 32
    assert torch.equal(got[0, 1, :32], torch.zeros(32))  # rounded to zero
    assert torch.equal(got[:, :, 32:], want[:, :, 32:])
