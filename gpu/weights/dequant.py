"""Vectorized torch dequantization of GGUF tensor data (ggml block layouts).

Works on any device: move the raw bytes to the GPU first and the dequantization runs there.
Results are computed in float32 with the same operation order as ggml's reference
(`gguf.quants`), so float32 output is bit-identical to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import IntEnum

import torch

from gpu.models.config import UnsupportedModelError


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# (elements per block, bytes per block), as in ggml's type traits.
GGML_BLOCK_LAYOUTS: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
}

SUPPORTED_TYPES: tuple[GGMLType, ...] = (
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.Q8_0,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
)


def ggml_type_name(ggml_type: int) -> str:
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"unknown ggml type {ggml_type}"


def tensor_num_bytes(ggml_type: int, shape: Sequence[int]) -> int | None:
    """Bytes of a tensor's data, or None for a type whose layout is unknown."""
    layout = GGML_BLOCK_LAYOUTS.get(ggml_type)
    if layout is None:
        return None
    block_size, type_size = layout
    num_elements = math.prod(shape)
    return num_elements // block_size * type_size


def dequantize(
    raw_u8: torch.Tensor,  # [num_bytes] uint8, on any device
    ggml_type: int,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode raw GGUF tensor data into a new `dtype` tensor of `shape` (numpy order)."""
    if ggml_type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"unsupported GGUF tensor type {ggml_type_name(ggml_type)}; supported: "
            + ", ".join(t.name for t in SUPPORTED_TYPES)
        )
    shape = tuple(int(d) for d in shape)
    block_size, _ = GGML_BLOCK_LAYOUTS[ggml_type]
    num_elements = math.prod(shape)
    expected_bytes = tensor_num_bytes(ggml_type, shape)
    if num_elements % block_size or raw_u8.numel() != expected_bytes:
        raise ValueError(
            f"{ggml_type_name(ggml_type)} tensor of shape {shape} needs {expected_bytes} bytes "
            f"in whole blocks of {block_size}, got {raw_u8.numel()}"
        )
    raw_u8 = raw_u8.reshape(-1)
    if ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        source_dtype = {
            GGMLType.F32: torch.float32,
            GGMLType.F16: torch.float16,
            GGMLType.BF16: torch.bfloat16,
        }[GGMLType(ggml_type)]
        values = raw_u8.view(source_dtype).reshape(shape)
        return values.to(dtype, copy=True)
    decode = _BLOCK_DECODERS[GGMLType(ggml_type)]
    return decode(raw_u8.view(-1, GGML_BLOCK_LAYOUTS[ggml_type][1])).reshape(shape).to(dtype)


def _half_column(
    blocks_u8: torch.Tensor,  # [num_blocks, bytes_per_block] uint8
    start: int,
) -> torch.Tensor:  # [num_blocks, 1] float32
    return blocks_u8[:, start : start + 2].contiguous().view(torch.float16).float()


def _unpack_nibbles(
    packed_u8: torch.Tensor,  # [num_blocks, 16] uint8
) -> torch.Tensor:  # [num_blocks, 32] float32: low nibbles first, then high nibbles
    return torch.cat((packed_u8 & 0x0F, packed_u8 >> 4), dim=1).float()


def _decode_q8_0(
    blocks_u8: torch.Tensor,  # [num_blocks, 34] uint8: f16 scale, 32 x int8
) -> torch.Tensor:  # [num_blocks, 32] float32
    scale = _half_column(blocks_u8, 0)
    return scale * blocks_u8[:, 2:].view(torch.int8).float()


def _decode_q4_0(
    blocks_u8: torch.Tensor,  # [num_blocks, 18] uint8: f16 scale, 16 bytes of nibbles
) -> torch.Tensor:  # [num_blocks, 32] float32
    scale = _half_column(blocks_u8, 0)
    return scale * (_unpack_nibbles(blocks_u8[:, 2:]) - 8.0)


def _decode_q4_1(
    blocks_u8: torch.Tensor,  # [num_blocks, 20] uint8: f16 scale, f16 min, 16 bytes of nibbles
) -> torch.Tensor:  # [num_blocks, 32] float32
    scale = _half_column(blocks_u8, 0)
    minimum = _half_column(blocks_u8, 2)
    # Multiply then add (no fused multiply-add), matching ggml's reference rounding.
    return scale * _unpack_nibbles(blocks_u8[:, 4:]) + minimum


_BLOCK_DECODERS = {
    GGMLType.Q8_0: _decode_q8_0,
    GGMLType.Q4_0: _decode_q4_0,
    GGMLType.Q4_1: _decode_q4_1,
}
