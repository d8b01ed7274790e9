"""--kv-cache-dtype fp8 below the engine: the attention backends on CPU over an fp8 cache
(prefill chunks, decodes, windows, sinks, across steps) against the same attention over
the dequantized and the unquantized caches; KV sizing (an fp8 block is half a bf16 one);
the refusal on GPUs below compute capability 8.9; checkpoint k_scale / v_scale loading."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.core.engine_startup import check_before_load, load_errors
from actors.protocol.config import ConfigError, EngineConfig
from actors.protocol.model_source import ModelLoadError
from gpu.attention.base import AttentionBackend
from gpu.attention.kv_cache_dtype import kv_cache_dtype_refusal, resolve_kv_cache_dtype
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.kv_sizing import kv_bytes_per_block
from gpu.models.decoder_layer import DecoderLayer
from gpu.models.llama import DecoderModel
from gpu.models.presets import PRESETS
from gpu.weights.loader import load_model_files
from gpu.worker import ModelWorker, WorkerConfigError
from kernels._kv_fp8 import FP8_KV_DTYPE
from tests.gpu._paged_kv_batch import PagedKVBook
from tests.gpu._tiny_checkpoints import tiny_hf_model
from tests.gpu.test_runner_selection import CPU_ONLY, HEALTHY_GPU
from tests.kernels.test_kv_fp8 import FP8_TOLERANCE, K_SCALE, V_SCALE

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 48
STEPS = [  # prefill chunks; a mixed step with a new request; decodes only
    [("a", 5), ("b", 13), ("c", 1)],
    [("a", 1), ("b", 6), ("c", 1), ("d", 9)],
    [("d", 1), ("a", 1), ("b", 1), ("c", 1)],
]
A100 = dataclasses.replace(HEALTHY_GPU, device_name="NVIDIA A100", compute_capability=(8, 0))


@pytest.mark.parametrize("backend", [TorchAttentionBackend(), TritonAttentionBackend()])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (6, True)])
def test_backend_over_fp8_equals_the_dequantized_cache_across_steps(
    backend: AttentionBackend, window: int | None, with_sinks: bool
) -> None:
    generator = torch.Generator().manual_seed(1)
    book = PagedKVBook(NUM_BLOCKS, BLOCK_SIZE, seed=2)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    fp8_cache = torch.zeros(shape, dtype=FP8_KV_DTYPE)
    plain_cache = torch.zeros(shape)
    k_scale, v_scale = torch.tensor(K_SCALE), torch.tensor(V_SCALE)
    sinks = torch.randn(NUM_HEADS, generator=generator) if with_sinks else None
    options: dict[str, Any] = dict(sliding_window=window, sinks=sinks)
    for step in STEPS:
        _, metadata = book.step(step, num_padding_tokens=2)
        num_tokens = metadata.num_actual_tokens + 2
        query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
        key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        out = backend.forward(
            query, key, value, fp8_cache, metadata, HEAD_DIM**-0.5,
            k_scale=k_scale, v_scale=v_scale, **options,
        )  # fmt: skip
        dequantized = torch.stack([fp8_cache[0].float() * k_scale, fp8_cache[1].float() * v_scale])
        expected = backend.attend(query, dequantized, metadata, HEAD_DIM**-0.5, **options)
        unquantized = backend.forward(
            query, key, value, plain_cache, metadata, HEAD_DIM**-0.5, **options
        )
        real = slice(0, metadata.num_actual_tokens)
        torch.testing.assert_close(out[real], expected[real], rtol=1e-5, atol=1e-5)
        value_max = float(value.abs().max())
        torch.testing.assert_close(
            out[real], unquantized[real], rtol=0, atol=FP8_TOLERANCE * value_max
        )


def test_an_fp8_block_takes_half_the_bytes_and_doubles_the_blocks_of_bf16() -> None:
    model = PRESETS["qwen3-0.6b"]
    bf16 = kv_bytes_per_block(model, model.num_kv_heads, 16, torch.bfloat16)
    fp8 = kv_bytes_per_block(model, model.num_kv_heads, 16, FP8_KV_DTYPE)
    assert bf16 == 114688 * 16 and fp8 * 2 == bf16
    budget = 7 << 30
    assert budget // fp8 == 2 * (budget // bf16)
    # a tensor-parallel rank holding half the KV heads: half of each
    assert kv_bytes_per_block(model, model.num_kv_heads // 2, 16, FP8_KV_DTYPE) * 2 == fp8


def test_kv_cache_dtype_choices_resolve() -> None:
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) == FP8_KV_DTYPE
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8_KV_DTYPE
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto, fp8 or fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")  # type: ignore[arg-type]


def test_fp8_is_refused_below_compute_capability_8_9_only() -> None:
    reason = kv_cache_dtype_refusal("fp8", "cuda", (8, 0), "NVIDIA A100")
    assert reason is not None and "\n" not in reason
    assert "compute capability 8.9" in reason and "NVIDIA A100 is 8.0" in reason
    assert "--kv-cache-dtype auto" in reason
    assert kv_cache_dtype_refusal("fp8_e4m3", "cuda", (8, 6)) is not None
    for capability in ((8, 9), (9, 0), (10, 0)):
        assert kv_cache_dtype_refusal("fp8", "cuda", capability) is None
    assert kv_cache_dtype_refusal("fp8", "cpu", None) is None
    assert kv_cache_dtype_refusal("auto", "cuda", (7, 0)) is None


def test_startup_refuses_fp8_on_an_old_gpu_before_loading_the_model() -> None:
    # The model does not exist: the refusal must come first.
    config = EngineConfig(model="/nonexistent/model", kv_cache_dtype="fp8")
    for start in (lambda: check_before_load(config, A100), lambda: ModelWorker(config, A100)):
        with pytest.raises(WorkerConfigError, match="compute capability 8.9 or newer"):
            start()
    assert issubclass(WorkerConfigError, load_errors())  # a user error: exit code 2
    check_before_load(dataclasses.replace(config, kv_cache_dtype="auto"), A100)
    check_before_load(config, CPU_ONLY)


def _checkpoint_with_scales(path: str, scales: dict[str, torch.Tensor]) -> None:
    tiny_hf_model("qwen3").save_pretrained(path)
    weights_path = os.path.join(path, "model.safetensors")
    save_file({**load_file(weights_path), **scales}, weights_path, metadata={"format": "pt"})


def test_checkpoint_kv_scales_load_into_the_layers(tmp_path: str) -> None:
    _checkpoint_with_scales(
        str(tmp_path),
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.25, dtype=torch.bfloat16),
            "model.layers.0.self_attn.v_scale": torch.tensor([3.0]),
            # compressed-tensors names
            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.125], dtype=torch.half),
        },
    )
    files = load_model_files(str(tmp_path), torch.bfloat16)
    scale = files.weights["model.layers.1.self_attn.k_scale"]
    assert scale.dtype == torch.float32 and scale.shape == () and float(scale) == 0.125
    model = DecoderModel(files.config, TorchAttentionBackend(), torch.bfloat16, "cpu")
    model.load_weights(files.weights, consume=True)
    attns = [cast(DecoderLayer, layer).self_attn for layer in model.layers]
    got = [(float(attn.k_scale), float(attn.v_scale)) for attn in attns]
    assert got == [(0.25, 3.0), (0.125, 1.0)]  # a scale the checkpoint lacks stays 1.0
    assert not files.weights  # consumed, scales included


@pytest.mark.parametrize(
    "scales,message",
    [
        ({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, "must be positive"),
        ({"model.layers.0.self_attn.v_scale": torch.ones(2)}, "must hold one float"),
        ({"model.layers.9.self_attn.k_scale": torch.tensor(1.0)}, "unexpected"),
    ],
)
def test_bad_checkpoint_kv_scales_are_refused(
    tmp_path: str, scales: dict[str, torch.Tensor], message: str
) -> None:
    _checkpoint_with_scales(str(tmp_path), scales)
    with pytest.raises((ModelLoadError, ValueError), match=message):
        files = load_model_files(str(tmp_path), torch.float32)
        model = DecoderModel(files.config, TorchAttentionBackend(), torch.float32, "cpu")
        model.load_weights(files.weights)
