"""Read one tensor-parallel shard of a GGUF tensor without dequantizing the rest.

ggml stores a matrix row by row, each row as whole quantization blocks along the columns
(32 elements for Q8_0/Q4_0/Q4_1, one element for F32/F16/BF16). So:
- a row slice (q/k/v, gate/up, vocabulary rows) is one contiguous byte range: only the
  shard's rows are read and dequantized, for every type;
- a column slice (o, down) whose start and stop fall on block boundaries takes just
  those blocks of every row, and only they are dequantized;
- a column slice that cuts through blocks dequantizes the whole tensor, then slices it
  (`shard_read_mode` says which of the three a tensor takes).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu.models.config import UnsupportedModelError
from gpu.weights.dequant import dequantize
from gpu.weights.ggml_types import GGML_BLOCK_LAYOUTS
from gpu.weights.gguf_file import GGUFFile
from gpu.weights.shard_layout import ShardSlice, pad_shard

WHOLE = "whole"
ROWS = "rows"
BLOCK_COLUMNS = "block_columns"
DEQUANTIZE_THEN_SLICE = "dequantize_then_slice"


def shard_read_mode(gguf: GGUFFile, name: str, shard: ShardSlice) -> str:
    """How `read_gguf_shard` reads `name`'s shard: WHOLE, ROWS, BLOCK_COLUMNS or
    DEQUANTIZE_THEN_SLICE."""
    info = gguf.tensors[name]
    if shard.dim is None or (shard.start == 0 and shard.stop == info.shape[shard.dim]):
        return WHOLE
    if shard.dim == 0 and len(info.shape) == 2:
        return ROWS
    block_elems = _block_layout(info.ggml_type, name)[0]
    if shard.start % block_elems == 0 and shard.stop % block_elems == 0:
        return BLOCK_COLUMNS
    return DEQUANTIZE_THEN_SLICE


def read_gguf_shard(
    gguf: GGUFFile,
    name: str,
    shard: ShardSlice,
    device: str | torch.device,
) -> torch.Tensor:  # the shard (padding zeroed), float32, on device
    info = gguf.tensors[name]
    mode = shard_read_mode(gguf, name, shard)
    raw_np = gguf.tensor_bytes(name)
    if mode == WHOLE:
        return pad_shard(_dequantize(raw_np, info.ggml_type, info.shape, device, name), shard)
    if mode == DEQUANTIZE_THEN_SLICE:
        full = _dequantize(raw_np, info.ggml_type, info.shape, device, name)
        return pad_shard(full.narrow(shard.dim, shard.start, shard.stop - shard.start), shard)
    block_elems, block_bytes = _block_layout(info.ggml_type, name)
    num_cols = info.shape[-1]
    row_blocks_np = raw_np.reshape(-1, num_cols // block_elems, block_bytes)
    if mode == ROWS:
        picked_np = row_blocks_np[shard.start : shard.stop]
        shape = (shard.stop - shard.start, num_cols)
    else:
        picked_np = row_blocks_np[:, shard.start // block_elems : shard.stop // block_elems]
        shape = (*info.shape[:-1], shard.stop - shard.start)
    sliced = _dequantize(np.ascontiguousarray(picked_np), info.ggml_type, shape, device, name)
    return pad_shard(sliced, shard)


def _block_layout(ggml_type: int, name: str) -> tuple[int, int]:
    layout = GGML_BLOCK_LAYOUTS.get(ggml_type)
    if layout is None:
        raise UnsupportedModelError(f"tensor {name!r}: unknown GGUF tensor type {ggml_type}")
    return layout


def _dequantize(
    raw_np: np.ndarray,
    ggml_type: int,
    shape: tuple[int, ...],
    device: str | torch.device,
    name: str,
) -> torch.Tensor:
    raw_u8 = torch.from_numpy(raw_np.reshape(-1)).to(device)
    try:
        return dequantize(raw_u8, ggml_type, shape, torch.float32)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"tensor {name!r}: {exc}") from None
