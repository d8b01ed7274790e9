"""Tiny seeded transformers Qwen3-MoE and gpt-oss models, float32.

Weights are drawn larger than transformers' default init, and norms, biases, router biases
and attention sinks are randomised, so that routing, sinks and every bias visibly move the
logits. gpt-oss gets alternating sliding/full layers with a small window and YaRN rope
with a small original context, so that a short prompt crosses both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.gpu._tiny_hf_models import seeded_model

SLIDING_WINDOW = 6
TINY_MOE_SIZES: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.15,
)
TINY_MOE_NAMES = ("qwen3_moe", "qwen3_moe_mixed", "gpt_oss")


def build_tiny_moe_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A transformers CausalLM in eval mode with seeded random weights."""
    import transformers

    if name in ("qwen3_moe", "qwen3_moe_mixed"):
        mixed = name == "qwen3_moe_mixed"
        config: Any = transformers.Qwen3MoeConfig(
            **TINY_MOE_SIZES,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=not mixed,
            # layers 0 and 2 dense: 0 is listed, 2 fails (i + 1) % 2 == 0
            mlp_only_layers=[0] if mixed else [],
            decoder_sparse_step=2 if mixed else 1,
        )
        model_cls: Any = transformers.Qwen3MoeForCausalLM
    elif name == "gpt_oss":
        config = transformers.GptOssConfig(
            # heads * head_dim (96) differs from hidden_size (64), as in gpt-oss (4096 vs 2880)
            **{**TINY_MOE_SIZES, "head_dim": 24},
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 16.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                # small, so that the tests' positions go past it (factor = 256 / 16)
                "original_max_position_embeddings": 16,
            },
        )
        config._attn_implementation = "eager"
        model_cls = transformers.GptOssForCausalLM
    else:
        raise ValueError(f"unknown tiny MoE model {name!r}; known: {TINY_MOE_NAMES}")
    return seeded_model(model_cls, config, seed)


def save_mxfp4_checkpoint(hf_model: Any, directory: Path) -> None:
    """Quantize the experts to MXFP4, give `hf_model` their dequantized values, and write
    the checkpoint as OpenAI ships gpt-oss: `*_blocks`/`*_scales` in the [E, out, in]
    row order (gate and up rows interleaved) plus `quantization_config`."""
    hf_model.save_pretrained(directory)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    for layer in hf_model.model.layers:
        experts = layer.mlp.experts
        prefix = f"model.layers.{layer.self_attn.layer_idx}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(experts, proj)  # [E, in, out]: x @ param
            packed = quantize_mxfp4(param.data.transpose(1, 2))  # [E, out, in]
            with torch.no_grad():
                param.copy_(dequantize_mxfp4(packed, torch.float32).transpose(1, 2))
            del tensors[prefix + proj]
            tensors[prefix + proj + "_blocks"] = packed.blocks
            tensors[prefix + proj + "_scales"] = packed.scales
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(config))


def save_tiny_moe_checkpoint(name: str, directory: Path) -> Any:
    """Build tiny model `name` (TINY_MOE_NAMES, or "gpt_oss_mxfp4": gpt-oss with MXFP4
    experts) and save it to `directory`; returns the transformers model, whose weights are
    what the checkpoint holds (dequantized where quantized)."""
    if name == "gpt_oss_mxfp4":
        hf_model = build_tiny_moe_model("gpt_oss", seed=5)
        save_mxfp4_checkpoint(hf_model, directory)
    else:
        hf_model = build_tiny_moe_model(name)
        hf_model.save_pretrained(directory)
    return hf_model
