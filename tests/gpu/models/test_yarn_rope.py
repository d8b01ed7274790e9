"""YaRN rotary embedding (gpt-oss) against transformers' `_compute_yarn_parameters`:
inverse frequencies bit for bit and the attention factor, with and without truncation
and with DeepSeek-style mscale; the factor multiplies the cos/sin caches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu.models.layers import RotaryEmbedding, rope_attention_factor, rope_inv_freq

HEAD_DIM = 16
THETA = 150000.0
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@pytest.mark.slow  # transformers
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"truncate": True},
        {"factor": 4.0, "original_max_position_embeddings": 64},
        {"mscale": 0.707, "mscale_all_dim": 1.0},
        {"attention_factor": 0.8},
        {"beta_fast": 8.0, "beta_slow": 2.0},
    ],
)
def test_yarn_matches_transformers(changes: dict[str, Any]) -> None:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**YARN, **changes}
    hf_config = GptOssConfig(
        hidden_size=64,
        head_dim=HEAD_DIM,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=int(rope["original_max_position_embeddings"] * rope["factor"]),
        rope_parameters={**rope, "rope_theta": THETA},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    assert torch.equal(rope_inv_freq(HEAD_DIM, THETA, rope), inv_freq)
    assert rope_attention_factor(rope) == pytest.approx(attention_factor, rel=1e-12)
    assert not torch.equal(rope_inv_freq(HEAD_DIM, THETA, None), inv_freq)


def test_attention_factor_scales_cos_and_sin() -> None:
    plain = RotaryEmbedding(HEAD_DIM, 64, THETA, {**YARN, "attention_factor": 1.0}, "cpu")
    scaled = RotaryEmbedding(HEAD_DIM, 64, THETA, YARN, "cpu")
    factor = rope_attention_factor(YARN)
    assert factor > 1.3
    torch.testing.assert_close(scaled.cos_cache, plain.cos_cache * factor)
    torch.testing.assert_close(scaled.sin_cache, plain.sin_cache * factor)
    assert rope_attention_factor(None) == rope_attention_factor({"rope_type": "llama3"}) == 1.0
