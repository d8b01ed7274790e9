"""Pipeline parallelism: one rank's stage of the decoder, and what crosses between stages.

Every rank runs the same V2 runner on the same scheduler output (the step broadcast), so
every stage knows each step's token count without being told. Within a step:

- the first stage embeds the tokens; every later stage receives the previous stage's
  hidden state and residual stream ([2, num_tokens, hidden_size], one point-to-point
  message from the rank of the same tensor-parallel rank);
- each stage runs its layers (gpu/distributed/layout.py `stage_layers`) on its own KV
  cache, which holds those layers only;
- the last stage norms, runs the LM head and samples (batch-sharded within its
  tensor-parallel group); its tensor-parallel rank 0 then broadcasts the sampled tokens
  (and logprobs when asked for) to every rank, so every stage updates its request state
  with the same tokens and rank 0 reports them.

One batch is in flight: while a later stage computes, the earlier ones wait for the next
step (there is no micro-batching across stages yet).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gpu.distributed.group import TPGroup
from gpu.distributed.layout import stage_layers
from gpu.models.config import ModelConfig
from gpu.sampling.sampler import BatchOps, SamplerOutput
from gpu.weights.layout import EMBED_NAME

_LAYER_PREFIX = "model.layers."


class PipelineStage:
    """This rank's stage: its layers, its neighbours, and the step's exchanges."""

    def __init__(self, group: TPGroup, config: ModelConfig) -> None:
        layout = group.layout
        self.pp_rank = group.pp_rank
        self.pp_size = group.pp_size
        self.layers = stage_layers(config.num_layers, self.pp_size, self.pp_rank)
        self.is_first = self.pp_rank == 0
        self.is_last = self.pp_rank == self.pp_size - 1
        self.tie_word_embeddings = config.tie_word_embeddings
        self.prev_rank = None if self.is_first else layout.rank_of(self.pp_rank - 1, group.tp_rank)
        self.next_rank = None if self.is_last else layout.rank_of(self.pp_rank + 1, group.tp_rank)
        self.sampler_rank = layout.rank_of(self.pp_size - 1, 0)
        """The rank whose sampled tokens every rank takes."""
        self._cpu_group = group.cpu_group

    def holds_weight(self, name: str) -> bool:
        """Whether this stage loads checkpoint tensor `name` (Hugging Face naming): its
        layers', the embedding on the first stage, the final norm and the head on the last
        (the embedding there too when the head is tied to it)."""
        if name.startswith(_LAYER_PREFIX):
            return int(name[len(_LAYER_PREFIX) :].split(".", 1)[0]) in self.layers
        if name == EMBED_NAME:
            return self.is_first or (self.is_last and self.tie_word_embeddings)
        return self.is_last

    def send(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> None:
        """Hand this stage's output to the next stage (not on the last)."""
        dist.send(torch.stack((hidden, residual)), dst=self.next_rank)

    def recv(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden, residual: [num_tokens, hidden_size]
        """The previous stage's output for this step (not on the first)."""
        received = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(received, src=self.prev_rank)
        return received[0], received[1]

    def share_sampled(
        self,
        sampled: SamplerOutput | None,  # the last stage's; None elsewhere
        num_rows: int,
        max_num_logprobs: int | None,  # the whole batch's, the same on every rank
        device: torch.device,
    ) -> SamplerOutput:
        """The step's sampled tokens (and logprobs, ranks) on every rank, from the last
        stage's tensor-parallel rank 0, in one broadcast of an int32 table: [token, rank,
        logprob ids..., logprobs as float32 bits...] per row."""
        width = 1 if max_num_logprobs is None else 2 + 2 * (1 + max_num_logprobs)
        table = torch.empty(num_rows, width, dtype=torch.int32, device=device)
        if sampled is not None:
            _pack(sampled, table)
        dist.broadcast(table, src=self.sampler_rank)
        return _unpack(table, max_num_logprobs)

    def share_object(self, obj: Any) -> Any:
        """`obj` of the last stage's tensor-parallel rank 0 (host data, e.g. a step's
        prompt logprobs), on every rank; every rank calls it in the same step."""
        carried = [obj]
        dist.broadcast_object_list(carried, src=self.sampler_rank, group=self._cpu_group)
        return carried[0]


class PipelineSampler:
    """A pipeline-parallel runner's sampler: the last stage samples with `inner` (the
    plain or the batch-sharded sampler), and every rank returns the same result."""

    def __init__(self, stage: PipelineStage, inner: Any, device: torch.device) -> None:
        self.stage = stage
        self.inner = inner
        self.device = device

    def __call__(
        self,
        logits: torch.Tensor | None,  # the last stage's (as `inner` takes them); else None
        idx_mapping_gpu: torch.Tensor,  # [num_rows] int32
        idx_mapping_np: np.ndarray,  # [num_rows]
        positions_gpu: torch.Tensor,  # [num_rows] int64
        num_output_tokens_gpu: torch.Tensor,  # [num_rows] int32
        max_num_logprobs: int | None,
        ops: BatchOps | None = None,
    ) -> SamplerOutput:
        sampled = None
        if self.stage.is_last:
            sampled = self.inner(
                logits,
                idx_mapping_gpu,
                idx_mapping_np,
                positions_gpu,
                num_output_tokens_gpu,
                max_num_logprobs,
                ops=ops,
            )
        return self.stage.share_sampled(sampled, len(idx_mapping_np), max_num_logprobs, self.device)


def _pack(sampled: SamplerOutput, table: torch.Tensor) -> None:
    table[:, 0] = sampled.sampled_token_ids
    ids, logprobs, ranks = sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_ranks
    if table.shape[1] == 1:
        return
    assert ids is not None and logprobs is not None and ranks is not None
    k1 = ids.shape[1]
    table[:, 1] = ranks
    table[:, 2 : 2 + k1] = ids
    table[:, 2 + k1 :] = logprobs.contiguous().view(torch.int32)


def _unpack(table: torch.Tensor, max_num_logprobs: int | None) -> SamplerOutput:
    tokens = table[:, 0].to(torch.int64)
    if max_num_logprobs is None:
        return SamplerOutput(tokens, None, None, None)
    k1 = 1 + max_num_logprobs
    logprobs = table[:, 2 + k1 :].contiguous().view(torch.float32)
    logprob_ids = table[:, 2 : 2 + k1].to(torch.int64)
    return SamplerOutput(tokens, logprob_ids, logprobs, table[:, 1].to(torch.int64))
