"""GGUF file -> (`ModelConfig`, Hugging Face-named weights).

Tensors are dequantized one at a time on the target device, except the Q4_0 / Q4_1
projections that gpu/models/precision.py keeps as int4 (`gguf_int4_checkpoint` lists
them): those become int4 groups (gpu/weights/int4_weights.py). llama.cpp's converter
interleaves the rope pairs of q/k projection rows for the `llama` architecture; that
permutation is undone here so the weights equal the Hugging Face checkpoint's.
"""

from __future__ import annotations

import re

import torch

from gpu.models.config import ModelConfig, UnsupportedModelError
from gpu.models.int4_linear import SCALES_ZEROS_SUFFIX
from gpu.models.parallel_layers import HeadShard, head_shard
from gpu.models.precision import WeightPrecision, group_of
from gpu.models.quant_config import Int4Checkpoint
from gpu.weights.fp8_weights import apply_precision
from gpu.weights.gguf_config import ROPE_FREQS_TENSOR, gguf_model_config
from gpu.weights.gguf_file import GGUFFile
from gpu.weights.gguf_shard import read_gguf_shard
from gpu.weights.int4_weights import Q4_TYPES, int4_expected_shapes, read_gguf_int4
from gpu.weights.layout import finish_weights
from gpu.weights.shard_layout import WHOLE_TENSOR, expected_shard_shapes, weight_shard_slices

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_weight_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None if it has none."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rope_rows(
    weight: torch.Tensor,  # [num_heads * head_dim, ...] rows in llama.cpp's rope order
    num_heads: int,
) -> torch.Tensor:  # same shape, rows in Hugging Face order
    """Inverse of llama.cpp's `LlamaModel.permute` for q/k projections (weights or biases)."""
    rows = weight.shape[0]
    half_head_dim = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()


def read_gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The model's config from the metadata (and the small rope_freqs tensor, if any)."""
    rope_freqs = None
    if ROPE_FREQS_TENSOR in gguf.tensors:
        rope_freqs = read_gguf_shard(gguf, ROPE_FREQS_TENSOR, WHOLE_TENSOR, "cpu").numpy()
    return gguf_model_config(gguf, rope_freqs=rope_freqs)


def gguf_int4_checkpoint(gguf: GGUFFile) -> Int4Checkpoint | None:
    """The dense projections `gguf` stores as Q4_0 / Q4_1 matrices; None if there are none."""
    modules, block_types = set(), set()
    for name, info in gguf.tensors.items():
        hf_name = hf_weight_name(name) or ""
        module = hf_name.removesuffix(".weight")
        if info.ggml_type in Q4_TYPES and module != hf_name and group_of(module) is not None:
            modules.add(module)
            block_types.add(Q4_TYPES[info.ggml_type])
    return Int4Checkpoint(frozenset(modules), tuple(sorted(block_types))) if modules else None


def load_gguf(
    gguf: GGUFFile,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    precision: WeightPrecision | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize every tensor of `gguf` into `dtype` on `device`, under HF names; with
    tp_size > 1 only rank tp_rank's shard of each (see gpu/weights/gguf_shard.py). With
    `precision`, its int4 projections come as int4 groups (gpu/weights/int4_weights.py):
    read from their Q4 blocks where the scheme names block types, else quantized."""
    config = read_gguf_config(gguf)
    slices = weight_shard_slices(config, tp_rank, tp_size)
    heads = head_shard(config, tp_rank, tp_size)
    int4_schemes = {} if precision is None else precision.int4_schemes
    if int4_schemes and tp_size != 1:
        raise ValueError("int4 projections are loaded on one device only")
    weights: dict[str, torch.Tensor] = {}
    for name in gguf.tensors:
        if name == ROPE_FREQS_TENSOR:
            continue
        hf_name = hf_weight_name(name)
        if hf_name is None:
            raise UnsupportedModelError(
                f"unexpected tensor {name!r} for architecture {config.architecture}"
            )
        module = hf_name.removesuffix(".weight")
        scheme = int4_schemes.get(group_of(module) or "")
        if scheme is not None and scheme.block_types and module != hf_name:
            codes, scales_zeros = read_gguf_int4(gguf, name)
            weights[hf_name] = _unpermuted(codes, name, config, heads)
            weights[f"{module}.{SCALES_ZEROS_SUFFIX}"] = _unpermuted(
                scales_zeros, name, config, heads
            )
            continue
        # Shards start on head boundaries, so each shard's rope rows unpermute on their own.
        weight = read_gguf_shard(gguf, name, slices.get(hf_name, WHOLE_TENSOR), device)
        weight = _unpermuted(weight, name, config, heads)
        weights[hf_name] = weight.to(dtype)
    expected = expected_shard_shapes(config, tp_rank, tp_size)
    if precision is not None:
        apply_precision(weights, precision)
        expected = int4_expected_shapes(expected, precision)
    return config, finish_weights(config, weights, gguf.path, expected)


def _unpermuted(
    rows: torch.Tensor,  # [num_rows, ...] of GGUF tensor `name` (this rank's heads)
    name: str,
    config: ModelConfig,
    heads: HeadShard,
) -> torch.Tensor:  # the same rows in Hugging Face order
    if config.architecture == "llama" and ".attn_q." in name:
        return unpermute_rope_rows(rows, heads.num_heads)
    if config.architecture == "llama" and ".attn_k." in name:
        return unpermute_rope_rows(rows, heads.num_kv_heads)
    return rows
