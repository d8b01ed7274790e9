from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import pytest
import torch

from app.tokenizer_loader import load_generation_config, load_tokenizer
from gpu.models.config import ModelConfig
from gpu.models.presets import PRESETS
from gpu.weights.dummy import dummy_weights
from gpu.weights.layout import expected_weight_shapes
from gpu.weights.loader import ModelLoadError, load_model_files, resolve_model_path
from tests._embedded_model import embedded_gguf_path, needs_embedded_model
from tests._hf_reference import hf_reference_dir, hf_reference_model
from tests.gpu._tiny_checkpoints import (
    save_sharded,
    tiny_hf_model,
    write_gguf_with_tensor,
    write_tiny_gguf,
)

ARCHITECTURES = ("llama", "qwen2", "qwen3")


def _expected_config_fields(hf_config) -> dict:
    """ModelConfig fields derived straight from a transformers config object."""
    rope = dict(hf_config.rope_parameters)
    theta = rope.pop("rope_theta")
    return dict(
        architecture=hf_config.model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=None if rope["rope_type"] == "default" else tuple(sorted(rope.items())),
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=hf_config.tie_word_embeddings,
        attention_bias=hf_config.model_type == "qwen2",
        qk_norm=hf_config.model_type == "qwen3",
    )


def _assert_config_matches(config: ModelConfig, hf_config) -> None:
    fields = dataclasses.asdict(config)
    expected = _expected_config_fields(hf_config)
    assert {key: fields[key] for key in expected} == expected
    dense_defaults = ModelConfig(**{key: fields[key] for key in expected}, name=config.name)
    assert config == dense_defaults  # the MoE and gpt-oss fields keep their dense defaults


def _assert_weights_equal(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]):
    assert set(weights) == set(reference)
    for name, tensor in reference.items():
        assert weights[name].dtype == tensor.dtype, name
        assert torch.equal(weights[name], tensor), name


@pytest.fixture(scope="module")
def tiny_models():
    return {arch: tiny_hf_model(arch, seed=i) for i, arch in enumerate(ARCHITECTURES)}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_hf_directory_loads_exact_tensors_and_config(tiny_models, tmp_path, arch, sharded):
    model = tiny_models[arch]
    if sharded:
        assert len(save_sharded(model, str(tmp_path))) > 1
        assert (tmp_path / "model.safetensors.index.json").is_file()
    else:
        model.save_pretrained(tmp_path)
    files = load_model_files(str(tmp_path), torch.float32)
    _assert_config_matches(files.config, model.config)
    _assert_weights_equal(files.weights, model.state_dict())
    assert files.source == str(tmp_path)
    # What the front end reads from the same directory:
    assert load_tokenizer(str(tmp_path)) is None  # no tokenizer.json saved
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert load_generation_config(str(tmp_path)) == saved


def test_tied_head_is_the_embedding_tensor(tiny_models, tmp_path):
    tiny_models["qwen3"].save_pretrained(tmp_path)
    weights = load_model_files(str(tmp_path), torch.float32).weights
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]


def test_hf_directory_in_bfloat16_and_without_generation_config(tiny_models, tmp_path):
    model = tiny_models["qwen2"]
    model.save_pretrained(tmp_path)
    os.remove(tmp_path / "generation_config.json")
    files = load_model_files(str(tmp_path), torch.bfloat16)
    reference = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    _assert_weights_equal(files.weights, reference)
    assert load_generation_config(str(tmp_path)) == {}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("tensor_type", ["F32", "F16"])
def test_gguf_export_of_tiny_model_round_trips(tiny_models, tmp_path, arch, tensor_type):
    """A llama.cpp-style export (llama: permuted q/k and a llama3 rope_freqs tensor) loads
    back to the original weights and config."""
    model = tiny_models[arch]
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_tiny_gguf(model, path, tensor_type)
    files = load_model_files(path, torch.float32)
    assert load_tokenizer(path) is None  # the export carries no tokenizer metadata
    _assert_config_matches(files.config, model.config)
    assert files.config.name == f"tiny-{arch}"
    reference = {}
    for name, tensor in model.state_dict().items():
        if tensor_type == "F16" and tensor.ndim == 2:
            tensor = tensor.half().float()
        reference[name] = tensor
    _assert_weights_equal(files.weights, reference)


@pytest.mark.slow
@needs_embedded_model
def test_embedded_gguf_equals_transformers_float32():
    start = time.perf_counter()
    files = load_model_files("default", torch.float32, quantization="none")
    load_s = time.perf_counter() - start
    print(f"\nload_model_files('default', float32) incl. tokenizer: {load_s:.2f} s")
    reference_model = hf_reference_model()
    reference = reference_model.state_dict()
    assert len(reference) == len(files.weights) == 273  # 272 GGUF tensors + tied lm_head
    _assert_weights_equal(files.weights, reference)
    # The q/k check above is meaningful: the raw GGUF rows differ from HF's order.
    from gpu.weights.gguf_file import GGUFFile
    from gpu.weights.gguf_shard import read_gguf_shard
    from gpu.weights.shard_layout import WHOLE_TENSOR

    raw_q = read_gguf_shard(
        GGUFFile(embedded_gguf_path()), "blk.0.attn_q.weight", WHOLE_TENSOR, "cpu"
    )
    assert not torch.equal(raw_q, reference["model.layers.0.self_attn.q_proj.weight"])
    hf_json = json.loads(open(os.path.join(hf_reference_dir(), "config.json")).read())
    expected = ModelConfig.from_hf_config(hf_json)
    assert files.config.replace(name="", rms_norm_eps=0.0) == expected.replace(
        name="", rms_norm_eps=0.0
    )
    assert np.float32(files.config.rms_norm_eps) == np.float32(expected.rms_norm_eps)
    assert files.config.replace(name="") == PRESETS["smollm2-135m"].replace(name="")
    assert files.source == resolve_model_path("default") == embedded_gguf_path()
    assert load_generation_config("default") == {}
    tokenizer = load_tokenizer("default")
    assert tokenizer is not None and tokenizer.vocab_size == 49152


