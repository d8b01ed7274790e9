"""Entry point for model files: config and weights (the front end loads the tokenizer and
the generation defaults itself: app/tokenizer_loader.py).

`model` is "default" (the embedded SmolLM2-135M-Instruct GGUF), a path to a `.gguf` file,
a Hugging Face model directory, or "dummy:<preset>" (random weights, no tokenizer).
`quantization` (--quantization) and the device decide which projections are FP8 or int4
(gpu/models/precision.py); the weights come in that form (gpu/weights/fp8_weights.py,
gpu/weights/int4_weights.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from actors.protocol.model_source import (  # noqa: F401 - re-exported
    DUMMY_PREFIX,
    ModelLoadError,
    resolve_model_path,
)
from gpu.models.config import ModelConfig
from gpu.models.precision import WeightPrecision
from gpu.models.presets import PRESETS
from gpu.weights.dummy import dummy_weights, preset_config
from gpu.weights.fp8_weights import apply_precision, device_precision
from gpu.weights.gguf_file import GGUF_MAGIC, GGUFFile
from gpu.weights.gguf_loader import gguf_int4_checkpoint, load_gguf, read_gguf_config
from gpu.weights.hf_loader import load_hf_config, load_hf_dir

_SUPPORTED_SOURCES = (
    "'default', a .gguf file (F32/F16/BF16/Q8_0/Q4_0/Q4_1; llama, qwen2, qwen3), "
    "a Hugging Face directory with config.json and safetensors, or "
    f"'dummy:<preset>' ({', '.join(sorted(PRESETS))})"
)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    """Hugging Face names, already in the requested dtype on the requested device. When the
    embeddings are tied, `lm_head.weight` is the same tensor as `model.embed_tokens.weight`."""
    source: str
    """The resolved path, or "dummy:<preset>"."""
    precision: WeightPrecision
    """Which projections are FP8 or int4 (the weights are in that form already)."""


def load_model_files(
    model: str, dtype: torch.dtype, device: str | torch.device = "cpu", quantization: str = "auto"
) -> ModelFiles:
    """Load everything needed to serve `model`, its projections FP8 or int4 where
    `quantization` (auto, fp8, int4 or none) and the device say. Raises ModelLoadError, or
    UnsupportedModelError for a precision the device cannot run."""
    source = resolve_model_path(model)
    if source.startswith(DUMMY_PREFIX):
        return _load_dummy(source, dtype, device, quantization)
    if not os.path.exists(source):
        raise ModelLoadError(f"model not found: {source}; expected {_SUPPORTED_SOURCES}")
    try:
        if os.path.isdir(source):
            return _load_hf_dir(source, dtype, device, quantization)
        return _load_gguf_file(source, dtype, device, quantization)
    except ModelLoadError:
        raise
    except Exception as exc:  # corrupt files surface as many types (safetensors, tokenizers, OS)
        raise ModelLoadError(_one_line(f"cannot load {source}: {_describe(exc, source)}")) from exc


def _load_dummy(
    source: str, dtype: torch.dtype, device: str | torch.device, quantization: str
) -> ModelFiles:
    preset = source[len(DUMMY_PREFIX) :]
    try:
        config = preset_config(preset)
    except ValueError as exc:
        raise ModelLoadError(f"cannot load {source}: {exc}") from None
    precision = device_precision(config, quantization, dtype, device)
    weights = dummy_weights(config, dtype, device)
    apply_precision(weights, precision)
    return ModelFiles(config, weights, source, precision)


def _load_gguf_file(
    path: str, dtype: torch.dtype, device: str | torch.device, quantization: str
) -> ModelFiles:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"cannot load {path}: not a GGUF file (first bytes {magic!r}); "
            f"expected {_SUPPORTED_SOURCES}"
        )
    gguf = GGUFFile(path)
    int4 = gguf_int4_checkpoint(gguf)
    precision = device_precision(
        read_gguf_config(gguf), quantization, dtype, device, int4_checkpoint=int4
    )
    config, weights = load_gguf(gguf, dtype, device, precision=precision)
    return ModelFiles(config, weights, path, precision)


def _load_hf_dir(
    path: str, dtype: torch.dtype, device: str | torch.device, quantization: str
) -> ModelFiles:
    precision = device_precision(load_hf_config(path), quantization, dtype, device)
    config, weights, _ = load_hf_dir(path, dtype, device, precision=precision)
    return ModelFiles(config, weights, path, precision)


def _describe(exc: BaseException, source: str) -> str:
    # The file is named once, at the front of the final message.
    message = str(exc).replace(f"{source}: ", "")
    if isinstance(exc, FileNotFoundError) and exc.filename:
        message = f"missing file {exc.filename}"
    return message or type(exc).__name__


def _one_line(message: str) -> str:
    return " ".join(message.split())
