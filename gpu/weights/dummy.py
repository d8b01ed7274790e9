"""Seeded random weights for any `ModelConfig`, for benchmarks and tests.

Generated directly in the target dtype on the target device (no host round trip), so an 8B
model on a GPU takes seconds. Each weight is drawn in blocks of DUMMY_ROW_BLOCK rows, every
block from its own seed (a hash of the weight seed, the weight's name and the block
index), so one tensor-parallel rank generates just the blocks its shard overlaps, and
its shard equals the same slice of the whole model's weights exactly.

MXFP4 experts (gpt-oss presets) are drawn packed, as the checkpoints store them: uniform
random e2m1 codes and scales of 2**-8 or 2**-7, so that the values have a standard
deviation of about 0.018, near the other weights' 0.02.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from gpu.models.config import ModelConfig, UnsupportedModelError
from gpu.models.presets import PRESETS
from gpu.weights.layout import (
    EMBED_NAME,
    LM_HEAD_NAME,
    expected_weight_shapes,
    is_mxfp4_weight,
    is_norm_weight,
)
from gpu.weights.shard_layout import ShardSlice, weight_shard_slices

WEIGHT_STD = 0.02
DUMMY_ROW_BLOCK = 256
MXFP4_DUMMY_SCALES = (119, 120)
"""E8M0 exponents (2**-8, 2**-7) of dummy MXFP4 groups."""


def preset_config(preset: str) -> ModelConfig:
    try:
        return PRESETS[preset]
    except KeyError:
        raise UnsupportedModelError(
            f"unknown preset {preset!r}; presets: {', '.join(sorted(PRESETS))}"
        ) from None


def dummy_weights(
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Random weights with the right names and shapes: normal(0, 0.02) matrices and biases,
    RMSNorm weights of one, MXFP4 blocks and scales as the module docstring says. Same
    seed, device and dtype -> same weights. With tp_size > 1, only tensor-parallel rank
    tp_rank's shard of each (gpu/weights/shard_layout.py). With `keep`, only the names it
    keeps (a pipeline stage's), each the same as in the whole model."""
    device = torch.device(device)
    generator = torch.Generator(device=device)
    slices = weight_shard_slices(config, tp_rank, tp_size)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(config).items():
        if keep is not None and not keep(name):
            continue
        if name == LM_HEAD_NAME and config.tie_word_embeddings:
            weights[name] = weights[EMBED_NAME]
        elif is_norm_weight(name):
            weights[name] = torch.ones(slices[name].shard_shape(shape), dtype=dtype, device=device)
        elif is_mxfp4_weight(name):  # MoE models run unsharded: always the whole tensor
            generator.manual_seed(_block_seed(seed, name, 0))
            weights[name] = _random_mxfp4(name, shape, device, generator)
        else:
            weights[name] = _random_shard(name, shape, slices[name], dtype, device, seed, generator)
    return weights


def _random_shard(
    name: str,
    full_shape: tuple[int, ...],
    shard: ShardSlice,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    generator: torch.Generator,
) -> torch.Tensor:
    num_rows = full_shape[0]
    row_start, row_stop = (shard.start, shard.stop) if shard.dim == 0 else (0, num_rows)
    out = torch.zeros(shard.shard_shape(full_shape), dtype=dtype, device=device)
    for block in range(row_start // DUMMY_ROW_BLOCK, -(-row_stop // DUMMY_ROW_BLOCK)):
        block_start = block * DUMMY_ROW_BLOCK
        block_stop = min(block_start + DUMMY_ROW_BLOCK, num_rows)
        generator.manual_seed(_block_seed(seed, name, block))
        block_shape = (block_stop - block_start, *full_shape[1:])
        values = torch.empty(block_shape, dtype=dtype, device=device)
        values.normal_(0.0, WEIGHT_STD, generator=generator)
        lo, hi = max(block_start, row_start), min(block_stop, row_stop)
        part = values[lo - block_start : hi - block_start]
        dest = out.narrow(0, lo - row_start, hi - lo)
        if shard.dim == 1:
            part = part[:, shard.start : shard.stop]
            dest = dest.narrow(1, 0, shard.stop - shard.start)
        dest.copy_(part)
    return out


def _random_mxfp4(
    name: str, shape: tuple[int, ...], device: torch.device, generator: torch.Generator
) -> torch.Tensor:  # uint8
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)
    low, high = MXFP4_DUMMY_SCALES[0], MXFP4_DUMMY_SCALES[-1] + 1
    return torch.randint(low, high, shape, dtype=torch.uint8, device=device, generator=generator)


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
