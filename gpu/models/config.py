"""Architecture description of a Llama-family decoder.

One frozen dataclass covers Llama 2/3/3.1, SmolLM2, Qwen2 and Qwen3: the per-architecture
differences (qkv bias, q/k RMSNorm, rope scaling, tied embeddings) are fields, not
separate model classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_HF_ARCHITECTURE_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The model files describe an architecture or format tandem cannot run."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    """One of SUPPORTED_ARCHITECTURES."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    """HF `rope_scaling` / `rope_parameters` as sorted items (hashable); None for plain RoPE."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type", "")
        arch = next((_HF_ARCHITECTURE_NAMES[a] for a in archs if a in _HF_ARCHITECTURE_NAMES), None)
        if arch is None and model_type in SUPPORTED_ARCHITECTURES:
            arch = model_type
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or model_type!r}; supported: "
                + ", ".join(sorted(_HF_ARCHITECTURE_NAMES))
            )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if isinstance(rope, dict):
            rope_theta = rope.get("rope_theta", rope_theta)
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = None
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=_freeze_rope(rope),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            name=hf.get("_name_or_path", ""),
        )


def _freeze_rope(rope: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if not rope:
        return None
    return tuple(sorted((k, v) for k, v in rope.items() if k != "rope_theta"))


_LLAMA31_ROPE = _freeze_rope(
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        name="smollm2-135m",
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm=True,
        name="qwen3-0.6b",
    ),
    "qwen3-8b": ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        name="qwen3-8b",
    ),
    "llama-3.1-8b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_ROPE,
        max_position_embeddings=131072,
        name="llama-3.1-8b",
    ),
    "qwen3-32b": ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_layers=64,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        name="qwen3-32b",
    ),
    "llama-3.1-70b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_ROPE,
        max_position_embeddings=131072,
        name="llama-3.1-70b",
    ),
    "qwen2-0.5b": ModelConfig(
        architecture="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        name="qwen2-0.5b",
    ),
}
