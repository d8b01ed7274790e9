from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.models.config import UnsupportedModelError
from gpu.weights.dequant import (
    GGML_BLOCK_LAYOUTS,
    SUPPORTED_TYPES,
    GGMLType,
    dequantize,
    tensor_num_bytes,
)

gguf = pytest.importorskip("gguf")

QUANT_TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1)
SHAPE = (6, 128)  # 24 blocks of 32


def _finite_f16_bytes(rng: np.random.Generator, count: int) -> np.ndarray:  # [count, 2] uint8
    values = rng.standard_normal(count) * 0.05
    return values.astype(np.float16).view(np.uint8).reshape(count, 2)


def _random_blocks(ggml_type: GGMLType, num_blocks: int, seed: int) -> np.ndarray:
    """Random bytes in the type's block layout, with finite f16 scale/min fields."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_BLOCK_LAYOUTS[ggml_type]
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    blocks[:, 0:2] = _finite_f16_bytes(rng, num_blocks)
    if ggml_type == GGMLType.Q4_1:
        blocks[:, 2:4] = _finite_f16_bytes(rng, num_blocks)
    return blocks.reshape(-1)


def _assert_bitwise_equal(ours: torch.Tensor, theirs: np.ndarray) -> None:
    assert tuple(ours.shape) == theirs.shape
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(
        ours.numpy().view(np.uint32), theirs.astype(np.float32).view(np.uint32)
    )


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_blocks_match_gguf(ggml_type, seed):
    raw = _random_blocks(ggml_type, SHAPE[0] * SHAPE[1] // 32, seed)
    theirs = gguf.quants.dequantize(raw.reshape(SHAPE[0], -1), ggml_type)
    ours = dequantize(torch.from_numpy(raw.copy()), ggml_type, SHAPE)
    _assert_bitwise_equal(ours, theirs)


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: t.name)
def test_quantized_real_values_match_gguf(ggml_type):
    values = np.random.default_rng(7).standard_normal(SHAPE).astype(np.float32)
    raw = gguf.quants.quantize(values, ggml_type)
    theirs = gguf.quants.dequantize(raw, ggml_type)
    ours = dequantize(torch.from_numpy(raw.reshape(-1).copy()), ggml_type, SHAPE)
    _assert_bitwise_equal(ours, theirs)
    # And the round trip is close to the input (the codec really is the ggml one).
    assert np.abs(ours.numpy() - values).max() < (0.05 if ggml_type == GGMLType.Q8_0 else 0.6)


def test_float_types_match_gguf():
    rng = np.random.default_rng(3)
    f32 = rng.standard_normal(SHAPE).astype(np.float32)
    f16 = (rng.standard_normal(SHAPE) * 100).astype(np.float16)
    bf16_bits = rng.integers(0, 2**16, size=SHAPE, dtype=np.uint16)
    exponent = (bf16_bits >> 7) & 0xFF
    bf16_bits[exponent == 0xFF] &= 0xBFFF  # no inf/nan patterns
    cases = [
        (GGMLType.F32, f32.view(np.uint8)),
        (GGMLType.F16, f16.view(np.uint8)),
        (GGMLType.BF16, bf16_bits.view(np.uint8)),
    ]
    for ggml_type, raw in cases:
        theirs = gguf.quants.dequantize(raw, ggml_type)
        ours = dequantize(torch.from_numpy(raw.reshape(-1).copy()), ggml_type, SHAPE)
        _assert_bitwise_equal(ours, theirs)


@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_target_dtype_is_a_rounding_of_float32(ggml_type):
    raw = _random_blocks(ggml_type, 24, 5) if ggml_type in QUANT_TYPES else None
    if raw is None:
        values = np.random.default_rng(5).standard_normal(SHAPE).astype(np.float32)
        raw = gguf.quants.quantize(values, ggml_type).reshape(-1).view(np.uint8)
    raw_u8 = torch.from_numpy(raw.copy())
    as_f32 = dequantize(raw_u8, ggml_type, SHAPE)
    as_bf16 = dequantize(raw_u8, ggml_type, SHAPE, dtype=torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, as_f32.to(torch.bfloat16))


def test_float32_result_does_not_alias_the_input():
    raw_u8 = torch.from_numpy(np.ones(SHAPE, dtype=np.float32).view(np.uint8).reshape(-1).copy())
    out = dequantize(raw_u8, GGMLType.F32, SHAPE)
    raw_u8.zero_()
    assert out.sum().item() == SHAPE[0] * SHAPE[1]


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.IQ2_XS, 99])
def test_unsupported_types_name_the_type_and_the_supported_ones(ggml_type):
    num_bytes = tensor_num_bytes(ggml_type, (1, 256)) or 0
    with pytest.raises(UnsupportedModelError) as info:
        dequantize(torch.zeros(num_bytes, dtype=torch.uint8), ggml_type, (1, 256))
    message = str(info.value)
    name = GGMLType(ggml_type).name if ggml_type in GGMLType._value2member_map_ else "99"
    assert name in message
    for supported in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"):
        assert supported in message


def test_wrong_byte_count_is_rejected():
    with pytest.raises(ValueError, match="needs 68 bytes"):
        dequantize(torch.zeros(60, dtype=torch.uint8), GGMLType.Q8_0, (64,))


def test_block_layouts_agree_with_gguf():
    for ggml_type, layout in GGML_BLOCK_LAYOUTS.items():
        assert gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)] == layout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(ggml_type):
    if ggml_type in QUANT_TYPES:
        raw = _random_blocks(ggml_type, 24, 11)
    else:
        values = np.random.default_rng(11).standard_normal(SHAPE).astype(np.float32)
        raw = gguf.quants.quantize(values, ggml_type).reshape(-1).view(np.uint8)
    raw_u8 = torch.from_numpy(raw.copy())
    on_cpu = dequantize(raw_u8, ggml_type, SHAPE)
    on_gpu = dequantize(raw_u8.cuda(), ggml_type, SHAPE)
    assert on_gpu.is_cuda
    assert torch.equal(on_gpu.cpu(), on_cpu)
