"""What each projection runs in (gpu/models/precision.py): FP8 GEMMs only on CUDA of
compute capability >= 8.9 (mocked here), FP8 checkpoints dequantized on CPU and with
--quantization none, --quantization fp8 refused on CPU and on older GPUs, block-scaled
fusion and tensor-parallel slices, the one-line report, and the flag itself."""

from __future__ import annotations

import argparse

import pytest
import torch

from actors.protocol.config import ConfigError, EngineConfig
from app.engine_args import add_engine_args, engine_config_from_args
from app.llm import LLM
from gpu.models.config import UnsupportedModelError
from gpu.models.precision import (
    QKV_GROUP,
    Fp8Scheme,
    group_of,
    part_modules,
    resolve_precision,
)
from gpu.models.presets import PRESETS
from gpu.models.quant_config import Fp8Checkpoint
from gpu.runner_v1.compiled_model import check_compilable

QWEN3 = PRESETS["qwen3-0.6b"]  # 28 layers, head_dim 128, MLP width 3072
BLOCK = Fp8Checkpoint("fp8", "block", False, ("lm_head",))
CHANNEL = Fp8Checkpoint("compressed-tensors", "channel", False, ("lm_head",))
HOPPER = (9, 0)


def _resolve(checkpoint, requested="auto", device="cuda", capability=HOPPER, **kw):
    config = QWEN3.replace(fp8=checkpoint)
    return resolve_precision(config, requested, torch.bfloat16, device, capability, **kw)


def test_a_block_checkpoint_runs_every_projection_in_fp8_on_hopper() -> None:
    precision = _resolve(BLOCK)
    assert precision.runs_fp8 and precision.num_fp8_projections == 28 * 7
    assert set(precision.schemes.values()) == {Fp8Scheme(block=True)}
    assert precision.describe(QWEN3) == (
        "weights: fp8 (block 128x128, dynamic per-token-group activations) for 196 "
        "projections; bfloat16 for lm_head, embeddings, norms"
    )


def test_ada_is_enough_and_older_gpus_are_refused_in_one_line() -> None:
    assert _resolve(CHANNEL, capability=(8, 9)).runs_fp8
    with pytest.raises(UnsupportedModelError, match="compute capability >= 8.9") as error:
        _resolve(CHANNEL, capability=(8, 0))
    message = str(error.value)
    assert "\n" not in message and "this GPU: 8.0" in message and "--quantization none" in message


def test_quantization_none_dequantizes_an_fp8_checkpoint_with_a_note() -> None:
    precision = _resolve(CHANNEL, "none", capability=(7, 5))
    assert not precision.runs_fp8 and precision.notes
    assert "--quantization none" in precision.notes[0]
    assert precision.describe(QWEN3) == "weights: bfloat16 (fp8 checkpoint dequantized at load)"


def test_the_cpu_dequantizes_an_fp8_checkpoint() -> None:
    precision = _resolve(BLOCK, device="cpu", capability=None)
    assert not precision.runs_fp8 and "CPU" in precision.notes[0]


def test_quantization_fp8_quantizes_a_bf16_model_at_load_on_cuda_only() -> None:
    precision = _resolve(None, "fp8")
    assert set(precision.schemes.values()) == {Fp8Scheme(block=False, quantized_at_load=True)}
    assert precision.describe(QWEN3).startswith(
        "weights: fp8 (per-channel, quantized at load, dynamic per-token activations) for 196"
    )
    with pytest.raises(UnsupportedModelError, match="need a CUDA GPU") as error:
        _resolve(None, "fp8", device="cpu", capability=None)
    assert "\n" not in str(error.value)
    with pytest.raises(UnsupportedModelError, match="--quantization auto"):
        _resolve(None, "fp8", capability=(8, 6))


def test_an_unquantized_model_stays_in_the_model_dtype() -> None:
    for requested in ("auto", "none"):
        precision = _resolve(None, requested)
        assert not precision.runs_fp8 and not precision.notes
        assert precision.describe(QWEN3) == "weights: bfloat16"


