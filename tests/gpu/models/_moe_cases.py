"""What test_moe_config.py and test_moe_refusals.py share: a MoE preset shrunk to tiny
sizes (4 layers and 8 experts of width 32 unless changed), with any other fields changed."""

from __future__ import annotations

from gpu.models.config import ModelConfig
from gpu.models.presets import PRESETS


def _shrunk(preset: str, **changes: object) -> ModelConfig:
    config = PRESETS[preset]
    num_layers = int(changes.pop("num_layers", 4))  # type: ignore[call-overload]
    layer_types = None if config.layer_types is None else config.layer_types[:num_layers]
    fields: dict = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        layer_types=layer_types,
        sliding_window=None if layer_types is None else 5,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    return config.replace(**{**fields, **changes})
