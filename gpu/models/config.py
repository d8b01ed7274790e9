"""Architecture description of a Llama-family decoder.

One frozen dataclass covers Llama 2/3/3.1, SmolLM2, Qwen2, Qwen3 and the mixture-of-experts
Qwen3-MoE and gpt-oss: the per-architecture differences (qkv bias, q/k RMSNorm, rope
scaling, tied embeddings, experts, sliding-window layers, attention sinks) are fields, not
separate model classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gpu.models.quant_config import Fp8Checkpoint, UnsupportedQuantizationError, fp8_checkpoint

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss")
MOE_ARCHITECTURES = ("qwen3_moe", "gpt_oss")
LAYER_TYPES = ("full_attention", "sliding_attention")
MOE_ACTIVATIONS = ("silu", "swiglu_clamped")
MXFP4_GROUP_SIZE = 32
"""Values per shared exponent of MXFP4 expert weights (kernels/mxfp4.py)."""

_HF_ARCHITECTURE_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
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
    o_proj_bias: bool = False
    """Bias on the attention output projection (gpt-oss; Qwen3-MoE with attention_bias)."""
    attention_sinks: bool = False
    """A learned per-head logit in each attention softmax's denominator (gpt-oss)."""
    layer_types: tuple[str, ...] | None = None
    """Per layer "full_attention" or "sliding_attention" (see `sliding_window`); None: all full."""
    sliding_window: int | None = None
    """Keys a sliding-attention layer's query sees: positions p - W < k <= p."""
    num_experts: int = 0
    """Experts of each MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Intermediate width of one expert (`intermediate_size` is the dense layers' width)."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing weights to sum to one (gpt-oss always does)."""
    router_bias: bool = False
    """Bias on the router's linear layer (gpt-oss)."""
    expert_bias: bool = False
    """Biases on each expert's gate/up and down projections (gpt-oss)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers with a dense MLP in an MoE model (Qwen3-MoE)."""
    decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % decoder_sparse_step == 0 (and i not in mlp_only_layers)."""
    moe_activation: str = "silu"
    """The experts' gate: "silu" or "swiglu_clamped" (gpt-oss, with swiglu_alpha/limit)."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4_experts: bool = False
    """Expert weights stored in MXFP4 (uint8 blocks and scales, as gpt-oss ships them)."""
    fp8: Fp8Checkpoint | None = None
    """How the checkpoint stores FP8 projections (gpu/models/quant_config.py); None when
    it has none. What each projection then runs in is gpu/models/precision.py's call."""
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
        problem = _layer_types_problem(self) or _moe_problem(self)
        if problem:
            raise UnsupportedModelError(f"{self.name or self.architecture}: {problem}")

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None when it attends to every earlier key."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameters of the whole model (every expert). The q/k norms and q/k/v biases
        (under 0.01% of any supported model) are left out."""
        hidden = self.hidden_size
        attn = hidden * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += hidden * self.o_proj_bias + self.num_heads * self.attention_sinks
        num_moe = self.num_moe_layers
        dense_mlp = 3 * hidden * self.intermediate_size
        router = self.num_experts * (hidden + self.router_bias)
        moe = self.num_experts * self.params_per_expert + router
        per_layer = attn + 2 * hidden
        embed = self.vocab_size * hidden
        head = 0 if self.tie_word_embeddings else embed
        mlps = (self.num_layers - num_moe) * dense_mlp + num_moe * moe
        return self.num_layers * per_layer + mlps + embed + head + hidden

    @property
    def params_per_expert(self) -> int:
        """Weights (gate, up, down) and, for gpt-oss, biases of one expert."""
        width = self.moe_intermediate_size
        biases = (2 * width + self.hidden_size) if self.expert_bias else 0
        return 3 * self.hidden_size * width + biases

    def num_active_params(self) -> int:
        """Parameters one token reads: the whole model less the experts it is not routed to
        (equal to num_params() for a dense model)."""
        idle_experts = self.num_moe_layers * (self.num_experts - self.num_experts_per_tok)
        return self.num_params() - idle_experts * self.params_per_expert

    def weight_bytes(self, dtype_bytes: int, active_only: bool = False) -> int:
        """Bytes of the weights held in a `dtype_bytes`-byte dtype, MXFP4 experts at their
        packed size (half a byte per value plus one scale byte per 32); active_only: the
        bytes one token reads (see num_active_params)."""
        num_params = self.num_active_params() if active_only else self.num_params()
        if not self.mxfp4_experts:
            return num_params * dtype_bytes
        experts_read = self.num_experts_per_tok if active_only else self.num_experts
        packed_params = self.num_moe_layers * experts_read * 3 * self.hidden_size
        packed_params *= self.moe_intermediate_size
        packed_bytes = packed_params // 2 + packed_params // MXFP4_GROUP_SIZE
        return (num_params - packed_params) * dtype_bytes + packed_bytes

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
        if arch == "gpt_oss" and not rope:
            rope = dict(_GPT_OSS_DEFAULT_ROPE)
        rope_theta = hf.get("rope_theta")
        if isinstance(rope, dict):
            rope_theta = rope.get("rope_theta", rope_theta)
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = None
        moe_fields = _hf_moe_fields(arch, hf) if arch in MOE_ARCHITECTURES else {}
        try:
            fp8 = fp8_checkpoint(hf)
        except UnsupportedQuantizationError as exc:
            raise UnsupportedModelError(str(exc)) from None
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
            attention_bias=bool(hf.get("attention_bias", arch in ("qwen2", "gpt_oss"))),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            fp8=fp8,
            name=hf.get("_name_or_path", ""),
            **moe_fields,
        )


def _hf_moe_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE, sliding-window and sink fields of a Qwen3-MoE or gpt-oss config.json."""
    attention_bias = bool(hf.get("attention_bias", arch == "gpt_oss"))
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    top_k = hf.get("num_experts_per_tok") or hf.get("experts_per_token") or 0
    if arch == "qwen3_moe":
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported Qwen3-MoE hidden_act {hf['hidden_act']!r}")
        num_layers = hf["num_hidden_layers"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            o_proj_bias=attention_bias,
            layer_types=("sliding_attention",) * num_layers if window else None,
            sliding_window=window,
        )
    quant = hf.get("quantization_config") or {}
    quant_method = quant.get("quant_method")
    if quant and quant_method != "mxfp4":
        raise UnsupportedModelError(
            f"unsupported gpt-oss quantization {quant_method!r}; supported: mxfp4 or none"
        )
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=hf["intermediate_size"],
        norm_topk_prob=True,
        router_bias=True,
        expert_bias=True,
        o_proj_bias=attention_bias,
        attention_sinks=True,
        layer_types=tuple(layer_types),
        sliding_window=hf.get("sliding_window", 128),
        moe_activation="swiglu_clamped",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        mxfp4_experts=quant_method == "mxfp4",
    )


