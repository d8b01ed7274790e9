"""The Hugging Face weight names and shapes a `ModelConfig` implies.

Every loader (GGUF, Hugging Face directory, dummy) produces exactly these names, and checks
what it read against these shapes, so the model code can index the dict without guessing.
"""

from __future__ import annotations

import torch

from gpu.models.config import ModelConfig

EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"
FINAL_NORM_NAME = "model.norm.weight"


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight, in load order. `lm_head.weight` is listed even when
    tied (the loaders alias it to the embedding then)."""
    hidden = config.hidden_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED_NAME: (config.vocab_size, hidden)}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "self_attn.q_proj.weight"] = (q_rows, hidden)
        shapes[prefix + "self_attn.k_proj.weight"] = (kv_rows, hidden)
        shapes[prefix + "self_attn.v_proj.weight"] = (kv_rows, hidden)
        if config.attention_bias:
            shapes[prefix + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[prefix + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[prefix + "self_attn.v_proj.bias"] = (kv_rows,)
        if config.qk_norm:
            shapes[prefix + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[prefix + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, q_rows)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        shapes[prefix + "mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes[FINAL_NORM_NAME] = (hidden,)
    shapes[LM_HEAD_NAME] = (config.vocab_size, hidden)
    return shapes


def is_norm_weight(name: str) -> bool:
    return name.endswith("norm.weight")


def finish_weights(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    source: str,
    expected: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Tie the head when the config says so, then check names and shapes (against
    `expected`, by default the whole model's `expected_weight_shapes`).

    Raises ValueError naming the first missing, unexpected or misshapen weight."""
    if config.tie_word_embeddings and EMBED_NAME in weights:
        weights[LM_HEAD_NAME] = weights[EMBED_NAME]
    expected = expected_weight_shapes(config) if expected is None else expected
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: missing weight {missing[0]!r}{more}")
    unexpected = [name for name in weights if name not in expected]
    if unexpected:
        raise ValueError(f"{source}: unexpected weight {unexpected[0]!r} for {config.architecture}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"{source}: weight {name!r} has shape {tuple(weights[name].shape)}, "
                f"expected {shape}"
            )
    return {name: weights[name] for name in expected}