def test_block_fp8_without_triton_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="Triton is not usable"):
        _resolve(BLOCK, has_triton=False)
    assert _resolve(CHANNEL, has_triton=False).runs_fp8  # cuBLAS (torch._scaled_mm)


def test_block_scaled_parts_that_do_not_fuse_on_block_rows_run_dequantized() -> None:
    config = QWEN3.replace(intermediate_size=3000, fp8=BLOCK)  # gate rows 3000 % 128 != 0
    precision = resolve_precision(config, "auto", torch.bfloat16, "cuda", HOPPER)
    assert "model.layers.0.mlp.gate_up_proj" not in precision.schemes
    assert "model.layers.0.mlp.down_proj" in precision.schemes  # one part: partial blocks fine
    assert precision.notes == (
        "mlp.gate_up_proj: fused parts are not whole 128-row blocks (28 layers): runs "
        "dequantized to bfloat16",
    )
    assert "for 140 projections; bfloat16 for 56 projections, lm_head" in precision.describe(config)


def test_ignored_modules_and_partly_ignored_fusions_stay_in_the_model_dtype() -> None:
    ignore = ("lm_head", "re:model[.]layers[.]0[.]mlp[.].*", "model.layers.1.self_attn.k_proj")
    precision = _resolve(Fp8Checkpoint("compressed-tensors", "tensor", False, ignore))
    assert "model.layers.0.mlp.gate_up_proj" not in precision.schemes
    assert "model.layers.1.self_attn.qkv_proj" not in precision.schemes
    assert "model.layers.1.self_attn.o_proj" in precision.schemes
    assert len(precision.notes) == 1 and "partly unquantized" in precision.notes[0]


def test_tensor_parallel_slices_must_keep_whole_blocks() -> None:
    assert _resolve(BLOCK, tp_rank=1, tp_size=8).runs_fp8  # 8 KV heads: 128 rows per rank
    config = QWEN3.replace(head_dim=64, fp8=BLOCK)  # 8 ranks: 64 KV rows each
    with pytest.raises(UnsupportedModelError, match="tensor parallel size 8") as error:
        resolve_precision(config, "auto", torch.bfloat16, "cuda", HOPPER, tp_rank=0, tp_size=8)
    assert "whole 128-blocks" in str(error.value) and "\n" not in str(error.value)
    # per-channel scales shard with any rows
    channel = QWEN3.replace(head_dim=64, fp8=CHANNEL)
    assert resolve_precision(channel, "auto", torch.bfloat16, "cuda", HOPPER, 0, 8).runs_fp8


def test_fp8_moe_experts_run_in_fp8_where_their_kernel_can() -> None:
    moe = PRESETS["qwen3-30b-a3b"].replace(fp8=BLOCK)
    precision = resolve_precision(moe, "auto", torch.bfloat16, "cuda", HOPPER)
    assert precision.num_fp8_projections == 48 * 4  # attention only: every layer is MoE
    assert precision.experts == Fp8Scheme(block=True) and not precision.notes
    assert precision.describe(moe) == (
        "weights: fp8 (block 128x128, dynamic per-token-group activations) for 192 "
        "projections; bfloat16 for routers, lm_head, embeddings, norms; fp8 for experts "
        "(weight-only, block 128x128 scales, bfloat16 activations)"
    )
    # per-channel experts without Triton (whose kernel they need): dequantized, with a note
    channel = moe.replace(fp8=CHANNEL)
    no_triton = resolve_precision(channel, "auto", torch.bfloat16, "cuda", HOPPER, False)
    assert no_triton.experts is None and no_triton.runs_fp8  # the attention still runs FP8
    assert no_triton.notes == (
        "MoE experts: fp8 in the checkpoint (their FP8 kernel needs Triton), dequantized to "
        "bfloat16 at load",
    )
    assert no_triton.describe(channel).endswith(
        "bfloat16 for experts (dequantized from fp8), routers, lm_head, embeddings, norms"
    )
    # the CPU and --quantization none dequantize them like every projection
    for device, requested in (("cpu", "auto"), ("cuda", "none")):
        plain = resolve_precision(moe, requested, torch.bfloat16, device, HOPPER)
        assert plain.experts is None and not plain.runs_fp8
        assert plain.describe(moe) == "weights: bfloat16 (fp8 checkpoint dequantized at load)"