def _layer_types_problem(config: ModelConfig) -> str | None:
    if config.layer_types is None:
        return None
    if len(config.layer_types) != config.num_layers:
        return f"{len(config.layer_types)} layer_types for {config.num_layers} layers"
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        return f"unsupported layer_types {unknown}; supported: {', '.join(LAYER_TYPES)}"
    window = config.sliding_window
    if "sliding_attention" in config.layer_types and (window is None or window < 1):
        return f"sliding_attention layers need a sliding_window >= 1, got {window}"
    return None


def _moe_problem(config: ModelConfig) -> str | None:
    if config.architecture in MOE_ARCHITECTURES and config.num_experts < 1:
        return "a mixture-of-experts architecture needs num_experts >= 1"
    if not config.is_moe:
        return None
    if not 1 <= config.num_experts_per_tok <= config.num_experts:
        return (
            f"num_experts_per_tok {config.num_experts_per_tok} is not in "
            f"[1, num_experts={config.num_experts}]"
        )
    if config.moe_intermediate_size < 1 or config.decoder_sparse_step < 1:
        return "moe_intermediate_size and decoder_sparse_step must be >= 1"
    if config.moe_activation not in MOE_ACTIVATIONS:
        return f"unknown moe_activation {config.moe_activation!r}; known: {MOE_ACTIVATIONS}"
    widths = (config.hidden_size, config.moe_intermediate_size)
    if config.mxfp4_experts and any(width % MXFP4_GROUP_SIZE for width in widths):
        return f"MXFP4 experts need hidden and expert widths divisible by 32, got {widths}"
    return None


def _freeze_rope(rope: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if not rope:
        return None
    return tuple(sorted((k, v) for k, v in rope.items() if k != "rope_theta"))


_GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""transformers' GptOssConfig default when config.json names no rope scaling."""
