"""Packed int4 projections on the CPU: weights of 4-bit codes in groups of 32 input columns.

Decode on a CPU reads every weight once per step, so the bytes per weight set its speed:
4-bit codes read 1/8 of float32's. torch's CPU int4 GEMM (`_weight_int4pack_mm_for_cpu`)
multiplies bf16 activations with them straight from the packed codes; with float32
activations it takes a slow generic path, so the launcher casts the activations to bf16 and
the result back to their dtype.

Two layouts:

    int4 groups (what loaders produce and the model loads, part by part; rows concatenate):
        codes:        [N, K] uint8, one code 0..15 per weight (K a multiple of 32)
        scales_zeros: [N, K / 32, 2] bfloat16, per row and group (scale, zero):
                      w = (code - 8) * scale + zero
    packed (what the kernel reads; `pack_int4_for_cpu` makes it once, after loading):
        packed:              [N16, K / 2] uint8 in torch's CPU int4pack layout
        packed_scales_zeros: [K / 32, N16, 2] bfloat16
        (N16: N rounded up to a multiple of 16, which the packing needs; the extra rows
        have scale and zero 0 and are cut from the output)

Codes come from a GGUF's Q4_0 / Q4_1 blocks (`int4_groups_from_q4_blocks`: the same 32
columns, their scales rounded to bf16 and each code re-chosen against the rounded scale
and zero), or from any float weight (`quantize_int4_groups`: min/max per 32 columns).
`int4_linear_reference` is the plain torch meaning of the packed matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._checks import check_dtype_and_rank

INT4_GROUP_SIZE = 32
"""Input columns per group (one scale and zero); GGUF's Q4 blocks hold the same 32."""
INT4_ROW_MULTIPLE = 16
"""`_convert_weight_to_int4pack_for_cpu` packs a multiple of 16 rows."""
Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
"""GGUF block size in bytes: f16 scale (Q4_1: and f16 min), then 16 bytes of nibbles."""
_CODE_OFFSET = 8.0
_MAX_CODE = 15.0


def padded_in_features(in_features: int) -> int:
    """Columns of the codes: `in_features` rounded up to whole groups."""
    return -(-in_features // INT4_GROUP_SIZE) * INT4_GROUP_SIZE


def int4_groups_from_q4_blocks(
    blocks_u8: torch.Tensor,  # [N, K / 32, 18 (Q4_0) or 20 (Q4_1)] uint8, GGUF blocks per row
    block_type: str,  # "Q4_0" or "Q4_1"
) -> tuple[torch.Tensor, torch.Tensor]:  # codes [N, K] uint8, scales_zeros [N, K / 32, 2] bf16
    """The int4 groups of a GGUF Q4_0 / Q4_1 matrix. A Q4_1 weight is d * q + m and a Q4_0
    one d * (q - 8), with f16 d and m; as int4 groups that is scale d and zero m + 8 d (Q4_1)
    or 0 (Q4_0), each rounded to bf16. Each code is then chosen anew to come nearest the
    GGUF's own (float32-dequantized) weight under the rounded scale and zero."""
    if block_type not in Q4_BLOCK_BYTES:
        raise ValueError(f"block_type must be Q4_0 or Q4_1, got {block_type!r}")
    check_dtype_and_rank("blocks_u8", blocks_u8, torch.uint8, 3)
    if blocks_u8.shape[2] != Q4_BLOCK_BYTES[block_type]:
        raise ValueError(
            f"{block_type} blocks are {Q4_BLOCK_BYTES[block_type]} bytes, got shape "
            f"{tuple(blocks_u8.shape)}"
        )
    d = _f16_field(blocks_u8, 0)  # [N, G]
    nibbles_u8 = blocks_u8[..., -16:]
    q = torch.cat((nibbles_u8 & 0x0F, nibbles_u8 >> 4), dim=-1).float()  # [N, G, 32]
    if block_type == "Q4_1":
        m = _f16_field(blocks_u8, 2)
        weight = d.unsqueeze(-1) * q + m.unsqueeze(-1)  # as ggml: multiply, then add
        zero = (m + _CODE_OFFSET * d).to(torch.bfloat16)
    else:
        weight = d.unsqueeze(-1) * (q - _CODE_OFFSET)
        zero = torch.zeros_like(d, dtype=torch.bfloat16)
    scale = d.to(torch.bfloat16)
    codes = _nearest_codes(weight, scale.float(), zero.float())
    num_rows, num_groups = d.shape
    scales_zeros = torch.stack((scale, zero), dim=-1)  # [N, G, 2]
    return codes.reshape(num_rows, num_groups * INT4_GROUP_SIZE), scales_zeros


def quantize_int4_groups(
    weight: torch.Tensor,  # [N, K] float
) -> tuple[torch.Tensor, torch.Tensor]:  # codes [N, K32] uint8, scales_zeros [N, K32/32, 2] bf16
    """Asymmetric 4-bit quantization per row and 32 columns: the group's range [lo, hi]
    split in 15 steps (scale (hi - lo) / 15, zero lo + 8 scale, both rounded to bf16), each
    code the nearest under the rounded pair. K is padded with zero columns to K32, a
    multiple of 32 (the launcher pads the activations to match)."""
    check_dtype_and_rank("weight", weight, (torch.float32, torch.bfloat16, torch.float16), 2)
    num_rows, in_features = weight.shape
    padded = padded_in_features(in_features)
    groups = F.pad(weight.float(), (0, padded - in_features)).reshape(num_rows, -1, INT4_GROUP_SIZE)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, G]
    scale = ((hi - lo) / _MAX_CODE).to(torch.bfloat16)
    zero = (lo + _CODE_OFFSET * scale.float()).to(torch.bfloat16)
    codes = _nearest_codes(groups, scale.float(), zero.float())
    return codes.reshape(num_rows, padded), torch.stack((scale, zero), dim=-1)


