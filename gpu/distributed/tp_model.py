"""One rank's model: its weight shard loaded into a sharded DecoderModel."""

from __future__ import annotations

import torch

from gpu.attention.base import AttentionBackend
from gpu.distributed.communicator import Communicator
from gpu.distributed.group import TPGroup
from gpu.models.llama import DecoderModel
from gpu.weights.shard_loader import load_weight_shard


def load_tp_model(
    model: str,
    dtype: torch.dtype,
    group: TPGroup,
    attn_backend: AttentionBackend,
    quantization: str = "auto",
) -> DecoderModel:
    """Rank group.rank's shard of `model` (a loader source: 'default', a file, a directory,
    'dummy:<preset>') on group.device, FP8 where `quantization` (--quantization) and the
    device say. With one rank it is the whole model, with no collectives in its forward."""
    shard = load_weight_shard(
        model, dtype, group.device, group.rank, group.world_size, quantization
    )
    tp = Communicator(group) if group.world_size > 1 else None
    decoder = DecoderModel(
        shard.config, attn_backend, dtype, group.device, tp, precision=shard.precision
    )
    decoder.load_weights(shard.weights)
    return decoder