def _small(config: ModelConfig) -> ModelConfig:
    return config.replace(
        num_layers=2,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        num_kv_heads=2 if config.num_kv_heads < config.num_heads else 4,
        head_dim=16,
    )


@pytest.mark.parametrize("preset", [p for p in sorted(PRESETS) if not PRESETS[p].is_moe])
def test_dummy_weights_names_shapes_and_statistics(preset):
    """Dense presets (the MoE ones: tests/gpu/models/test_moe_config.py)."""
    config = _small(PRESETS[preset])
    weights = dummy_weights(config, torch.float32, seed=3)
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_weight_shapes(config)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
    if config.tie_word_embeddings:
        assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    else:
        assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    again = dummy_weights(config, torch.float32, seed=3)
    assert all(torch.equal(again[k], v) for k, v in weights.items())
    other = dummy_weights(config, torch.float32, seed=4)
    assert not torch.equal(
        other["model.layers.0.mlp.up_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"]
    )


def test_dummy_preset_through_the_loader():
    files = load_model_files("dummy:smollm2-135m", torch.bfloat16)
    assert files.config == PRESETS["smollm2-135m"]
    assert load_tokenizer("dummy:smollm2-135m") is None
    assert load_generation_config("dummy:smollm2-135m") == {}
    assert files.source == "dummy:smollm2-135m"
    assert all(t.dtype == torch.bfloat16 for t in files.weights.values())
    up = files.weights["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(up.std().item() - 0.02) < 0.001 and abs(up.mean().item()) < 0.001


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dummy_8b_on_gpu_takes_seconds():
    torch.cuda.synchronize()
    start = time.perf_counter()
    files = load_model_files("dummy:qwen3-8b", torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    print(f"\ndummy qwen3-8b bf16 on cuda: {elapsed:.2f} s")
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in files.weights.values())
    config = PRESETS["qwen3-8b"]
    qk_norm_params = config.num_layers * 2 * config.head_dim  # not counted by num_params()
    assert sum(t.numel() for t in files.weights.values()) == config.num_params() + qk_norm_params
    assert elapsed < 30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_embedded_model
def test_embedded_gguf_on_gpu_equals_cpu():
    on_cpu = load_model_files("default", torch.float32).weights
    on_gpu = load_model_files("default", torch.float32, "cuda").weights
    for name, tensor in on_cpu.items():
        assert on_gpu[name].is_cuda
        assert torch.equal(on_gpu[name].cpu(), tensor), name


# Bad input: every failure is a ModelLoadError with one line naming the file.


def _assert_one_line_error(model: str, *fragments: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model_files(model, torch.float32)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.gguf")
    _assert_one_line_error(path, path, "not found", ".gguf", "dummy:")


def test_truncated_gguf(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(open(embedded_gguf_path(), "rb").read(1024))
    _assert_one_line_error(str(path), str(path), "truncated")


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x80\x02}q\x00 a pickle, not a GGUF file")
    _assert_one_line_error(str(path), str(path), "not a GGUF file", "Hugging Face")


def test_unsupported_architecture_gguf(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    write_gguf_with_tensor(
        str(path),
        "gpt2",
        "token_embd.weight",
        np.zeros((8, 64), np.float32),
        gguf.GGMLQuantizationType.F32,
        embedding_length=64,
    )
    _assert_one_line_error(str(path), str(path), "'gpt2'", "llama, qwen2, qwen3")


def test_unsupported_quantization_type(tmp_path):
    import gguf

    path = tmp_path / "q4k.gguf"
    write_gguf_with_tensor(
        str(path),
        "llama",
        "token_embd.weight",
        np.zeros((8, 144), np.uint8),
        gguf.GGMLQuantizationType.Q4_K,
        embedding_length=256,
    )
    message = _assert_one_line_error(str(path), str(path), "Q4_K", "token_embd.weight")
    for supported in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"):
        assert supported in message


def test_unknown_preset():
    _assert_one_line_error("dummy:gpt-5", "dummy:gpt-5", "qwen3-0.6b", "llama-3.1-8b")


def test_directory_without_config(tmp_path):
    _assert_one_line_error(str(tmp_path), str(tmp_path), "config.json")


def test_directory_without_weights(tiny_models, tmp_path):
    tiny_models["llama"].config.save_pretrained(tmp_path)
    _assert_one_line_error(str(tmp_path), str(tmp_path), "model.safetensors")


def test_directory_of_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    _assert_one_line_error(str(tmp_path), str(tmp_path), "GPT2LMHeadModel", "LlamaForCausalLM")


def test_default_resolves_to_the_embedded_file():
    expected = embedded_gguf_path()
    path = resolve_model_path("default")
    assert path == resolve_model_path("") == expected
    assert os.path.isfile(path)


def test_corrupt_safetensors(tiny_models, tmp_path):
    tiny_models["llama"].config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    _assert_one_line_error(str(tmp_path), str(tmp_path))