def test_experts_ignored_in_some_layers_run_dequantized_in_all() -> None:
    ignore = ("lm_head", "model.layers.3.mlp")  # layer 3's experts stay bf16 in the file
    moe = PRESETS["qwen3-30b-a3b"].replace(fp8=Fp8Checkpoint("fp8", "block", False, ignore))
    precision = resolve_precision(moe, "auto", torch.bfloat16, "cuda", HOPPER)
    assert precision.experts is None
    assert precision.notes == (
        "MoE experts: fp8 in the checkpoint (partly unquantized), dequantized to bfloat16 at load",
    )
    unquantized = ("lm_head", "re:.*[.]experts[.].*")
    moe = moe.replace(fp8=Fp8Checkpoint("fp8", "block", False, unquantized))
    precision = resolve_precision(moe, "auto", torch.bfloat16, "cuda", HOPPER)
    assert precision.experts is None and not precision.notes


def test_quantization_fp8_quantizes_qwen3_moe_experts_but_gpt_oss_keeps_mxfp4() -> None:
    moe = PRESETS["qwen3-30b-a3b"]
    precision = resolve_precision(moe, "fp8", torch.bfloat16, "cuda", HOPPER)
    assert precision.experts == Fp8Scheme(block=False, quantized_at_load=True)
    assert precision.describe(moe).endswith(
        "bfloat16 for routers, lm_head, embeddings, norms; fp8 for experts (weight-only, "
        "per-channel scales, quantized at load, bfloat16 activations)"
    )
    assert resolve_precision(moe, "auto", torch.bfloat16, "cuda", HOPPER).experts is None
    gpt_oss = PRESETS["gpt-oss-20b"]
    gpt_oss_fp8 = resolve_precision(gpt_oss, "fp8", torch.bfloat16, "cuda", HOPPER)
    assert gpt_oss_fp8.experts is None
    described = gpt_oss_fp8.describe(gpt_oss)
    assert described.endswith("bfloat16 for routers, lm_head, embeddings, norms; mxfp4 for experts")


def test_group_names_map_to_their_checkpoint_modules() -> None:
    assert group_of("model.layers.3.self_attn.k_proj") == f"model.layers.3.{QKV_GROUP}"
    assert group_of("model.layers.3.mlp.down_proj") == "model.layers.3.mlp.down_proj"
    assert group_of("model.layers.3.mlp.experts.0.gate_proj") is None
    assert group_of("lm_head") is None
    assert part_modules("model.layers.2.mlp.gate_up_proj") == [
        "model.layers.2.mlp.gate_proj",
        "model.layers.2.mlp.up_proj",
    ]


def test_compile_level_refuses_fp8_projections() -> None:
    check_compilable(QWEN3, 1, runs_fp8=False)
    with pytest.raises(UnsupportedModelError, match="FP8 projections.*--quantization none"):
        check_compilable(QWEN3, 1, runs_fp8=True)


def test_the_quantization_flag_reaches_the_engine_config(monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).quantization == "auto"
    args = parser.parse_args(["--quantization", "fp8"])
    assert engine_config_from_args(args).quantization == "fp8"
    assert engine_config_from_args(parser.parse_args(["-q", "none"])).quantization == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "awq"])
    monkeypatch.setenv("TANDEM_QUANTIZATION", "none")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).quantization == "none"
    assert engine_config_from_args(parser.parse_args(["-q", "int4"])).quantization == "int4"
    with pytest.raises(ConfigError, match="quantization must be auto, fp8, int4 or none"):
        EngineConfig(quantization="awq")  # type: ignore[arg-type]


def test_quantization_fp8_on_cpu_refuses_to_start() -> None:
    with pytest.raises(UnsupportedModelError, match="need a CUDA GPU"):
        LLM("dummy:smollm2-135m", device="cpu", quantization="fp8", num_kv_blocks=8)
