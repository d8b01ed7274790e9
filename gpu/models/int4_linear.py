"""Packed int4 projections on the CPU: `Int4Weight`, beside fp8_linear.py's `Fp8Weight`.

An Int4Weight loads int4 groups (kernels/packed_cpu.py): codes uint8 [N, K32], one 4-bit
code per weight, and scales_zeros bf16 [N, K32 / 32, 2], a (scale, zero) pair per row and
32 input columns (K32: in_features rounded up to whole groups). The loader names them
`<module>.weight` and `<module>.weight_scales_zeros`. Fused projections (q/k/v, gate/up)
are one Int4Weight whose rows concatenate the parts', like every other projection.

Once every part is loaded, `pack_int4_weights` converts each into the layout of torch's
CPU int4 GEMM (packed [N16, K32 / 2] uint8, scales [K32 / 32, N16, 2]) and frees the codes:
the model then holds 5 bits per weight (a 4-bit code, and a bf16 pair per 32). Its forward
casts the activations to bf16 and the product back to their dtype. gpu/models/precision.py
decides which projections are int4; `projection` in fp8_linear.py allocates them.

torch's int4 kernel pays per row of activations (on an AVX-512 host, 30 layers of the
embedded model's projections: 10 ms at 1 row, 28 at 8, 52 at 16, 198 at 64, against 35,
38, 41 and 69 ms for a bf16 GEMM that the CPU's matrix units run). So while the model's
dense copies fit DENSE_COPY_MAX_BYTES, each projection also keeps its weights dequantized
to bf16, and steps of more than INT4_MAX_ROWS tokens (prefill chunks, large decode
batches) multiply with those; decode of a few requests reads the 4-bit codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.models.precision import Int4Scheme
from kernels.packed_cpu import (
    INT4_GROUP_SIZE,
    dequantize_int4_groups,
    int4_linear_cpu,
    pack_int4_for_cpu,
    padded_in_features,
)

SCALES_ZEROS_SUFFIX = "weight_scales_zeros"
"""Loader-side name of a projection's (scale, zero) pairs, after the module's."""
INT4_MAX_ROWS = 8
"""Most activation rows the int4 kernel takes; more go to the bf16 copy (module docstring)."""
DENSE_COPY_MAX_BYTES = 2 << 30
"""Bytes of bf16 copies a model may keep (2 per weight): the embedded model's take 0.2 GB;
an 8B GGUF's would take 14 GB, so it runs every step on the int4 kernel."""


class Int4Weight(nn.Module):
    """A packed int4 projection on the CPU (see the module docstring)."""

    def __init__(
        self, out_features: int, in_features: int, scheme: Int4Scheme, device: torch.device | str
    ) -> None:
        super().__init__()
        if torch.device(device).type != "cpu":
            raise ValueError(f"int4 projections run on the CPU, got device {device}")
        self.scheme = scheme
        self.out_features, self.in_features = out_features, in_features
        padded = padded_in_features(in_features)
        # Load targets, freed by pack():
        self.codes: nn.Parameter | None = _parameter(
            torch.empty(out_features, padded, dtype=torch.uint8)
        )
        self.scales_zeros: nn.Parameter | None = _parameter(
            torch.empty(out_features, padded // INT4_GROUP_SIZE, 2, dtype=torch.bfloat16)
        )
        # The kernel's layout, made by pack():
        self.packed: nn.Parameter | None = None
        self.packed_scales_zeros: nn.Parameter | None = None
        self.dense_bf16: nn.Parameter | None = None  # [N, K] for steps past INT4_MAX_ROWS

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def pack(self, keep_dense_copy: bool = False) -> None:
        """Convert the loaded codes into the kernel's layout and free them; with
        `keep_dense_copy`, also keep the weights dequantized to bf16 for large steps."""
        assert self.codes is not None and self.scales_zeros is not None, "packed already"
        if keep_dense_copy:
            dense = dequantize_int4_groups(self.codes.data, self.scales_zeros.data)
            self.dense_bf16 = _parameter(
                dense[:, : self.in_features].to(torch.bfloat16).contiguous()
            )
        packed, packed_scales_zeros = pack_int4_for_cpu(self.codes.data, self.scales_zeros.data)
        self.packed = _parameter(packed)
        self.packed_scales_zeros = _parameter(packed_scales_zeros)
        self.codes = self.scales_zeros = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, in_features] in the model dtype
        bias: torch.Tensor | None = None,  # [out_features] or None
    ) -> torch.Tensor:  # [num_tokens, out_features] in x's dtype
        if self.packed is None or self.packed_scales_zeros is None:
            raise RuntimeError("an Int4Weight runs once loaded and packed (pack_int4_weights)")
        if self.dense_bf16 is not None and x.shape[0] > INT4_MAX_ROWS:
            out = F.linear(x.to(torch.bfloat16), self.dense_bf16).to(x.dtype)
            return out if bias is None else out.add_(bias)
        out = int4_linear_cpu(x, self.packed, self.packed_scales_zeros, self.out_features)
        return out if bias is None else out.add_(bias)

    def part_targets(self, module: str, start: int, rows: int) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the view of this projection that part `module`
        (rows [start, start + rows) of the fused weight) is loaded into."""
        if self.codes is None or self.scales_zeros is None:
            raise RuntimeError("an Int4Weight is loaded before it is packed")
        return {
            f"{module}.weight": self.codes.data.narrow(0, start, rows),
            f"{module}.{SCALES_ZEROS_SUFFIX}": self.scales_zeros.data.narrow(0, start, rows),
        }


def pack_int4_weights(model: nn.Module, dense_copy_max_bytes: int = DENSE_COPY_MAX_BYTES) -> None:
    """Pack every loaded, not yet packed Int4Weight of `model` (after its weights load),
    each with a bf16 copy if all of the model's copies fit `dense_copy_max_bytes`."""
    weights = [m for m in model.modules() if isinstance(m, Int4Weight) and not m.is_packed]
    dense_bytes = sum(2 * w.out_features * w.in_features for w in weights)
    for weight in weights:
        weight.pack(keep_dense_copy=dense_bytes <= dense_copy_max_bytes)


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
