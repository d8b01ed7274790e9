"""Which slice of each Hugging Face weight one tensor-parallel rank loads.

Follows gpu/models/parallel_layers.py: q/k/v (weights and biases) and gate/up are sliced
along their rows, o and down along their columns, the embedding and the LM head along
the vocabulary (zero-padded to ceil(V / tp_size) rows); norms are replicated. Every
loader (safetensors, GGUF, dummy) reads exactly these slices, so a rank never holds more
than its shard of any weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.models.config import ModelConfig
from gpu.models.parallel_layers import head_shard, intermediate_shard, vocab_shard
from gpu.weights.layout import EMBED_NAME, LM_HEAD_NAME, expected_weight_shapes


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """Elements [start, stop) along `dim` of the full tensor, zero-padded to `length`."""

    dim: int | None
    """None: the whole tensor (replicated on every rank)."""
    start: int = 0
    stop: int = 0
    length: int = 0

    @property
    def num_padding(self) -> int:
        return self.length - (self.stop - self.start)

    def shard_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return full_shape
        shape = list(full_shape)
        shape[self.dim] = self.length
        return tuple(shape)


WHOLE_TENSOR = ShardSlice(None)


def weight_shard_slices(config: ModelConfig, tp_rank: int, tp_size: int) -> dict[str, ShardSlice]:
    """HF weight name -> this rank's slice, for every name of `expected_weight_shapes`."""
    heads = head_shard(config, tp_rank, tp_size)
    vocab = vocab_shard(config.vocab_size, tp_rank, tp_size)
    mlp_start, mlp_width = intermediate_shard(config, tp_rank, tp_size)
    head_dim = config.head_dim
    q_start, q_width = heads.head_start * head_dim, heads.num_heads * head_dim
    q_rows = _span(0, q_start, q_width)
    kv_rows = _span(0, heads.kv_head_start * head_dim, heads.num_kv_heads * head_dim)
    by_suffix = {
        "self_attn.q_proj.weight": q_rows,
        "self_attn.q_proj.bias": q_rows,
        "self_attn.k_proj.weight": kv_rows,
        "self_attn.k_proj.bias": kv_rows,
        "self_attn.v_proj.weight": kv_rows,
        "self_attn.v_proj.bias": kv_rows,
        "self_attn.o_proj.weight": _span(1, q_start, q_width),
        "mlp.gate_proj.weight": _span(0, mlp_start, mlp_width),
        "mlp.up_proj.weight": _span(0, mlp_start, mlp_width),
        "mlp.down_proj.weight": _span(1, mlp_start, mlp_width),
    }
    vocab_rows = ShardSlice(0, vocab.start, vocab.start + vocab.num_real_rows, vocab.num_rows)
    slices = {}
    for name in expected_weight_shapes(config):
        if name in (EMBED_NAME, LM_HEAD_NAME):
            slices[name] = vocab_rows
        else:
            slices[name] = by_suffix.get(name.split(".", 3)[-1], WHOLE_TENSOR)
    return slices


def expected_shard_shapes(
    config: ModelConfig, tp_rank: int, tp_size: int
) -> dict[str, tuple[int, ...]]:
    full = expected_weight_shapes(config)
    slices = weight_shard_slices(config, tp_rank, tp_size)
    return {name: slices[name].shard_shape(shape) for name, shape in full.items()}


def take_shard(full: torch.Tensor, shard: ShardSlice) -> torch.Tensor:
    """This rank's slice of an in-memory full tensor (a new tensor, padding zeroed)."""
    if shard.dim is None:
        return full.clone()
    return pad_shard(full.narrow(shard.dim, shard.start, shard.stop - shard.start), shard)


def pad_shard(sliced: torch.Tensor, shard: ShardSlice) -> torch.Tensor:
    """`sliced` (the [start, stop) part) zero-padded to the shard's length, contiguous."""
    if shard.dim is None or shard.num_padding == 0:
        return sliced.contiguous()
    shape = list(sliced.shape)
    shape[shard.dim] = shard.length
    padded = torch.zeros(shape, dtype=sliced.dtype, device=sliced.device)
    padded.narrow(shard.dim, 0, sliced.shape[shard.dim]).copy_(sliced)
    return padded


def _span(dim: int, start: int, length: int) -> ShardSlice:
    return ShardSlice(dim, start, start + length, length)
