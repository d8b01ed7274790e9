"""Tiny seeded transformers models of each supported architecture, float32.

Weights are drawn larger than transformers' default init and the norm weights and biases
are randomised too, so that attention is peaked and every feature (RoPE variant, qkv
bias, q/k norm) visibly moves the logits.
"""

from __future__ import annotations

from typing import Any

import torch

TINY_SIZES: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.15,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that the tests' positions fall in all three llama3 frequency bands
    "original_max_position_embeddings": 32,
}

TINY_MODEL_NAMES = ("llama", "llama3_rope", "qwen2", "qwen3")


def build_tiny_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A transformers CausalLM in eval mode with seeded random weights."""
    import transformers

    if name == "llama":
        config: Any = transformers.LlamaConfig(**TINY_SIZES)
        model_cls: Any = transformers.LlamaForCausalLM
    elif name == "llama3_rope":
        config = transformers.LlamaConfig(**TINY_SIZES, rope_parameters=LLAMA3_ROPE)
        model_cls = transformers.LlamaForCausalLM
    elif name == "qwen2":
        config = transformers.Qwen2Config(**TINY_SIZES)
        model_cls = transformers.Qwen2ForCausalLM
    elif name == "qwen3":
        config = transformers.Qwen3Config(**TINY_SIZES, tie_word_embeddings=True)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown tiny model {name!r}; known: {TINY_MODEL_NAMES}")
    return seeded_model(model_cls, config, seed)


def seeded_model(model_cls: Any, config: Any, seed: int) -> Any:
    """`model_cls(config)` in float32 eval mode with seeded weights, its norms and biases
    (and attention sinks) randomised so that each visibly moves the logits, and no EOS, so
    that generate() runs the full length."""
    config.eos_token_id = None
    config.pad_token_id = 0
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif param_name.endswith(("bias", "sinks")):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
