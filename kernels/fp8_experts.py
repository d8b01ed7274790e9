"""FP8 (e4m3) MoE expert weights, as the fused MoE GEMMs (kernels/fused_moe.py) read them.

    weight: [num_experts, N, K] float8_e4m3fn (each expert's rows as nn.Linear stores them)
    scale:  per output channel [num_experts, N] float32, or
            per 128x128 block  [num_experts, ceil(N / 128), ceil(K / 128)] float32

value = weight * scale of its row or block (block scales are the checkpoints'
`weight_scale_inv`, a multiplier despite the name). A tensor whose rows are several
parts blocked on their own (w13: the gate rows, then the up rows, stacked from the
checkpoint's gate_proj and up_proj) holds each part's block rows in turn:
[num_experts, num_parts * ceil(N / num_parts / 128), ceil(K / 128)], which is
[num_experts, ceil(N / 128), ...] when 128 divides each part.

Torch only: the references dequantize here; the Triton GEMMs convert tiles in registers
(kernels/_moe_gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._checks import check_scale
from kernels.fp8_quant import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, quantize_weight_per_channel
from kernels.mxfp4 import MXFP4Tensor, dequantize_mxfp4

FP8_EXPERT_BLOCK = 128


@dataclass(frozen=True)
class Fp8Experts:
    """Stacked FP8 expert weights and their scales (see the module docstring)."""

    weight: torch.Tensor  # [num_experts, N, K] float8_e4m3fn
    scale: torch.Tensor  # [num_experts, N] or [num_experts, N blocks, K blocks] float32

    def __post_init__(self) -> None:
        if not isinstance(self.weight, torch.Tensor) or self.weight.dtype != FP8_DTYPE:
            got = getattr(self.weight, "dtype", type(self.weight).__name__)
            raise ValueError(f"FP8 expert weights must be float8_e4m3fn, got {got}")
        if self.weight.dim() != 3:
            raise ValueError(
                f"FP8 expert weights must be [num_experts, N, K], got {tuple(self.weight.shape)}"
            )
        if not isinstance(self.scale, torch.Tensor) or self.scale.device != self.weight.device:
            raise ValueError("FP8 expert scales must be a tensor on the weights' device")

    @property
    def block(self) -> bool:
        """Per-128x128-block scales (otherwise per output channel)."""
        return self.scale.dim() == 3

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def expert(self, index: int) -> Fp8Experts:
        """Expert `index` alone, as a one-expert stack."""
        return Fp8Experts(self.weight[index : index + 1], self.scale[index : index + 1])


def _num_blocks(size: int) -> int:
    return -(-size // FP8_EXPERT_BLOCK)


def fp8_expert_scale_shapes(
    weight_shape: tuple[int, ...], num_row_parts: int = 1
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(the per-channel, the block) scale shape for weights [num_experts, N, K] whose rows
    are `num_row_parts` parts blocked on their own."""
    num_experts, rows, cols = weight_shape
    block_rows = num_row_parts * _num_blocks(rows // num_row_parts)
    return (num_experts, rows), (num_experts, block_rows, _num_blocks(cols))


def check_fp8_experts(name: str, w: Fp8Experts, num_row_parts: int = 1) -> None:
    """Refuses a scale of neither shape, naming both (the weights' own checks ran at
    construction)."""
    check_scale(f"{name} scale", w.scale, fp8_expert_scale_shapes(w.shape, num_row_parts))


def dequantize_fp8_experts(
    w: Fp8Experts, dtype: torch.dtype, num_row_parts: int = 1
) -> torch.Tensor:  # [num_experts, N, K] dtype
    """The values of `w` (e4m3 value x scale, computed in float32, then rounded to dtype)."""
    check_fp8_experts("w", w, num_row_parts)
    values = w.weight.float()
    if not w.block:
        return (values * w.scale[:, :, None]).to(dtype)
    rows, cols = values.shape[1] // num_row_parts, values.shape[2]
    per_part = w.scale.chunk(num_row_parts, dim=1)  # [E, row blocks, col blocks] each
    per_row = torch.cat(
        [s.repeat_interleave(FP8_EXPERT_BLOCK, dim=1)[:, :rows] for s in per_part], dim=1
    )
    per_value = per_row.repeat_interleave(FP8_EXPERT_BLOCK, dim=2)[:, :, :cols]
    return (values * per_value).to(dtype)


def quantize_fp8_experts(
    w: torch.Tensor, block: bool, num_row_parts: int = 1
) -> Fp8Experts:  # w: [num_experts, N, K] floating
    """FP8 of stacked expert weights: scale = absmax / 448 of each output row, or of each
    128x128 block of each row part (partial blocks at the parts' ends); values rounded to
    nearest e4m3. For benchmarks and tests: a checkpoint's experts arrive quantized, and
    --quantization fp8 quantizes them per expert at load."""
    if not w.is_floating_point() or w.dim() != 3:
        raise ValueError(f"w must be a floating [num_experts, N, K] tensor, got {w.dtype}")
    num_experts, num_rows, num_cols = w.shape
    if not block:
        w_fp8, scale = quantize_weight_per_channel(w.reshape(-1, num_cols))
        return Fp8Experts(w_fp8.view(w.shape), scale.view(num_experts, num_rows))
    blocks, scales = [], []
    for part in w.float().chunk(num_row_parts, dim=1):
        rows = part.shape[1]
        padded = torch.zeros(
            num_experts,
            _num_blocks(rows) * FP8_EXPERT_BLOCK,
            _num_blocks(num_cols) * FP8_EXPERT_BLOCK,
            device=w.device,
        )
        padded[:, :rows, :num_cols] = part
        tiles = padded.unflatten(2, (-1, FP8_EXPERT_BLOCK)).unflatten(1, (-1, FP8_EXPERT_BLOCK))
        scale = (tiles.abs().amax(dim=(2, 4)) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        per_value = scale[:, :, None, :, None].expand_as(tiles).flatten(3, 4).flatten(1, 2)
        quantized = (padded / per_value).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        blocks.append(quantized[:, :rows, :num_cols])
        scales.append(scale)
    return Fp8Experts(torch.cat(blocks, dim=1).contiguous(), torch.cat(scales, dim=1).contiguous())


def fp8_experts_from_mxfp4(w: MXFP4Tensor) -> tuple[Fp8Experts, int]:
    """MXFP4 experts [num_experts, N, K] as FP8 with a power-of-two scale per output row
    (the largest that keeps the row's absmax within 448). The MXFP4 values are e2m1 (one
    mantissa bit) times power-of-two group scales, and e4m3 holds one mantissa bit at every
    exponent from 2^-9 up, so each value is exact unless its group scale lies more than
    about 16 binades below the row's largest; such values round to the nearest e4m3.
    Returns the experts and the number of values that rounded. Dequantized one expert at a
    time (float32 temporaries of one expert)."""
    num_experts, num_rows, num_cols = w.shape
    device = w.blocks.device
    weight = torch.empty(num_experts, num_rows, num_cols, dtype=FP8_DTYPE, device=device)
    scale = torch.empty(num_experts, num_rows, dtype=torch.float32, device=device)
    num_rounded = 0
    for expert in range(num_experts):
        values = dequantize_mxfp4(w[expert], torch.float32)  # [N, K], exact
        _, exponent = torch.frexp(values.abs().amax(dim=1) / FP8_MAX)
        row_scale = torch.ldexp(torch.ones_like(values[:, 0]), exponent)  # amax / it < 448
        weight[expert] = (values / row_scale[:, None]).to(FP8_DTYPE)
        scale[expert] = row_scale
        rounded = weight[expert].float() * row_scale[:, None] != values
        num_rounded += int(rounded.sum())
    return Fp8Experts(weight, scale), num_rounded
