"""GGUF metadata -> `ModelConfig` (hyperparameters and rope scaling)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpu.models.config import ModelConfig, UnsupportedModelError
from gpu.weights.gguf_file import GGUFFile

ROPE_FREQS_TENSOR = "rope_freqs.weight"
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_MOE_GGUF_ARCHITECTURES = ("qwen3moe", "gpt-oss", "qwen3_moe", "gpt_oss")
_LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


def gguf_model_config(
    gguf: GGUFFile,
    rope_freqs: np.ndarray | None = None,  # [head_dim // 2] float32 llama3 rope factors
) -> ModelConfig:
    """Read the architecture's hyperparameters from GGUF metadata."""
    arch = gguf.architecture
    if arch in _MOE_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF files of the mixture-of-experts architecture {arch!r} are not supported; "
            f"load its Hugging Face safetensors directory instead"
        )
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    meta = gguf.metadata

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks required key {arch}.{name}")
        return value

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    embed = gguf.tensors.get("token_embd.weight")
    vocab_size = embed.shape[0] if embed else len(meta.get("tokenizer.ggml.tokens", ()))
    rope_theta = _float32_value(key("rope.freq_base", 10000.0))
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size) or vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_float32_value(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(meta, arch, rope_freqs, rope_theta, head_dim),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
        name=str(meta.get("general.name", "")),
    )


def _float32_value(value: float) -> float:
    # GGUF stores these as float32; its shortest decimal form is the value the model was
    # trained with (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _rope_scaling(
    meta: dict[str, Any],
    arch: str,
    rope_freqs: np.ndarray | None,
    rope_theta: float,
    head_dim: int,
) -> tuple[tuple[str, Any], ...] | None:
    original_len = meta.get(f"{arch}.rope.scaling.original_context_length")
    if rope_freqs is not None:
        return _infer_llama3_rope(rope_freqs, rope_theta, head_dim, original_len)
    rope_type = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if rope_type is None and meta.get(f"{arch}.rope.scale_linear") is not None:
        rope_type, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if rope_type in (None, "none") or (rope_type == "linear" and factor in (None, 0.0, 1.0)):
        return None
    if rope_type not in ("linear", "yarn"):
        raise UnsupportedModelError(
            f"unsupported rope scaling type {rope_type!r}; supported: linear, yarn, llama3"
        )
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": _float32_value(factor or 1.0)}
    if original_len is not None:
        scaling["original_max_position_embeddings"] = int(original_len)
    return tuple(sorted(scaling.items()))


def _infer_llama3_rope(
    rope_freqs: np.ndarray,  # [head_dim // 2] float32
    rope_theta: float,
    head_dim: int,
    original_len: int | None,
) -> tuple[tuple[str, Any], ...]:
    """llama.cpp stores Llama 3.1 rope scaling as a per-frequency factor tensor; recover the
    HF parameters from it, and refuse if the standard llama3 formula does not reproduce it."""
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    scaling = {
        "rope_type": "llama3",
        "factor": _float32_value(float(factors.max())),
        "original_max_position_embeddings": int(original_len or 8192),
        **_LLAMA3_ROPE_DEFAULTS,
    }
    expected = llama3_rope_factors(scaling, rope_theta, head_dim)
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise UnsupportedModelError(
            "rope_freqs tensor does not match llama3 rope scaling with "
            f"{scaling}; supported: llama3 (low_freq_factor 1, high_freq_factor 4), linear, yarn"
        )
    return tuple(sorted(scaling.items()))


def llama3_rope_factors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of the inverse frequencies (llama.cpp's `rope_freqs`)."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    smooth = (original_len / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen > original_len / low, factor, medium)
    return np.where(wavelen < original_len / high, 1.0, factors)
