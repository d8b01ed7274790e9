"""Int4 projections' tensors in the form the model loads, as gpu/models/precision.py says.

An int4 projection module is loaded as int4 groups (kernels/packed_cpu.py,
gpu/models/int4_linear.py): `<module>.weight`, codes uint8 [N, K32], and
`<module>.weight_scales_zeros`, bf16 [N, K32 / 32, 2] (K32: K rounded up to 32).
- A GGUF's Q4_0 / Q4_1 projections: `read_gguf_int4` turns a tensor's blocks into int4
  groups without dequantizing it (the GGUF loader calls it for projections whose scheme
  names their block types).
- Every other int4 projection (--quantization int4) arrives in float: `apply_int4_precision`
  quantizes it per row and 32 columns.
`int4_expected_shapes` gives the names and shapes the loaders check.
"""

from __future__ import annotations

import torch

from gpu.models.int4_linear import SCALES_ZEROS_SUFFIX
from gpu.models.precision import WeightPrecision, part_modules
from gpu.weights.ggml_types import GGML_BLOCK_LAYOUTS, GGMLType
from gpu.weights.gguf_file import GGUFFile
from kernels.packed_cpu import (
    INT4_GROUP_SIZE,
    int4_groups_from_q4_blocks,
    padded_in_features,
    quantize_int4_groups,
)

Q4_TYPES = {GGMLType.Q4_0: "Q4_0", GGMLType.Q4_1: "Q4_1"}
"""GGUF tensor types whose blocks are int4 groups already."""


def read_gguf_int4(
    gguf: GGUFFile, name: str
) -> tuple[torch.Tensor, torch.Tensor]:  # codes [N, K] uint8, scales_zeros [N, K / 32, 2] bf16
    """The int4 groups of GGUF matrix `name` (Q4_0 or Q4_1), on the CPU."""
    info = gguf.tensors[name]
    block_type = Q4_TYPES.get(info.ggml_type)
    if block_type is None or len(info.shape) != 2:
        raise ValueError(f"tensor {name!r} is not a Q4_0 / Q4_1 matrix")
    num_rows, num_cols = info.shape
    block_bytes = GGML_BLOCK_LAYOUTS[info.ggml_type][1]
    raw_np = gguf.tensor_bytes(name).reshape(num_rows, num_cols // INT4_GROUP_SIZE, block_bytes)
    return int4_groups_from_q4_blocks(torch.from_numpy(raw_np), block_type)


def apply_int4_precision(weights: dict[str, torch.Tensor], precision: WeightPrecision) -> None:
    """Quantize, in place, each int4 projection that is still a float weight; raise
    ValueError for one that is neither float nor int4 groups."""
    for group in precision.int4_schemes:
        for module in part_modules(group):
            name = f"{module}.weight"
            if name not in weights:
                continue  # reported as missing by the caller's shape check
            weight = weights[name]
            if weight.dtype == torch.uint8:
                if f"{module}.{SCALES_ZEROS_SUFFIX}" not in weights:
                    raise ValueError(f"int4 codes {name!r} without {SCALES_ZEROS_SUFFIX}")
                continue
            if not weight.is_floating_point():
                raise ValueError(f"{name!r} is {weight.dtype}, which int4 cannot quantize")
            codes, scales_zeros = quantize_int4_groups(weight.cpu())
            weights[name] = codes
            weights[f"{module}.{SCALES_ZEROS_SUFFIX}"] = scales_zeros


def int4_expected_shapes(
    expected: dict[str, tuple[int, ...]], precision: WeightPrecision
) -> dict[str, tuple[int, ...]]:
    """`expected` (name -> shape) with the int4 projections' codes padded to whole groups
    and their scales added."""
    shapes = dict(expected)
    for group in precision.int4_schemes:
        for module in part_modules(group):
            rows, cols = expected[f"{module}.weight"]
            padded = padded_in_features(cols)
            shapes[f"{module}.weight"] = (rows, padded)
            shapes[f"{module}.{SCALES_ZEROS_SUFFIX}"] = (rows, padded // INT4_GROUP_SIZE, 2)
    return shapes
