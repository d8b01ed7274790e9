"""Seeded random weights for any `ModelConfig`, for benchmarks and tests.

Generated directly in the target dtype on the target device (no host round trip), so an 8B
model on a GPU takes seconds.
"""

from __future__ import annotations

import torch

from gpu.models.config import PRESETS, ModelConfig, UnsupportedModelError
from gpu.weights.layout import EMBED_NAME, LM_HEAD_NAME, expected_weight_shapes, is_norm_weight

WEIGHT_STD = 0.02


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
) -> dict[str, torch.Tensor]:
    """Random weights with the right names and shapes: normal(0, 0.02) matrices and biases,
    RMSNorm weights of one. Same seed, device and dtype -> same weights."""
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(config).items():
        if name == LM_HEAD_NAME and config.tie_word_embeddings:
            weights[name] = weights[EMBED_NAME]
        elif is_norm_weight(name):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            weight = torch.empty(shape, dtype=dtype, device=device)
            weights[name] = weight.normal_(0.0, WEIGHT_STD, generator=generator)
    return weights
