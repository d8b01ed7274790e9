"""The transformers twin of a loaded model: same logits, and its weights are tandem's own
storage (no copy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.hf_arms import hf_model_sharing_weights
from gpu.attention.base import AttentionMetadata, allocate_kv_cache
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from gpu.models.presets import PRESETS
from gpu.weights.dummy import dummy_weights

pytestmark = pytest.mark.slow

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
CONFIGS = {
    "qwen3": PRESETS["qwen3-0.6b"].replace(**TINY, max_position_embeddings=256),
    "llama3_rope": PRESETS["llama-3.1-8b"].replace(**TINY, max_position_embeddings=100_000),
    "qwen2": PRESETS["qwen2-0.5b"].replace(**TINY),
}


def _model(config: ModelConfig) -> DecoderModel:
    model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu")
    weights = dummy_weights(config, torch.float32, "cpu", seed=1)
    generator = torch.Generator().manual_seed(2)
    for name, weight in weights.items():  # larger weights, so that every feature moves the logits
        noise = torch.randn(weight.shape, generator=generator)
        weights[name] = (
            weight + 0.3 * noise if name.endswith(("norm.weight", "bias")) else 10 * weight
        )
    model.load_weights(weights)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_twin_shares_storage_and_matches_logits(name: str) -> None:
    config = CONFIGS[name]
    model = _model(config)
    hf = hf_model_sharing_weights(model)
    assert hf.model.embed_tokens.weight.data_ptr() == model.embed_tokens.data_ptr()
    assert (
        hf.model.layers[0].self_attn.k_proj.weight.data_ptr()
        == model.layers[0].self_attn.qkv_proj[config.num_heads * config.head_dim :].data_ptr()
    )
    num_tokens = 40
    ids = torch.randint(
        0, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        kv = allocate_kv_cache(
            config.num_layers, 4, 16, config.num_kv_heads, config.head_dim, torch.float32, "cpu"
        )
        metadata = AttentionMetadata(
            num_tokens,
            1,
            num_tokens,
            num_tokens,
            torch.tensor([0, num_tokens], dtype=torch.int32),
            torch.tensor([num_tokens], dtype=torch.int32),
            torch.arange(num_tokens),
            torch.arange(4, dtype=torch.int32)[None],
            np.array([0, num_tokens], dtype=np.int32),
            np.array([num_tokens], dtype=np.int32),
        )
        actual = model.compute_logits(model(ids, torch.arange(num_tokens), kv, metadata))
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
