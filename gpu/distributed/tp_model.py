"""One rank's model: its weight shard (its tensor-parallel slice of its pipeline stage's
layers) loaded into a sharded DecoderModel."""

from __future__ import annotations

import torch

from gpu.attention.base import AttentionBackend
from gpu.distributed.communicator import Communicator
from gpu.distributed.group import TPGroup
from gpu.distributed.pipeline import PipelineStage
from gpu.models.llama import DecoderModel
from gpu.weights.shard_loader import load_weight_shard, read_model_config


def load_tp_model(
    model: str,
    dtype: torch.dtype,
    group: TPGroup,
    attn_backend: AttentionBackend,
    quantization: str = "auto",
    sequence_parallel: bool = False,
) -> DecoderModel:
    """Rank group.rank's shard of `model` (a loader source: 'default', a file, a directory,
    'dummy:<preset>') on group.device, FP8 where `quantization` (--quantization) and the
    device say, its residual stream sharded along tokens with `sequence_parallel`
    (gpu/models/sequence_parallel.py). With one rank it is the whole model, with no
    collectives in its forward."""
    stage = None if group.pp_size == 1 else PipelineStage(group, read_model_config(model))
    shard = load_weight_shard(
        model,
        dtype,
        group.device,
        group.tp_rank,
        group.tp_size,
        quantization,
        keep=None if stage is None else stage.holds_weight,
    )
    tp = Communicator(group) if group.tp_size > 1 else None
    decoder = DecoderModel(
        shard.config,
        attn_backend,
        dtype,
        group.device,
        tp,
        precision=shard.precision,
        pp=stage,
        sequence_parallel=sequence_parallel,
    )
    decoder.load_weights(shard.weights)
    return decoder
