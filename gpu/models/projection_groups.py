"""The fused projections of a decoder layer and the checkpoint modules behind them: their
names, the slices of them that a tensor-parallel rank holds, and the per-expert modules of
Qwen3-MoE checkpoints. gpu/models/precision.py plans each projection's precision over these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpu.models.config import ModelConfig
from gpu.models.parallel_layers import head_shard, intermediate_shard
from gpu.models.quant_config import FP8_BLOCK_SIZE

QKV_GROUP, O_GROUP = "self_attn.qkv_proj", "self_attn.o_proj"
GATE_UP_GROUP, DOWN_GROUP = "mlp.gate_up_proj", "mlp.down_proj"
GROUP_PARTS = {
    QKV_GROUP: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    O_GROUP: ("self_attn.o_proj",),
    GATE_UP_GROUP: ("mlp.gate_proj", "mlp.up_proj"),
    DOWN_GROUP: ("mlp.down_proj",),
}
"""Fused parameter (name within a layer) -> the checkpoint modules fused along its rows."""
_GROUP_OF_PART = {part: group for group, parts in GROUP_PARTS.items() for part in parts}
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_MODULE = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj")


def group_of(module: str) -> str | None:
    """The fused projection of a checkpoint module ("model.layers.3.self_attn.k_proj" ->
    "model.layers.3.self_attn.qkv_proj"); None for a module that is not part of a dense
    projection (experts, routers, the LM head)."""
    parts = module.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        return None
    group = _GROUP_OF_PART.get(parts[3])
    return None if group is None else f"model.layers.{parts[2]}.{group}"


def is_expert_module(module: str) -> bool:
    """Whether `module` is one expert's projection as Qwen3-MoE checkpoints store them
    ("model.layers.3.mlp.experts.7.up_proj")."""
    return _EXPERT_MODULE.fullmatch(module) is not None


def part_modules(group: str) -> list[str]:
    """The checkpoint modules of a fused projection ("model.layers.3.self_attn.qkv_proj"),
    in row order."""
    _, _, layer, local = group.split(".", 3)
    return [f"model.layers.{layer}.{part}" for part in GROUP_PARTS[local]]


def local_name(group: str) -> str:
    return group.split(".", 3)[3]


@dataclass(frozen=True, slots=True)
class PartSlice:
    module: str
    """Checkpoint module within the layer ("self_attn.q_proj")."""
    start: int
    """First row (column-parallel) or input column (row-parallel) of this rank's slice."""
    length: int
    full: int
    """Rows (or input columns) of the whole tensor."""


def layer_geometry(
    config: ModelConfig, tp_rank: int, tp_size: int
) -> list[dict[str, list[PartSlice]]]:
    """Per layer: group -> its parts' slices on this rank (rows for q/k/v and gate/up,
    input columns for o and down), for the layers' dense projections."""
    heads = head_shard(config, tp_rank, tp_size)
    hd = config.head_dim
    q_full, kv_full = config.num_heads * hd, config.num_kv_heads * hd
    q = (heads.head_start * hd, heads.num_heads * hd, q_full)
    kv = (heads.kv_head_start * hd, heads.num_kv_heads * hd, kv_full)
    qkv = [
        PartSlice("self_attn.q_proj", *q),
        PartSlice("self_attn.k_proj", *kv),
        PartSlice("self_attn.v_proj", *kv),
    ]
    groups = {QKV_GROUP: qkv, O_GROUP: [PartSlice("self_attn.o_proj", *q)]}
    mlp_start, mlp_width = intermediate_shard(config, tp_rank, tp_size)
    mlp = (mlp_start, mlp_width, config.intermediate_size)
    dense = {
        GATE_UP_GROUP: [PartSlice("mlp.gate_proj", *mlp), PartSlice("mlp.up_proj", *mlp)],
        DOWN_GROUP: [PartSlice("mlp.down_proj", *mlp)],
    }
    return [
        groups if config.is_moe_layer(layer) else {**groups, **dense}
        for layer in range(config.num_layers)
    ]


def block_aligned(parts: list[PartSlice]) -> bool:
    """Whether the parts' 128-blocks line up with their slices and, fused, with each
    other: every slice starts on a block boundary and all but a last one that reaches the
    tensor's end span whole blocks."""
    for index, part in enumerate(parts):
        reaches_end = index == len(parts) - 1 and part.start + part.length == part.full
        if part.start % FP8_BLOCK_SIZE or (part.length % FP8_BLOCK_SIZE and not reaches_end):
            return False
    return True
