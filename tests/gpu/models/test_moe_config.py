"""Qwen3-MoE and gpt-oss configs, presets, weight layout and dummy weights: config.json of
the real checkpoints -> the presets, parameter counts against the published totals and
against the layout, dummy MXFP4 experts, and memory while loading (the one-line errors for
what is not supported: test_moe_refusals.py)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu.attention.base import allocate_kv_cache
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.models.config import ModelConfig
from gpu.models.llama import DecoderModel
from gpu.models.moe import SparseMoE
from gpu.models.presets import PRESETS
from gpu.weights.dummy import dummy_weights
from gpu.weights.layout import expected_weight_shapes, is_mxfp4_weight
from gpu.weights.loader import load_model_files
from kernels.mxfp4 import MXFP4Tensor, dequantize_mxfp4
from tests.gpu._paged_kv_batch import PagedKVBook
from tests.gpu.models._moe_cases import _shrunk

MOE_PRESETS = ("qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b")

# config.json of Qwen/Qwen3-30B-A3B and openai/gpt-oss-20b (layer_types written out below)
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
GPT_OSS_20B_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


@pytest.mark.parametrize(
    ("hf_config", "preset"),
    [(QWEN3_30B_A3B_CONFIG, "qwen3-30b-a3b"), (GPT_OSS_20B_CONFIG, "gpt-oss-20b")],
)
def test_real_config_json_gives_the_preset(hf_config: dict, preset: str) -> None:
    config = ModelConfig.from_hf_config(hf_config)
    assert config.replace(name="") == PRESETS[preset].replace(name="")


def test_gpt_oss_120b_preset_differs_from_20b_in_depth_and_experts_only() -> None:
    big, small = PRESETS["gpt-oss-120b"], PRESETS["gpt-oss-20b"]
    assert big.replace(name="") == small.replace(
        name="", num_layers=36, num_experts=128, layer_types=big.layer_types
    )


@pytest.mark.slow  # transformers
def test_transformers_default_configs_read_their_own_field_names() -> None:
    import transformers

    qwen = transformers.Qwen3MoeConfig(num_experts=16, mlp_only_layers=[1], norm_topk_prob=True)
    config = ModelConfig.from_hf_config(qwen.to_dict())  # saved as "num_local_experts"
    assert (config.num_experts, config.num_experts_per_tok) == (16, qwen.num_experts_per_tok)
    assert config.mlp_only_layers == (1,) and config.norm_topk_prob and config.qk_norm
    assert config.moe_intermediate_size == qwen.moe_intermediate_size
    oss = transformers.GptOssConfig(num_hidden_layers=3, sliding_window=64, swiglu_limit=5.0)
    config = ModelConfig.from_hf_config(oss.to_dict())
    assert config.layer_types == tuple(oss.layer_types)
    assert [config.layer_sliding_window(i) for i in range(3)] == [64, None, 64]
    assert (config.swiglu_limit, config.swiglu_alpha) == (5.0, oss.swiglu_alpha)
    assert (config.num_experts, config.num_experts_per_tok) == (128, 4)
    assert config.rope_scaling_dict is not None
    assert config.rope_scaling_dict["rope_type"] == "yarn"
    assert not config.mxfp4_experts


# Published totals: OpenAI's model card (active parameters without the embedding) and Qwen's.
@pytest.mark.parametrize(
    ("preset", "total", "active", "active_without_embedding"),
    [
        ("gpt-oss-20b", 20.91e9, None, 3.61e9),
        ("gpt-oss-120b", 116.83e9, None, 5.13e9),
        ("qwen3-30b-a3b", 30.5e9, 3.3e9, None),
    ],
)
def test_parameter_counts_match_the_published_totals(
    preset: str, total: float, active: float | None, active_without_embedding: float | None
) -> None:
    config = PRESETS[preset]
    assert config.num_params() == pytest.approx(total, rel=0.005)
    embedding = config.vocab_size * config.hidden_size
    if active is not None:
        assert config.num_active_params() == pytest.approx(active, rel=0.02)
    if active_without_embedding is not None:
        assert config.num_active_params() - embedding == pytest.approx(
            active_without_embedding, rel=0.005
        )


def _num_values(name: str, shape: tuple[int, ...]) -> int:
    """Values a weight holds: two per MXFP4 block byte, none in its scales."""
    if name.endswith("_scales"):
        return 0
    return math.prod(shape) * (2 if is_mxfp4_weight(name) else 1)


@pytest.mark.parametrize("preset", MOE_PRESETS)
@pytest.mark.parametrize("mxfp4", [False, True])
def test_layout_num_params_and_weight_bytes_agree(preset: str, mxfp4: bool) -> None:
    changes = {"mxfp4_experts": mxfp4} if preset.startswith("gpt-oss") else {}
    config = _shrunk(preset, mlp_only_layers=(2,), **changes)
    shapes = expected_weight_shapes(config)
    qk_norms = 2 * config.head_dim * config.num_layers if config.qk_norm else 0
    qkv_biases = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    qkv_biases *= config.num_layers if config.attention_bias else 0
    # the count leaves out q/k norms and q/k/v biases, and the tied head (never here)
    num_values = sum(_num_values(name, shape) for name, shape in shapes.items())
    assert num_values == config.num_params() + qk_norms + qkv_biases
    num_bytes = sum(
        math.prod(shape) * (1 if is_mxfp4_weight(name) else 2) for name, shape in shapes.items()
    )
    assert num_bytes == config.weight_bytes(2) + 2 * (qk_norms + qkv_biases)
    expert_values = 3 * config.hidden_size * config.moe_intermediate_size
    expert_bytes = expert_values * 2 if not config.mxfp4_experts else expert_values * 17 // 32
    expert_bytes += 2 * (config.params_per_expert - expert_values)
    idle = config.num_moe_layers * (config.num_experts - config.num_experts_per_tok)
    assert config.weight_bytes(2) - config.weight_bytes(2, active_only=True) == idle * expert_bytes
    if preset == "qwen3-30b-a3b":  # mlp_only_layers
        assert "model.layers.2.mlp.gate_proj.weight" in shapes
        assert "model.layers.2.mlp.experts.0.gate_proj.weight" not in shapes


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_full_size_layout_matches_the_checkpoints(preset: str) -> None:
    config = PRESETS[preset]
    shapes = expected_weight_shapes(config)
    hidden, width, experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
    if preset == "qwen3-30b-a3b":
        assert len(shapes) == 3 + 48 * (8 + 1 + 3 * 128)  # attention and norms, router, experts
        assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == (hidden, width)
        assert shapes["model.layers.0.mlp.gate.weight"] == (experts, hidden)
    else:
        prefix = "model.layers.0.mlp.experts."
        assert shapes[prefix + "gate_up_proj_blocks"] == (experts, 5760, 90, 16)
        assert shapes[prefix + "gate_up_proj_scales"] == (experts, 5760, 90)
        assert shapes[prefix + "down_proj_blocks"] == (experts, 2880, 90, 16)
        assert shapes[prefix + "gate_up_proj_bias"] == (experts, 5760)
        assert shapes["model.layers.0.self_attn.sinks"] == (64,)
        assert shapes["model.layers.0.self_attn.o_proj.bias"] == (hidden,)
        assert shapes["model.layers.0.mlp.router.bias"] == (experts,)


@pytest.mark.parametrize("preset", MOE_PRESETS)
@torch.no_grad()
def test_dummy_moe_weights_load_and_run(preset: str) -> None:
    config = _shrunk(preset)
    weights = dummy_weights(config, torch.float32, seed=1)
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_weight_shapes(config)
    if config.mxfp4_experts:
        prefix = "model.layers.1.mlp.experts.gate_up_proj_"
        assert weights[prefix + "blocks"].dtype == weights[prefix + "scales"].dtype == torch.uint8
        values = dequantize_mxfp4(
            MXFP4Tensor(weights[prefix + "blocks"], weights[prefix + "scales"]), torch.float32
        )
        assert 0.015 < values.std().item() < 0.021 and abs(values.mean().item()) < 0.002
    model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu")
    model.load_weights(weights)
    book = PagedKVBook(16, 4)
    positions, metadata = book.step([("a", 11), ("b", 3)])
    kv_caches = allocate_kv_cache(
        config.num_layers, 16, 4, config.num_kv_heads, config.head_dim, torch.float32, "cpu"
    )
    logits = model.compute_logits(model(torch.arange(14), positions, kv_caches, metadata))
    assert logits.shape == (14, config.vocab_size) and bool(logits.isfinite().all())


class _RecordingDict(dict):
    """Records, at each deletion, the bytes still held here plus the model's allocated
    parameters: what a device would hold at that point of a consuming load."""

    def __init__(self, weights: dict[str, torch.Tensor], model: DecoderModel) -> None:
        super().__init__(weights)
        self.model = model
        self.held_bytes: list[int] = []

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        source = sum(t.nbytes for t in self.values())
        params = sum(p.nbytes for p in self.model.parameters() if not p.is_meta)
        self.held_bytes.append(source + params)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-120b"])
def test_consuming_load_holds_about_one_copy(preset: str) -> None:
    # A mid-size model whose experts are most of its bytes, as in the real ones.
    config = _shrunk(preset, num_layers=8, num_experts=32, moe_intermediate_size=64)
    model = DecoderModel(config, TorchAttentionBackend(), torch.float32, "cpu")
    weights = _RecordingDict(dummy_weights(config, torch.float32), model)
    source_bytes = sum(t.nbytes for t in weights.values())
    model.load_weights(weights, consume=True)
    moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    one_layer_experts = sum(  # the stacked expert tensors, allocated as their layer loads
        p.nbytes
        for name, p in moe_layers[0].named_parameters()
        if name.startswith(("w13", "w2")) and not name.endswith("bias")
    )
    all_experts = len(moe_layers) * one_layer_experts
    assert all_experts > 0.6 * source_bytes
    # at most every weight once, plus the non-expert parameters and one layer of experts
    # twice over (the copy being made)
    bound = source_bytes + (source_bytes - all_experts) + one_layer_experts
    assert max(weights.held_bytes) <= bound < 1.45 * source_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-120b"])
def test_big_moe_preset_loads_on_gpu_near_one_copy(preset: str) -> None:
    import time

    config = PRESETS[preset]
    weight_bytes = config.weight_bytes(2)
    if torch.cuda.get_device_properties(0).total_memory < 1.15 * weight_bytes:
        pytest.skip(f"{preset} needs {1.15 * weight_bytes / 2**30:.0f} GiB of GPU memory")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    started = time.perf_counter()
    files = load_model_files(f"dummy:{preset}", torch.bfloat16, "cuda")
    model = DecoderModel(files.config, TorchAttentionBackend(), torch.bfloat16, "cuda")
    model.load_weights(files.weights, consume=True)
    torch.cuda.synchronize()
    print(f"\ndummy {preset} loaded in {time.perf_counter() - started:.1f} s")
    held = torch.cuda.memory_allocated() - baseline
    peak = torch.cuda.max_memory_allocated() - baseline
    assert held == pytest.approx(weight_bytes, rel=0.01)
    assert peak < 1.1 * weight_bytes
    del model, files
