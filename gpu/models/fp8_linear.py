"""Projections that may be FP8: `Fp8Weight` and the `linear` every projection goes through.

A projection is either a plain parameter [N, K] in the model dtype (F.linear) or an
`Fp8Weight`: e4m3 weights [N, K] with float32 scales, per output channel [N] or per
128x128 block [ceil(N/128), ceil(K/128)], and optionally a static activation scale [1].
Its forward quantizes the activations (per token, or per token and 128 columns for block
scales) and runs the FP8 GEMM of kernels/fp8_gemm.py, which returns the activations'
dtype; up to GEMV_MAX_TOKENS tokens it runs kernels/fp8_gemv.py's weight-only kernel on the
unquantized activations instead. Neither step syncs with the host, so CUDA graphs capture
it. gpu/models/precision.py decides which projections are FP8; `projection` allocates what
it says.

Fused projections (q/k/v, gate/up) are one Fp8Weight whose rows concatenate the parts'.
Per-channel scales concatenate the same way; block scales do because the precision plan
fuses block-scaled parts only when each but the last spans whole 128-row blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.models.int4_linear import Int4Weight
from gpu.models.precision import Fp8Scheme, ProjectionScheme
from gpu.models.quant_config import FP8_BLOCK_SIZE
from kernels.fp8_gemm import fp8_gemm_blockwise, fp8_gemm_rowwise
from kernels.fp8_gemv import fp8_gemv
from kernels.fp8_quant import FP8_DTYPE, quantize_per_token, quantize_per_token_group

WEIGHT_SCALE_SUFFIX = "weight_scale"
"""Checkpoint-side name of a per-channel scale [N] (per-tensor scales are expanded)."""
BLOCK_SCALE_SUFFIX = "weight_scale_inv"
"""Checkpoint-side name of a block scale [ceil(N/128), ceil(K/128)] (a multiplier)."""
INPUT_SCALE_SUFFIX = "input_scale"
GEMV_MAX_TOKENS = 16
"""Up to this many tokens (batch-1 decode, small batches) a projection multiplies the FP8
weight with unquantized activations (kernels/fp8_gemv.py): there the weight read is the
cost, and a quantization launch plus cuBLASLt's FP8 GEMM take 1.2-2.5x the time of the
weight-only kernel (H100, 4096 x 14336: 60 us against 26 us). A static input scale is not
applied on this path; the activations keep their own precision."""


class Fp8Weight(nn.Module):
    """An FP8 projection: weight e4m3 [N, K] and its scales (see the module docstring)."""

    def __init__(
        self, out_features: int, in_features: int, scheme: Fp8Scheme, device: torch.device | str
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.out_features, self.in_features = out_features, in_features
        self.weight = _parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device)
        )
        self.weight_scale: nn.Parameter | None = None
        self.block_scale: nn.Parameter | None = None
        if scheme.block:
            blocks = (_num_blocks(out_features), _num_blocks(in_features))
            self.block_scale = _parameter(torch.empty(blocks, dtype=torch.float32, device=device))
        else:
            self.weight_scale = _parameter(
                torch.empty(out_features, dtype=torch.float32, device=device)
            )
        self.input_scale = (
            _parameter(torch.empty(1, dtype=torch.float32, device=device))
            if scheme.static_input_scale
            else None
        )

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, in_features] in the model dtype
        bias: torch.Tensor | None = None,  # [out_features] or None
    ) -> torch.Tensor:  # [num_tokens, out_features] in x's dtype
        if x.shape[0] <= GEMV_MAX_TOKENS and x.is_cuda:
            return fp8_gemv(x, self.weight, self.weight_scale, self.block_scale, bias)
        if self.block_scale is not None:
            # scale [M, K/128], token-major: the layout cuBLASLt's block-scaled GEMM reads
            x_fp8, x_scale = quantize_per_token_group(x, FP8_BLOCK_SIZE, scale_m_major=True)
            out = fp8_gemm_blockwise(x_fp8, x_scale, self.weight, self.block_scale, x.dtype)
            return out if bias is None else out.add_(bias)
        assert self.weight_scale is not None
        x_fp8, x_scale = quantize_per_token(x, self.input_scale)  # scale [M, 1]
        return fp8_gemm_rowwise(x_fp8, x_scale, self.weight, self.weight_scale, bias, x.dtype)

    def part_targets(self, module: str, start: int, rows: int) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the view of this projection that part `module`
        (rows [start, start + rows) of the fused weight) is loaded into."""
        targets = {f"{module}.weight": self.weight.data.narrow(0, start, rows)}
        if self.block_scale is not None:
            block_rows = _num_blocks(start + rows) - start // FP8_BLOCK_SIZE
            targets[f"{module}.{BLOCK_SCALE_SUFFIX}"] = self.block_scale.data.narrow(
                0, start // FP8_BLOCK_SIZE, block_rows
            )
        else:
            assert self.weight_scale is not None
            targets[f"{module}.{WEIGHT_SCALE_SUFFIX}"] = self.weight_scale.data.narrow(
                0, start, rows
            )
        if self.input_scale is not None:  # one for the fused parts (the loader gives each the max)
            targets[f"{module}.{INPUT_SCALE_SUFFIX}"] = self.input_scale.data
        return targets


Projection = nn.Parameter | Fp8Weight | Int4Weight
"""Int4Weight: packed int4 on the CPU (gpu/models/int4_linear.py)."""


def projection(
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
    device: torch.device | str,
    scheme: ProjectionScheme | None = None,
) -> Projection:
    """An uninitialised projection: FP8 or int4 under `scheme`, else a [N, K] parameter
    in `dtype`."""
    if isinstance(scheme, Fp8Scheme):
        return Fp8Weight(out_features, in_features, scheme, device)
    if scheme is not None:
        return Int4Weight(out_features, in_features, scheme, device)
    return _parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: Projection,
    bias: torch.Tensor | None = None,  # [out_features] or None
) -> torch.Tensor:  # [num_tokens, out_features] in x's dtype
    if isinstance(weight, Fp8Weight | Int4Weight):
        return weight(x, bias)
    return F.linear(x, weight, bias)


def part_targets(weight: Projection, parts: list[tuple[str, int, int]]) -> dict[str, torch.Tensor]:
    """Load targets of a (fused) projection: `parts` lists (checkpoint module, first row,
    rows) in row order."""
    targets: dict[str, torch.Tensor] = {}
    for module, start, rows in parts:
        if isinstance(weight, Fp8Weight | Int4Weight):
            targets.update(weight.part_targets(module, start, rows))
        else:
            targets[f"{module}.weight"] = weight.data.narrow(0, start, rows)
    return targets


def _num_blocks(size: int) -> int:
    return -(-size // FP8_BLOCK_SIZE)


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
