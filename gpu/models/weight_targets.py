"""Which parameter each Hugging Face checkpoint tensor is copied into, and the check that a
set of tensors fits those targets exactly (names, shapes, dtypes) before anything is
copied. q/k/v and gate/up are fused: each part is a row range of the fused weight."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from gpu.models.config import ModelConfig
from gpu.models.fp8_linear import part_targets
from gpu.models.moe import SparseMoE, ViewTarget, moe_weight_targets
from kernels.fp8_quant import FP8_DTYPE


class DecoderLayer(Protocol):
    """What the targets read of a decoder layer (gpu/models/llama.py DecoderLayer)."""

    input_layernorm: Any
    post_attention_layernorm: Any
    self_attn: Any
    mlp: Any


_EXACT_DTYPES = {FP8_DTYPE, torch.uint8}
"""Target dtypes a weight must arrive in: FP8 weights, int4 codes, MXFP4 blocks."""
# Buffers that some checkpoints carry but that are recomputed here.
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
Target = torch.Tensor | ViewTarget
"""Where a checkpoint tensor is copied: a view of a parameter, or (experts in another
layout) a ViewTarget."""


def check_weights(
    targets: Mapping[str, Target], weights: Mapping[str, torch.Tensor], optional: set[str]
) -> None:
    names = [n for n in weights if not n.endswith(_IGNORED_WEIGHT_SUFFIXES)]
    missing = sorted(set(targets) - set(names))
    unexpected = sorted(set(names) - set(targets) - optional)
    mis_shaped = [
        f"{name}: expected {tuple(targets[name].shape)}, got {tuple(weights[name].shape)}"
        for name in names
        if name in targets and weights[name].shape != targets[name].shape
    ]
    # copy_ would cast silently (clamping into FP8's range, truncating into int4 codes):
    # FP8 and uint8 targets take their own dtype only, and only they take it.
    mis_typed = [
        f"{name}: expected {_target_dtype(targets[name])}, got {weights[name].dtype}"
        for name in names
        if name in targets
        and _EXACT_DTYPES & {_target_dtype(targets[name]), weights[name].dtype}
        and _target_dtype(targets[name]) != weights[name].dtype
    ]
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
        for label, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mis-shaped", mis_shaped),
            ("mis-typed", mis_typed),
        )
        if items
    ]
    if problems:
        raise ValueError("cannot load weights into DecoderModel: " + "; ".join(problems))


def _target_dtype(target: Target) -> torch.dtype:
    return target.dtype if isinstance(target, torch.Tensor) else target.dest.dtype


def layer_weight_targets(
    prefix: str, layer: DecoderLayer, config: ModelConfig
) -> dict[str, Target]:
    attn = layer.self_attn
    q_rows, kv_rows = attn.q_size, attn.kv_size
    qkv_splits = {
        "q_proj": (0, q_rows),
        "k_proj": (q_rows, kv_rows),
        "v_proj": (q_rows + kv_rows, kv_rows),
    }
    targets: dict[str, Target] = {
        f"{prefix}input_layernorm.weight": layer.input_layernorm.weight.data,
        f"{prefix}post_attention_layernorm.weight": layer.post_attention_layernorm.weight.data,
    }
    qkv_parts = [(f"{prefix}self_attn.{p}", start, rows) for p, (start, rows) in qkv_splits.items()]
    targets.update(part_targets(attn.qkv_proj, qkv_parts))
    o_part = [(f"{prefix}self_attn.o_proj", 0, config.hidden_size)]
    targets.update(part_targets(attn.o_proj, o_part))
    for proj, (start, rows) in qkv_splits.items():
        if attn.qkv_bias is not None:
            targets[f"{prefix}self_attn.{proj}.bias"] = attn.qkv_bias.data.narrow(0, start, rows)
    if attn.q_norm is not None and attn.k_norm is not None:
        targets[f"{prefix}self_attn.q_norm.weight"] = attn.q_norm.weight.data
        targets[f"{prefix}self_attn.k_norm.weight"] = attn.k_norm.weight.data
    if attn.o_bias is not None:
        targets[f"{prefix}self_attn.o_proj.bias"] = attn.o_bias.data
    if attn.sinks is not None:
        targets[f"{prefix}self_attn.sinks"] = attn.sinks.data
    if isinstance(layer.mlp, SparseMoE):
        targets.update(moe_weight_targets(prefix, layer.mlp, config))
        return targets
    width, hidden = layer.mlp.intermediate_size, config.hidden_size
    gate_up = [(f"{prefix}mlp.gate_proj", 0, width), (f"{prefix}mlp.up_proj", width, width)]
    targets.update(part_targets(layer.mlp.gate_up_proj, gate_up))
    targets.update(part_targets(layer.mlp.down_proj, [(f"{prefix}mlp.down_proj", 0, hidden)]))
    return targets