def dequantize_int4_groups(
    codes: torch.Tensor,  # [N, K32] uint8
    scales_zeros: torch.Tensor,  # [N, K32 / 32, 2] bfloat16
) -> torch.Tensor:  # [N, K32] float32
    """w = (code - 8) * scale + zero, in float32."""
    num_rows, padded = _check_groups(codes, scales_zeros)
    groups = codes.reshape(num_rows, -1, INT4_GROUP_SIZE).float() - _CODE_OFFSET
    scale, zero = scales_zeros.float().unbind(-1)  # [N, G] each
    return (groups * scale.unsqueeze(-1) + zero.unsqueeze(-1)).reshape(num_rows, padded)


def pack_int4_for_cpu(
    codes: torch.Tensor,  # [N, K32] uint8
    scales_zeros: torch.Tensor,  # [N, K32 / 32, 2] bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:  # packed [N16, K32 / 2] uint8, [K32 / 32, N16, 2] bf16
    """The kernel's layout of int4 groups (see the module docstring); CPU tensors only."""
    num_rows, _ = _check_groups(codes, scales_zeros)
    if codes.device.type != "cpu":
        raise ValueError(f"int4 packing runs on the CPU, got codes on {codes.device}")
    pad_rows = -num_rows % INT4_ROW_MULTIPLE
    codes_i32 = F.pad(codes.to(torch.int32), (0, 0, 0, pad_rows), value=int(_CODE_OFFSET))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes_i32, 1)
    padded_scales = F.pad(scales_zeros, (0, 0, 0, 0, 0, pad_rows))  # [N16, G, 2]
    return packed, padded_scales.transpose(0, 1).contiguous()


