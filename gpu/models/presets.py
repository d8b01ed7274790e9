"""The `dummy:` presets: real architectures' shapes (config.json of each model), for random
weights in benchmarks and tests."""

from __future__ import annotations

from gpu.models.config import _GPT_OSS_DEFAULT_ROPE, ModelConfig, _freeze_rope

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

_GPT_OSS_ROPE = _freeze_rope(_GPT_OSS_DEFAULT_ROPE)


def _gpt_oss_preset(name: str, num_layers: int, num_experts: int) -> ModelConfig:
    """gpt-oss as OpenAI ships it: MXFP4 experts, alternating sliding/full attention."""
    return ModelConfig(
        architecture="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_layers=num_layers,
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=_GPT_OSS_ROPE,
        max_position_embeddings=131072,
        attention_bias=True,
        o_proj_bias=True,
        attention_sinks=True,
        layer_types=tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ),
        sliding_window=128,
        num_experts=num_experts,
        num_experts_per_tok=4,
        moe_intermediate_size=2880,
        norm_topk_prob=True,
        router_bias=True,
        expert_bias=True,
        moe_activation="swiglu_clamped",
        mxfp4_experts=True,
        name=name,
    )


PRESETS.update(
    {
        "qwen3-30b-a3b": ModelConfig(
            architecture="qwen3_moe",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_layers=48,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            qk_norm=True,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            name="qwen3-30b-a3b",
        ),
        "gpt-oss-20b": _gpt_oss_preset("gpt-oss-20b", num_layers=24, num_experts=32),
        "gpt-oss-120b": _gpt_oss_preset("gpt-oss-120b", num_layers=36, num_experts=128),
    }
)
