"""Hugging Face model directory -> (`ModelConfig`, weights, generation config).

Reads `config.json`, the weights from `model.safetensors` or the shards listed in
`model.safetensors.index.json`, and `generation_config.json` when present.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from safetensors import safe_open

from gpu.attention.kv_cache_dtype import checkpoint_kv_scale, kv_scale_name
from gpu.models.config import ModelConfig
from gpu.models.precision import WeightPrecision
from gpu.weights.fp8_weights import (
    apply_precision,
    device_precision,
    fp8_expected_shapes,
    fp8_scale_slices,
    to_load_dtype,
)
from gpu.weights.int4_weights import int4_expected_shapes
from gpu.weights.layout import finish_weights, is_mxfp4_weight
from gpu.weights.shard_layout import (
    WHOLE_TENSOR,
    ShardSlice,
    expected_shard_shapes,
    pad_shard,
    weight_shard_slices,
)

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def load_hf_config(model_dir: str) -> ModelConfig:
    config_path = os.path.join(model_dir, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"{model_dir}: no {CONFIG_FILE} (not a Hugging Face model directory)"
        )
    config = ModelConfig.from_hf_config(read_json(config_path))
    if not config.name:
        config = config.replace(name=os.path.basename(os.path.normpath(model_dir)))
    return config


def load_generation_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    return read_json(path) if os.path.isfile(path) else {}


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a directory, single or sharded, in index order."""
    index_path = os.path.join(model_dir, WEIGHTS_INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: no weight_map")
        shards = list(dict.fromkeys(weight_map.values()))
        files = [os.path.join(model_dir, shard) for shard in shards]
    else:
        files = [os.path.join(model_dir, SINGLE_WEIGHTS_FILE)]
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{model_dir}: missing weights file {os.path.basename(path)} "
                f"(supported: {SINGLE_WEIGHTS_FILE} or shards listed in {WEIGHTS_INDEX_FILE})"
            )
    return files


def load_hf_dir(
    model_dir: str,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    precision: WeightPrecision | None = None,
    keep: Callable[[str], bool] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Load a Hugging Face directory's config, weights (in `dtype` on `device`, MXFP4
    blocks and scales as uint8, FP8 ones as `precision` says: gpu/weights/fp8_weights.py;
    by default what --quantization auto gives on `device`) and generation config (`{}`
    when the file is absent). With tp_size > 1 only rank tp_rank's shard of each weight is
    read from the files (gpu/weights/shard_layout.py); with `keep`, only the tensors it
    keeps (a pipeline stage's: gpu/distributed/pipeline.py)."""
    config = load_hf_config(model_dir)
    if precision is None:
        precision = device_precision(config, "auto", dtype, device, tp_rank, tp_size)
    slices = weight_shard_slices(config, tp_rank, tp_size)
    if config.fp8 is not None:
        slices.update(fp8_scale_slices(config.fp8, slices))
    device_name = str(torch.device(device))
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device=device_name) as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (keep is not None and not keep(name)):
                    continue
                shard = _read_shard(f, name, slices.get(name, WHOLE_TENSOR))
                kv_scale = kv_scale_name(name)
                if kv_scale is not None:  # a float32 scalar, under the model's name for it
                    weights[kv_scale] = checkpoint_kv_scale(name, shard).to(device_name)
                    continue
                weights[name] = _to_model_dtype(name, shard, device_name, dtype)
    apply_precision(weights, precision)
    expected = fp8_expected_shapes(expected_shard_shapes(config, tp_rank, tp_size), precision)
    expected = int4_expected_shapes(expected, precision)
    if keep is not None:
        expected = {name: shape for name, shape in expected.items() if keep(name)}
    weights = finish_weights(config, weights, model_dir, expected)
    return config, weights, load_generation_config(model_dir)


def _to_model_dtype(
    name: str, tensor: torch.Tensor, device: str, dtype: torch.dtype
) -> torch.Tensor:
    """Floating tensors in the model dtype; MXFP4 blocks and scales stay uint8, FP8
    weights float8 and their scales float32."""
    if is_mxfp4_weight(name):
        if tensor.dtype != torch.uint8:
            raise ValueError(f"weight {name!r} is {tensor.dtype}, expected uint8 (MXFP4)")
        return tensor.to(device=device)
    return to_load_dtype(tensor.to(device=device), name, dtype)


def _read_shard(f: Any, name: str, shard: ShardSlice) -> torch.Tensor:
    """Read only `shard` of tensor `name` from an open safetensors file."""
    if shard.dim is None:
        return f.get_tensor(name)
    tensor_slice = f.get_slice(name)
    full_shape = tensor_slice.get_shape()
    if shard.dim >= len(full_shape) or (shard.start, shard.stop, shard.length) == (
        0,
        full_shape[shard.dim],
        full_shape[shard.dim],
    ):
        return f.get_tensor(name)  # the whole tensor; a wrong rank is reported by the caller
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.stop),)
    return pad_shard(tensor_slice[index], shard)