def int4_linear_cpu(
    x: torch.Tensor,  # [M, K] float32 / bfloat16 / float16, K <= K32 < K + 32
    packed: torch.Tensor,  # [N16, K32 / 2] uint8 (`pack_int4_for_cpu`)
    packed_scales_zeros: torch.Tensor,  # [K32 / 32, N16, 2] bfloat16
    out_features: int,  # N <= N16
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ w.T through torch's CPU int4 GEMM, with x rounded to bf16 (see the module
    docstring); the output is rounded to bf16 before it takes x's dtype."""
    check_dtype_and_rank("x", x, (torch.float32, torch.bfloat16, torch.float16), 2)
    check_dtype_and_rank("packed", packed, torch.uint8, 2)
    check_dtype_and_rank("packed_scales_zeros", packed_scales_zeros, torch.bfloat16, 3)
    rows16, half_cols = packed.shape
    padded = 2 * half_cols
    if x.device.type != "cpu" or packed.device.type != "cpu":
        raise ValueError(f"int4_linear_cpu runs on the CPU, got x on {x.device}")
    if padded % INT4_GROUP_SIZE or packed_scales_zeros.shape != (
        padded // INT4_GROUP_SIZE,
        rows16,
        2,
    ):
        raise ValueError(
            f"packed_scales_zeros must be [{padded // INT4_GROUP_SIZE}, {rows16}, 2] for packed "
            f"{tuple(packed.shape)}, got {tuple(packed_scales_zeros.shape)}"
        )
    if not 0 <= padded - x.shape[1] < INT4_GROUP_SIZE or not 0 < out_features <= rows16:
        raise ValueError(
            f"x {tuple(x.shape)} and out_features {out_features} do not fit packed "
            f"weights of {rows16} rows and {padded} columns"
        )
    x_bf16 = x.to(torch.bfloat16)
    if padded != x.shape[1]:
        x_bf16 = F.pad(x_bf16, (0, padded - x.shape[1]))
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x_bf16.contiguous(), packed, INT4_GROUP_SIZE, packed_scales_zeros
    )  # [M, N16] bf16
    if out_features != rows16:
        out = out[:, :out_features]
    return out.to(x.dtype).contiguous()


def int4_linear_reference(
    x: torch.Tensor,  # [M, K]
    codes: torch.Tensor,  # [N, K32] uint8
    scales_zeros: torch.Tensor,  # [N, K32 / 32, 2] bfloat16
) -> torch.Tensor:  # [M, N] in x's dtype
    """What `int4_linear_cpu` computes, in plain torch: x rounded to bf16, times the
    dequantized weight in float32, the product rounded to bf16."""
    weight = dequantize_int4_groups(codes, scales_zeros)[:, : x.shape[1]]
    out = F.linear(x.to(torch.bfloat16).float(), weight)
    return out.to(torch.bfloat16).to(x.dtype)


def _nearest_codes(
    groups: torch.Tensor,  # [N, G, 32] float32 weights
    scale: torch.Tensor,  # [N, G] float32 (bf16 values)
    zero: torch.Tensor,  # [N, G] float32 (bf16 values)
) -> torch.Tensor:  # [N, G, 32] uint8: the code whose (code - 8) * scale + zero is nearest
    steps = (groups - zero.unsqueeze(-1)) / scale.unsqueeze(-1)
    steps = torch.where(scale.unsqueeze(-1) == 0, 0.0, steps)
    return (steps.round() + _CODE_OFFSET).clamp_(0, _MAX_CODE).to(torch.uint8)


def _f16_field(
    blocks_u8: torch.Tensor,  # [N, G, block_bytes] uint8
    start: int,
) -> torch.Tensor:  # [N, G] float32
    return blocks_u8[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _check_groups(codes: torch.Tensor, scales_zeros: torch.Tensor) -> tuple[int, int]:
    check_dtype_and_rank("codes", codes, torch.uint8, 2)
    check_dtype_and_rank("scales_zeros", scales_zeros, torch.bfloat16, 3)
    num_rows, padded = codes.shape
    if padded % INT4_GROUP_SIZE or scales_zeros.shape != (
        num_rows,
        padded // INT4_GROUP_SIZE,
        2,
    ):
        raise ValueError(
            f"codes [N, K] need K a multiple of {INT4_GROUP_SIZE} and scales_zeros "
            f"[N, K / {INT4_GROUP_SIZE}, 2]; got {tuple(codes.shape)} and "
            f"{tuple(scales_zeros.shape)}"
        )
    return num_rows, padded
