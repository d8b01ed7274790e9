"""The Hugging Face weight names and shapes a `ModelConfig` implies.

Every loader (GGUF, Hugging Face directory, dummy) produces exactly these names, and checks
what it read against these shapes, so the model code can index the dict without guessing.

Mixture-of-experts layers are listed as the real checkpoints store them: Qwen3-MoE one
tensor per expert and projection plus the router `mlp.gate`; gpt-oss stacked experts with
gate and up rows interleaved, either MXFP4 (`*_blocks` [..., rows, cols / 32, 16] and
`*_scales` [..., rows, cols / 32], uint8: OpenAI's checkpoints) or unquantized in the
transposed layout transformers saves (`gate_up_proj` [E, hidden, 2I], `down_proj`
[E, I, hidden]). Every floating weight is in the model dtype, the attention sinks included
(the model keeps them in float32); MXFP4 blocks and scales stay uint8.
"""

from __future__ import annotations

import torch

from gpu.attention.kv_cache_dtype import kv_scale_name
from gpu.models.config import MXFP4_GROUP_SIZE, ModelConfig

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
        if config.o_proj_bias:
            shapes[prefix + "self_attn.o_proj.bias"] = (hidden,)
        if config.attention_sinks:
            shapes[prefix + "self_attn.sinks"] = (config.num_heads,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        if config.is_moe_layer(layer):
            shapes.update(_moe_shapes(config, prefix + "mlp."))
        else:
            shapes[prefix + "mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
            shapes[prefix + "mlp.up_proj.weight"] = (config.intermediate_size, hidden)
            shapes[prefix + "mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes[FINAL_NORM_NAME] = (hidden,)
    shapes[LM_HEAD_NAME] = (config.vocab_size, hidden)
    return shapes


def _moe_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    hidden, width, num_experts = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
    )
    if config.architecture == "qwen3_moe":
        shapes = {prefix + "gate.weight": (num_experts, hidden)}
        for expert in range(num_experts):
            name = f"{prefix}experts.{expert}."
            shapes[name + "gate_proj.weight"] = (width, hidden)
            shapes[name + "up_proj.weight"] = (width, hidden)
            shapes[name + "down_proj.weight"] = (hidden, width)
        return shapes
    experts = prefix + "experts."
    shapes = {
        prefix + "router.weight": (num_experts, hidden),
        prefix + "router.bias": (num_experts,),
    }
    if config.mxfp4_experts:
        group, block_bytes = MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE // 2
        shapes[experts + "gate_up_proj_blocks"] = (
            num_experts,
            2 * width,
            hidden // group,
            block_bytes,
        )
        shapes[experts + "gate_up_proj_scales"] = (num_experts, 2 * width, hidden // group)
        shapes[experts + "down_proj_blocks"] = (num_experts, hidden, width // group, block_bytes)
        shapes[experts + "down_proj_scales"] = (num_experts, hidden, width // group)
    else:
        shapes[experts + "gate_up_proj"] = (num_experts, hidden, 2 * width)
        shapes[experts + "down_proj"] = (num_experts, width, hidden)
    shapes[experts + "gate_up_proj_bias"] = (num_experts, 2 * width)
    shapes[experts + "down_proj_bias"] = (num_experts, hidden)
    return shapes


def is_mxfp4_weight(name: str) -> bool:
    """Whether `name` is a uint8 half of an MXFP4 tensor (blocks or scales)."""
    return name.endswith(("_blocks", "_scales"))


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

    KV cache scales (`<layer>.self_attn.k_scale` / `v_scale`, gpu/attention/kv_cache_dtype.py)
    are optional and kept when present.

    Raises ValueError naming the first missing, unexpected or misshapen weight."""
    expected = expected_weight_shapes(config) if expected is None else expected
    if config.tie_word_embeddings and EMBED_NAME in weights and LM_HEAD_NAME in expected:
        weights[LM_HEAD_NAME] = weights[EMBED_NAME]
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: missing weight {missing[0]!r}{more}")
    kv_scales = {name: tensor for name, tensor in weights.items() if kv_scale_name(name) == name}
    unexpected = [name for name in weights if name not in expected and name not in kv_scales]
    if unexpected:
        raise ValueError(f"{source}: unexpected weight {unexpected[0]!r} for {config.architecture}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"{source}: weight {name!r} has shape {tuple(weights[name].shape)}, "
                f"expected {shape}"
            )
    return {name: weights[name] for name in expected} | kv_scales
