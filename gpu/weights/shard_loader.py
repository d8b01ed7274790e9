"""One tensor-parallel rank's weights: each rank reads only its slices of the files.

`model` takes the same values as gpu/weights/loader.py ('default', a .gguf file, a
Hugging Face directory, 'dummy:<preset>'); no tokenizer is loaded here. How each format
reads a slice: safetensors through `get_slice`, GGUF as gpu/weights/gguf_shard.py says,
dummy weights block by block (gpu/weights/dummy.py), so that a dummy shard equals the
same slice of the whole model's dummy weights exactly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from actors.protocol.model_source import DUMMY_PREFIX, ModelLoadError, resolve_model_path
from gpu.models.config import ModelConfig
from gpu.models.parallel_layers import check_tensor_parallel_size
from gpu.models.precision import WeightPrecision
from gpu.models.quant_config import Int4Checkpoint
from gpu.weights.dummy import dummy_weights, preset_config
from gpu.weights.fp8_weights import apply_precision, device_precision
from gpu.weights.gguf_file import GGUF_MAGIC, GGUFFile
from gpu.weights.gguf_loader import gguf_int4_checkpoint, load_gguf, read_gguf_config
from gpu.weights.hf_loader import load_hf_config, load_hf_dir

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WeightShard:
    config: ModelConfig
    """The whole model's config."""
    weights: dict[str, torch.Tensor]
    """Hugging Face names -> this rank's slice (gpu/weights/shard_layout.py), in the
    requested dtype on the requested device."""
    tp_rank: int
    tp_size: int
    source: str
    precision: WeightPrecision
    """Which projections are FP8 (gpu/models/precision.py); the weights are in that form."""


def read_model_config(model: str) -> ModelConfig:
    """The config of `model` without reading its weights (for validating a TP size
    before any worker starts). Raises ModelLoadError."""
    source = resolve_model_path(model)
    return _guarded(source, lambda: _read_config(source))


def read_int4_checkpoint(model: str) -> Int4Checkpoint | None:
    """The Q4_0 / Q4_1 projections of `model` when it is a GGUF file (None for any other
    source), from its tensor table alone. Raises ModelLoadError."""
    source = resolve_model_path(model)
    if source.startswith(DUMMY_PREFIX) or not os.path.isfile(source):
        return None
    with open(source, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            return None
    return _guarded(source, lambda: gguf_int4_checkpoint(GGUFFile(source)))


def load_weight_shard(
    model: str,
    dtype: torch.dtype,
    device: str | torch.device,
    tp_rank: int,
    tp_size: int,
    quantization: str = "auto",
    keep: Callable[[str], bool] | None = None,
) -> WeightShard:
    """Rank `tp_rank` of `tp_size`'s weights, FP8 where `quantization` and the device say;
    with `keep`, only the tensors it keeps (a pipeline stage's). Raises ModelLoadError, or
    UnsupportedModelError when the model does not split over tp_size ranks or its
    precision cannot run here."""
    source = resolve_model_path(model)
    config = _guarded(source, lambda: _read_config(source))
    check_tensor_parallel_size(config, tp_size)
    precision = device_precision(config, quantization, dtype, device, tp_rank, tp_size)
    if source.startswith(DUMMY_PREFIX):
        weights = dummy_weights(config, dtype, device, tp_rank=tp_rank, tp_size=tp_size, keep=keep)
    elif os.path.isdir(source):
        weights = _guarded(
            source,
            lambda: load_hf_dir(source, dtype, device, tp_rank, tp_size, precision, keep)[1],
        )
        return WeightShard(config, weights, tp_rank, tp_size, source, precision)
    else:  # a GGUF file is read whole, then the stage keeps its part
        weights = _guarded(
            source, lambda: load_gguf(GGUFFile(source), dtype, device, tp_rank, tp_size)[1]
        )
        if keep is not None:
            weights = {name: tensor for name, tensor in weights.items() if keep(name)}
    apply_precision(weights, precision)
    return WeightShard(config, weights, tp_rank, tp_size, source, precision)


def _read_config(source: str) -> ModelConfig:
    if source.startswith(DUMMY_PREFIX):
        return preset_config(source[len(DUMMY_PREFIX) :])
    if not os.path.exists(source):
        raise ModelLoadError(f"model not found: {source}")
    if os.path.isdir(source):
        return load_hf_config(source)
    with open(source, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"cannot load {source}: not a GGUF file (first bytes {magic!r})")
    return read_gguf_config(GGUFFile(source))


def _guarded(source: str, read: Callable[[], T]) -> T:
    try:
        return read()
    except ModelLoadError:
        raise
    except Exception as exc:  # corrupt files surface as many types (safetensors, OS, GGUF)
        message = " ".join(str(exc).replace(f"{source}: ", "").split()) or type(exc).__name__
        raise ModelLoadError(f"cannot load {source}: {message}") from exc
