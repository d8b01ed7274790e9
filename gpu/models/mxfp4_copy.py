"""--mxfp4-copy: gpt-oss's MXFP4 experts also kept in a format that the fused MoE's GEMMs
multiply faster on steps with many rows per expert (prefill, large decode batches), where
dequantizing MXFP4 tiles in registers halves the tensor cores' rate. With the bf16 copy,
steps with few rows per expert keep reading MXFP4, whose bytes are fewer; the FP8 copy
serves every step (SparseMoE.forward picks by COPY_MIN_ROWS), so it replaces the MXFP4
experts: each layer's are freed once its copy is made.

    bf16  the model dtype: 2 bytes a weight (gpt-oss-20b: 38 GB); exact, since bf16 holds
          every MXFP4 value.
    fp8   e4m3 with a power-of-two scale per output row (kernels/fp8_experts.py): 1 byte a
          weight and 4 a row (gpt-oss-20b: 19 GB, 9 GB more than the MXFP4 experts it
          replaces); exact unless a group's scale lies about
          16 binades below its row's largest (the count that rounded is logged). The tiles
          are converted to the activations' dtype in registers, as MXFP4's are, but with
          one conversion per value instead of an unpack, a lookup and a scale.

Either way the activations stay in the model dtype and each product is the same as with
the MXFP4 experts; a GPU sums them in another tile order. Made one expert at a time at
load, before the KV cache is sized (gpu/worker.py), so their bytes (less the MXFP4 experts'
where the copy replaces them) come out of KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gpu.models.moe import COPY_MIN_ROWS, SparseMoE
from kernels.fp8_experts import Fp8Experts, fp8_experts_from_mxfp4
from kernels.mxfp4 import MXFP4Tensor, dequantize_mxfp4


@dataclass(frozen=True)
class MXFP4CopyReport:
    num_bytes: int
    num_rounded: int
    """fp8 values not exactly the MXFP4 ones (0 for bf16)."""


def mxfp4_layers(model: nn.Module) -> list[SparseMoE]:
    """The layers that still hold MXFP4 experts."""
    return [
        m
        for m in model.modules()
        if isinstance(m, SparseMoE) and m.is_mxfp4 and not m.mxfp4_dropped
    ]


def mxfp4_copy_bytes(model: nn.Module, kind: str) -> int:
    """What add_mxfp4_copies would add (before it frees any MXFP4 experts); 0 where the
    model has no MXFP4 experts."""
    total = 0
    for layer in mxfp4_layers(model):
        for w in (layer.w13, layer.w2):
            num_experts, num_rows, num_cols = w.shape
            if kind == "fp8":  # a byte a weight, a float32 scale a row
                total += num_experts * num_rows * (num_cols + 4)
            else:
                total += math.prod(w.shape) * layer.dtype.itemsize
    return total


def mxfp4_copy_description(kind: str) -> str:
    """The copy's part of the line that says what runs in what precision (/version)."""
    min_rows = COPY_MIN_ROWS[kind]
    if not min_rows:
        return f"{kind} copy of the mxfp4 experts for every step, which replaces them"
    return f"{kind} copy of the mxfp4 experts for steps of >= {min_rows:g} rows per expert"


def add_mxfp4_copies(model: nn.Module, kind: str) -> MXFP4CopyReport:
    """The copy of `kind` ("bf16" or "fp8") on every layer with MXFP4 experts; a copy that
    serves every step frees the layer's MXFP4 experts as soon as it is made."""
    num_bytes = num_rounded = 0
    for layer in mxfp4_layers(model):
        w13, w2 = layer.w13, layer.w2
        assert isinstance(w13, MXFP4Tensor) and isinstance(w2, MXFP4Tensor)
        copies = []
        for w in (w13, w2):
            copy, rounded = _copy(w, kind, layer.dtype)
            copies.append(copy)
            num_rounded += rounded
            num_bytes += _num_bytes(copy)
        layer.expert_copy = (copies[0], copies[1])
        layer.copy_min_rows = COPY_MIN_ROWS[kind]
        if not layer.copy_min_rows:
            layer.drop_mxfp4_experts()
    return MXFP4CopyReport(num_bytes, num_rounded)


def _copy(
    w: MXFP4Tensor, kind: str, dtype: torch.dtype
) -> tuple[torch.Tensor | Fp8Experts, int]:  # w: [num_experts, N, K]
    if kind == "fp8":
        return fp8_experts_from_mxfp4(w)
    if kind != "bf16":
        raise ValueError(f"an MXFP4 copy is bf16 or fp8, not {kind!r}")
    dense = torch.empty(w.shape, dtype=dtype, device=w.blocks.device)
    for expert in range(dense.shape[0]):
        dense[expert] = dequantize_mxfp4(w[expert], dtype)
    return dense, 0


def _num_bytes(copy: torch.Tensor | Fp8Experts) -> int:
    tensors = (copy.weight, copy.scale) if isinstance(copy, Fp8Experts) else (copy,)
    return sum(t.numel() * t.element_size() for t in tensors)
