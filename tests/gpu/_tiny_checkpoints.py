"""Tiny random transformers models and GGUF exports of them, for weight-loading tests.

The GGUF export follows llama.cpp's converter (convert_hf_to_gguf.py) independently of the
loader under test: llama.cpp tensor names, the q/k rope-row permutation for `llama`, and
the llama3 `rope_freqs` factor tensor.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

TINY_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_hf_model(architecture: str, seed: int = 0, num_layers: int = 2) -> Any:
    """A randomly initialised float32 transformers model of `num_layers` layers: llama
    (llama3 rope scaling, untied head), qwen2 (qkv bias, tied) or qwen3 (q/k norm,
    head_dim != hidden/heads, tied)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    sizes = {**TINY_SIZES, "num_hidden_layers": num_layers}
    if architecture == "llama":
        config = LlamaConfig(
            **sizes,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters=dict(LLAMA3_ROPE),
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
    elif architecture == "qwen2":
        config = Qwen2Config(
            **sizes,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
        model = Qwen2ForCausalLM(config)
    elif architecture == "qwen3":
        config = Qwen3Config(
            **sizes,
            head_dim=32,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
        model = Qwen3ForCausalLM(config)
    else:
        raise ValueError(architecture)
    # Norm weights start at one; randomise them so a mix-up between tensors shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(torch.randn_like(param))
    return model.eval()


_HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[rest]}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: interleave the two rope halves of each head."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's llama3 `rope_freqs`: the divisor of each inverse frequency."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old_context_len = rope["original_max_position_embeddings"]
    low_wavelen = old_context_len / rope["low_freq_factor"]
    high_wavelen = old_context_len / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context_len / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_tiny_gguf(model: Any, path: str, tensor_type: str = "F32") -> None:
    """Export a tiny transformers model the way llama.cpp's converter would (F32 or F16
    matrices; Q4_0 or Q4_1 layer projections, with F32 embeddings and head, quantized by
    gguf's reference code; norms and biases stay F32)."""
    import gguf

    config = model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight", llama3_rope_factors(config.rope_parameters, head_dim)
        )
    for name, array in state.items():
        if arch == "llama" and "q_proj" in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and "k_proj" in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if tensor_type == "F16" and array.ndim == 2:
            array = array.astype(np.float16)
        if tensor_type in ("Q4_0", "Q4_1") and array.ndim == 2 and name.startswith("model.layers."):
            q4 = gguf.GGMLQuantizationType[tensor_type]
            quantized = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), q4)
            writer.add_tensor(_gguf_name(name), quantized, raw_dtype=q4)
            continue
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    _write(writer)


def write_gguf_with_tensor(
    path: str, arch: str, tensor_name: str, raw: np.ndarray, raw_dtype: Any, embedding_length: int
) -> None:
    """A minimal GGUF with llama-style hyperparameters and one tensor given as raw data
    (for quantized types, `raw` is uint8 [rows, bytes per row])."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(embedding_length)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_context_length(128)
    writer.add_tensor(tensor_name, raw, raw_dtype=raw_dtype)
    _write(writer)


def _write(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def save_sharded(model: Any, directory: str) -> list[str]:
    """save_pretrained with a small shard size; returns the shard file names."""
    model.save_pretrained(directory, max_shard_size="100KB")
    return sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
