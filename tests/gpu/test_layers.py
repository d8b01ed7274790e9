from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu.models.config import UnsupportedModelError
from gpu.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary, rope_inv_freq

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_rms_norm_matches_definition_and_keeps_dtype() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-5, dtype=torch.float32, device="cpu")
    norm.weight.copy_(torch.randn(32))
    x = torch.randn(5, 32) * 3
    x64 = x.double()
    expected = norm.weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-6, atol=1e-6)
    norm_bf16 = RMSNorm(32, eps=1e-5, dtype=torch.bfloat16, device="cpu")
    norm_bf16.weight.copy_(norm.weight)
    out = norm_bf16(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_swiglu_mlp_matches_separate_projections() -> None:
    torch.manual_seed(0)
    mlp = SwiGLUMLP(16, 24, torch.float32, "cpu")
    gate, up, down = torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 24)
    mlp.gate_up_proj.copy_(torch.cat([gate, up]))
    mlp.down_proj.copy_(down)
    x = torch.randn(3, 16)
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-4)


def test_rotary_preserves_norms_and_depends_only_on_relative_position() -> None:
    torch.manual_seed(0)
    rotary = RotaryEmbedding(32, max_positions=128, theta=10000.0, rope_scaling=None, device="cpu")
    q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)

    def rotated(x: torch.Tensor, pos: int) -> torch.Tensor:
        cos, sin = rotary.cos_sin(torch.tensor([pos]), torch.float32)
        return apply_rotary(x, cos, sin)

    torch.testing.assert_close(rotated(q, 37).norm(), q.norm())
    torch.testing.assert_close(rotated(q, 0), q)
    dot_a = (rotated(q, 10) * rotated(k, 3)).sum()
    dot_b = (rotated(q, 90) * rotated(k, 83)).sum()
    torch.testing.assert_close(dot_a, dot_b, rtol=1e-4, atol=1e-4)


def test_llama3_inv_freq_bands() -> None:
    # head_dim 32, theta 10000: wavelengths 2*pi / inv_freq run from 6.3 to ~35,000 positions
    plain = rope_inv_freq(32, 10000.0, None)
    scaled = rope_inv_freq(32, 10000.0, LLAMA3_SCALING)
    wavelen = 2 * torch.pi / plain
    short, long = wavelen < 64 / 4, wavelen > 64 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    torch.testing.assert_close(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8)
    middle = ~short & ~long
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()


def test_linear_rope_divides_and_unknown_type_is_rejected() -> None:
    plain = rope_inv_freq(16, 500000.0, None)
    torch.testing.assert_close(
        rope_inv_freq(16, 500000.0, {"rope_type": "linear", "factor": 4.0}), plain / 4
    )
    with pytest.raises(UnsupportedModelError, match="longrope"):
        rope_inv_freq(16, 10000.0, {"rope_type": "longrope", "factor": 4.0})


@pytest.mark.slow
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rotary_matches_transformers_exactly(rope_scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope_parameters = {"rope_type": "default", "rope_theta": 500000.0, **(rope_scaling or {})}
    hf_config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, head_dim=32, max_position_embeddings=4096,
        rope_parameters=rope_parameters,
    )  # fmt: skip
    positions = torch.tensor([0, 1, 5, 63, 64, 700, 4095])
    q, k = torch.randn(len(positions), 4, 32), torch.randn(len(positions), 2, 32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin
    )
    rotary = RotaryEmbedding(32, 4096, 500000.0, rope_scaling, "cpu")
    cos, sin = rotary.cos_sin(positions, torch.float32)
    assert torch.equal(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1))
