"""Vectorized torch dequantization of GGUF tensor data (ggml block layouts).

Works on any device: move the raw bytes to the GPU first and the dequantization runs there.
Results are computed in float32 with the same operation order as ggml's reference
(`gguf.quants`), so float32 output is bit-identical to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gpu.models.config import UnsupportedModelError
from gpu.weights.ggml_types import (  # noqa: F401 - re-exported for callers of dequant
    GGML_BLOCK_LAYOUTS,
    GGMLType,
    ggml_type_name,
    tensor_num_bytes,
)

SUPPORTED_TYPES: tuple[GGMLType, ...] = (
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.Q8_0,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
)


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
