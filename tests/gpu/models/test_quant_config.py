"""config.json's quantization_config: each FP8 format detected (quant_method fp8 block-wise
and per-tensor, compressed-tensors per-tensor and per-channel, static input scales), the
ignore lists (dotted names and "re:" patterns), and every other method refused in one
line, gpt-oss's MXFP4 still read."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from gpu.models.config import ModelConfig, UnsupportedModelError
from gpu.models.quant_config import Fp8Checkpoint
from gpu.weights.loader import ModelLoadError, load_model_files
from tests.gpu._tiny_fp8_checkpoints import FORMATS

LLAMA: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _config(quantization_config: dict[str, Any] | None) -> ModelConfig:
    return ModelConfig.from_hf_config({**LLAMA, "quantization_config": quantization_config})


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fp8_block", Fp8Checkpoint("fp8", "block", False, ("lm_head",))),
        ("fp8_tensor_static", Fp8Checkpoint("fp8", "tensor", True, ())),
        ("ct_tensor", Fp8Checkpoint("compressed-tensors", "tensor", False, ("lm_head",))),
        ("ct_channel", Fp8Checkpoint("compressed-tensors", "channel", False, ("lm_head",))),
        ("ct_static", Fp8Checkpoint("compressed-tensors", "tensor", True, ("lm_head",))),
    ],
)
def test_each_fp8_format_is_detected(name: str, expected: Fp8Checkpoint) -> None:
    assert _config(FORMATS[name].quantization_config).fp8 == expected


def test_an_unquantized_config_has_no_fp8_format() -> None:
    assert _config(None).fp8 is None and _config({}).fp8 is None


def test_scale_names_follow_the_format() -> None:
    assert _config(FORMATS["fp8_block"].quantization_config).fp8.scale_suffix == (
        "weight_scale_inv"
    )
    for name in ("fp8_tensor_static", "ct_tensor", "ct_channel"):
        assert _config(FORMATS[name].quantization_config).fp8.scale_suffix == "weight_scale"


def test_weight_only_compressed_tensors_quantize_activations_dynamically() -> None:
    quant = json.loads(json.dumps(FORMATS["ct_channel"].quantization_config))
    quant["config_groups"]["group_0"]["input_activations"] = None
    assert _config(quant).fp8 == Fp8Checkpoint("compressed-tensors", "channel", False, ("lm_head",))


def test_ignore_entries_match_dotted_names_and_regexes() -> None:
    ignore = ("lm_head", "model.layers.0.mlp", "self_attn.v_proj", r"re:.*layers[.]1[.].*k_proj$")
    checkpoint = Fp8Checkpoint("compressed-tensors", "channel", False, ignore)
    ignored = [
        "lm_head",
        "model.layers.0.mlp.gate_proj",  # a whole block by its prefix
        "model.layers.3.self_attn.v_proj",  # a module in every layer by its suffix
        "model.layers.1.self_attn.k_proj",  # a regex from the start of the name
    ]
    quantized = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.10.mlp.gate_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.1.self_attn.k_proj_extra",
    ]
    assert [checkpoint.is_quantized(m) for m in ignored] == [False] * len(ignored)
    assert [checkpoint.is_quantized(m) for m in quantized] == [True] * len(quantized)


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, "unsupported quantization 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "unsupported quantization 'gptq'"),
        ({"quant_method": "bitsandbytes"}, "unsupported quantization 'bitsandbytes'"),
        ({"quant_method": "mxfp4"}, "is read for gpt-oss experts only"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "unsupported fp8 format 'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            "block-wise fp8 with a static activation_scheme",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized"},
            "unsupported compressed-tensors format 'pack-quantized'",
        ),
    ],
)
def test_other_quantizations_are_refused_in_one_line(quant: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message) as error:
        _config(quant)
    assert "\n" not in str(error.value)


def test_integer_compressed_tensors_are_refused() -> None:
    quant = json.loads(json.dumps(FORMATS["ct_channel"].quantization_config))
    quant["config_groups"]["group_0"]["weights"]["type"] = "int"
    with pytest.raises(UnsupportedModelError, match="supported: float, 8 bits"):
        _config(quant)
    quant = json.loads(json.dumps(FORMATS["ct_channel"].quantization_config))
    quant["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    with pytest.raises(UnsupportedModelError, match="weight strategy 'group'"):
        _config(quant)


def test_sparse_and_mixed_compressed_tensors_are_refused() -> None:
    quant = json.loads(json.dumps(FORMATS["ct_channel"].quantization_config))
    quant["sparsity_config"] = {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}
    with pytest.raises(UnsupportedModelError, match="sparsity format 'sparse-24-bitmask'"):
        _config(quant)
    quant = json.loads(json.dumps(FORMATS["ct_channel"].quantization_config))
    quant["format"] = "mixed-precision"
    quant["config_groups"]["group_0"]["format"] = "float-quantized"
    assert _config(quant).fp8 is not None  # every group float-quantized
    quant["config_groups"]["group_0"]["format"] = "pack-quantized"
    with pytest.raises(UnsupportedModelError, match="unsupported compressed-tensors format"):
        _config(quant)


def test_gpt_oss_mxfp4_is_still_read_as_mxfp4_experts() -> None:
    gpt_oss = dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        quantization_config={"quant_method": "mxfp4"},
    )
    config = ModelConfig.from_hf_config(gpt_oss)
    assert config.mxfp4_experts and config.fp8 is None


def test_an_awq_directory_is_refused_before_its_weights_are_read(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({**LLAMA, "quantization_config": {"quant_method": "awq"}})
    )  # no weights file at all: the config alone is refused
    with pytest.raises(ModelLoadError, match="unsupported quantization 'awq'") as error:
        load_model_files(str(tmp_path), torch.float32)
    assert "\n" not in str(error.value)
