"""MXFP4 (OCP microscaling FP4), the format of gpt-oss's expert weights.

Each row of `num_cols` values is cut into groups of 32 that share one E8M0 exponent:

    blocks: [..., num_rows, num_cols // 32, 16] uint8, two e2m1 codes per byte, low nibble first
    scales: [..., num_rows, num_cols // 32] uint8, group scale 2 ** (scale - 127)

This is the checkpoint layout of gpt-oss (`*_blocks`, `*_scales`). Dequantization equals
transformers' `convert_moe_packed_tensors` up to its final transpose (it returns the
[..., num_cols, num_rows] layout its experts multiply with). The Triton routine
`mxfp4_dequant_nibbles` turns a tile of packed bytes into model-dtype values in
registers; the MoE GEMMs (kernels/_moe_gemm.py) call it before `tl.dot`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import HAS_TRITON, tl, triton

MXFP4_GROUP_SIZE = 32
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
"""Value of each 4-bit e2m1 code (bit 3 is the sign)."""

_E2M1_MAX = 6.0
_E2M1_EMAX = 2  # floor(log2(6)): the OCP rule picks scale = floor(log2(amax)) - 2
_E8M0_BIAS = 127
# Round-to-nearest-even on the e2m1 magnitude grid [0, .5, 1, 1.5, 2, 3, 4, 6]: a value on
# a midpoint goes to the neighbour whose code is even. Midpoints whose lower neighbour has
# the even code round down (the value must exceed them to go up); the others round up.
_ROUND_DOWN_MIDPOINTS = (0.25, 1.25, 2.5, 5.0)
_ROUND_UP_MIDPOINTS = (0.75, 1.75, 3.5)


@dataclass(frozen=True)
class MXFP4Tensor:
    """A [..., num_rows, num_cols] tensor in MXFP4 (see the module docstring)."""

    blocks: torch.Tensor  # [..., num_rows, num_cols // 32, 16] uint8
    scales: torch.Tensor  # [..., num_rows, num_cols // 32] uint8

    def __post_init__(self) -> None:
        if self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise ValueError(
                f"MXFP4 blocks and scales must be uint8, got {self.blocks.dtype} and "
                f"{self.scales.dtype}"
            )
        if self.blocks.dim() < 3 or self.blocks.shape[-1] != MXFP4_GROUP_SIZE // 2:
            raise ValueError(
                f"MXFP4 blocks must be [..., num_rows, num_cols // 32, 16], got "
                f"{tuple(self.blocks.shape)}"
            )
        if self.blocks.shape[:-1] != self.scales.shape:
            raise ValueError(
                f"MXFP4 scales {tuple(self.scales.shape)} must match blocks "
                f"{tuple(self.blocks.shape)} without its last dim"
            )
        if self.blocks.device != self.scales.device:
            raise ValueError("MXFP4 blocks and scales must be on one device")

    @property
    def shape(self) -> tuple[int, ...]:
        *prefix, num_rows, num_groups = self.scales.shape
        return (*prefix, num_rows, num_groups * MXFP4_GROUP_SIZE)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def __getitem__(self, index: int) -> MXFP4Tensor:
        """The slice along the first dim (e.g. one expert of a [num_experts, ...] tensor)."""
        return MXFP4Tensor(self.blocks[index], self.scales[index])


def dequantize_mxfp4(t: MXFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [..., num_rows, num_cols] values of `t` in `dtype` (code value x scale, computed
    exactly in float32, then rounded to `dtype`)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=t.device)
    codes = t.blocks.to(torch.int64)
    pairs = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)  # [..., G, 16, 2]
    values = pairs.flatten(-3)  # [..., num_rows, num_cols]
    group_scale = torch.exp2(t.scales.to(torch.float32) - _E8M0_BIAS)  # [..., num_rows, G]
    values = values.unflatten(-1, (-1, MXFP4_GROUP_SIZE)) * group_scale[..., None]
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> MXFP4Tensor:
    """MXFP4 of a [..., num_rows, num_cols] floating tensor (num_cols % 32 == 0): per group
    of 32, scale = 2 ** (floor(log2(amax)) - 2) (clamped to E8M0's range), each value
    divided by it and rounded to the nearest e2m1 value (ties to even, saturating at 6)."""
    if not w.is_floating_point() or w.dim() < 2 or w.shape[-1] % MXFP4_GROUP_SIZE:
        raise ValueError(
            f"quantize_mxfp4 needs a floating [..., num_rows, num_cols] tensor with num_cols "
            f"a multiple of 32, got {w.dtype} {tuple(w.shape)}"
        )
    groups = w.to(torch.float32).unflatten(-1, (-1, MXFP4_GROUP_SIZE))  # [..., G, 32]
    amax = groups.abs().amax(dim=-1)  # [..., num_rows, G]
    # frexp: amax = mantissa * 2**exponent with mantissa in [0.5, 1), so floor(log2) = e - 1
    _, exponent = torch.frexp(amax)
    unbiased = torch.where(amax > 0, exponent - 1 - _E2M1_EMAX, -_E8M0_BIAS)
    scales = (unbiased + _E8M0_BIAS).clamp(0, 254)
    scaled = groups / torch.exp2(scales.to(torch.float32) - _E8M0_BIAS)[..., None]
    magnitude = scaled.abs().clamp(max=_E2M1_MAX)
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for midpoint in _ROUND_DOWN_MIDPOINTS:
        code += (magnitude > midpoint).to(torch.uint8)
    for midpoint in _ROUND_UP_MIDPOINTS:
        code += (magnitude >= midpoint).to(torch.uint8)
    code |= (torch.signbit(scaled) & (code > 0)).to(torch.uint8) << 3
    pairs = code.unflatten(-1, (MXFP4_GROUP_SIZE // 2, 2))  # [..., G, 16, 2]
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return MXFP4Tensor(blocks.contiguous(), scales.to(torch.uint8).contiguous())


if HAS_TRITON:

    @triton.jit
    def _e8m0_to_float32(scales):
        """2 ** (scale - 127) of each uint8 scale; 0 is the subnormal 2 ** -127, 255 inf."""
        s = scales.to(tl.uint32)
        power = (tl.maximum(s, 1) << 23).to(tl.float32, bitcast=True)
        return tl.where(s == 0, power * 0.5, power)

    @triton.jit
    def mxfp4_dequant_nibbles(packed, scales, out_dtype: tl.constexpr):
        """(low, high): the values in `out_dtype` of the low and high nibbles of an [R, C]
        uint8 tile of packed bytes, where byte row r belongs to scale row r // 16 of
        `scales` ([R // 16, C] uint8), i.e. rows run along the quantized dimension."""
        ROWS: tl.constexpr = packed.shape[0]
        COLS: tl.constexpr = packed.shape[1]
        scale = _e8m0_to_float32(scales)
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (ROWS // 16, 16, COLS)), (ROWS, COLS))
        b = packed.to(tl.uint32)
        # A code's 3 magnitude bits as float32 exponent (2 bits) and top mantissa bit give
        # 2 ** (e - 127) * (1 + m / 2), or 2 ** -127 for the code 0.5 (a subnormal): the
        # e2m1 value times 2 ** -126. (2 ** 126 is not folded into the scale, where it
        # would overflow for scales above 128.)
        low = ((b & 0x07) << 22) | ((b & 0x08) << 28)
        high = ((b & 0x70) << 18) | ((b & 0x80) << 24)
        low = low.to(tl.float32, bitcast=True) * 2.0**126 * scale
        high = high.to(tl.float32, bitcast=True) * 2.0**126 * scale
        return low.to(out_dtype), high.to(out_dtype)
