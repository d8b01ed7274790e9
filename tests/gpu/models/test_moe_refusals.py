"""What the MoE models refuse, each in one line: tensor parallelism, GGUF files of MoE
architectures, inconsistent configs, and HF checkpoints with a misshapen expert tensor,
float MXFP4 blocks or another quantization."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.distributed.tp_config import TensorParallelError, validate_tensor_parallel
from gpu.models.config import UnsupportedModelError
from gpu.models.llama import DecoderModel
from gpu.models.parallel_layers import check_tensor_parallel_size
from gpu.models.presets import PRESETS
from gpu.weights.loader import ModelLoadError, load_model_files
from tests.gpu._tiny_checkpoints import write_gguf_with_tensor
from tests.gpu.models._moe_cases import _shrunk


def test_moe_models_refuse_tensor_parallelism() -> None:
    config = PRESETS["gpt-oss-20b"]
    check_tensor_parallel_size(config, 1)
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts") as error:
        check_tensor_parallel_size(config, 2)
    assert "\n" not in str(error.value)
    with pytest.raises(TensorParallelError, match="one GPU only"):
        validate_tensor_parallel(2, PRESETS["qwen3-30b-a3b"], "cuda", "cuda", 2)

    class TwoRanks:
        rank, world_size = 0, 2

    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        DecoderModel(
            _shrunk("gpt-oss-20b"), TorchAttentionBackend(), torch.float32, "cpu", TwoRanks()
        )  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_gguf_of_moe_architectures_is_refused(tmp_path, arch: str) -> None:
    import gguf

    path = tmp_path / f"{arch}.gguf"
    embed = np.zeros((8, 64), np.float32)
    write_gguf_with_tensor(
        str(path), arch, "token_embd.weight", embed, gguf.GGMLQuantizationType.F32, 64
    )
    with pytest.raises(ModelLoadError) as error:
        load_model_files(str(path), torch.float32)
    message = str(error.value)
    assert "\n" not in message and arch in message and "mixture-of-experts" in message


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
        ({"layer_types": ("full_attention",)}, "1 layer_types for 4 layers"),
        ({"sliding_window": None}, "sliding_window"),
        ({"moe_intermediate_size": 48}, "divisible by 32"),
        ({"num_experts": 0}, "num_experts >= 1"),
    ],
)
def test_inconsistent_moe_configs_are_refused(changes: dict, fragment: str) -> None:
    with pytest.raises(UnsupportedModelError, match=fragment) as error:
        _shrunk("gpt-oss-20b", **changes)
    assert "\n" not in str(error.value)


def _save_tiny_gpt_oss(directory) -> None:
    from tests.gpu.models._tiny_moe_models import build_tiny_moe_model

    build_tiny_moe_model("gpt_oss").save_pretrained(directory)


@pytest.mark.slow  # transformers
def test_hf_loader_names_a_misshapen_expert_tensor_in_one_line(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    _save_tiny_gpt_oss(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name][:, :, :-2].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as error:
        load_model_files(str(tmp_path), torch.float32)
    message = str(error.value)
    assert "\n" not in message and name in message and "(8, 64, 62)" in message


@pytest.mark.slow  # transformers
def test_hf_loader_refuses_float_mxfp4_blocks_and_other_quantizations(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    _save_tiny_gpt_oss(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported gpt-oss quantization 'fp8'"):
        load_model_files(str(tmp_path), torch.float32)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    config_path.write_text(json.dumps(config))
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            weight = tensors.pop(prefix + proj).transpose(1, 2)  # [E, out, in]
            tensors[prefix + proj + "_blocks"] = weight.reshape(
                *weight.shape[:2], -1, 16
            ).contiguous()
            tensors[prefix + proj + "_scales"] = torch.zeros(weight.shape[:2] + (1,))
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as error:
        load_model_files(str(tmp_path), torch.float32)
    assert "\n" not in str(error.value) and "expected uint8 (MXFP4)" in str(error.value)
