"""Pipeline parallelism: one rank's stage of the decoder, and what crosses between stages.

Every rank runs the same V2 runner on the same scheduler output (the step broadcast), so
every stage knows each step's token count without being told. Within a step:

- the first stage embeds the tokens; every later stage receives the previous stage's
  hidden state and residual stream ([2, num_tokens, hidden_size], one point-to-point
  message from the rank of the same tensor-parallel rank);
- each stage runs its layers (gpu/distributed/layout.py `stage_layers`) on its own KV
  cache, which holds those layers only;
- the last stage norms, runs the LM head and samples (batch-sharded within its
  tensor-parallel group).

How the sampled tokens come back depends on the runner:

- V2 (`PipelineSampler`) keeps one step per stage in flight (the scheduler's batch queue:
  actors/core/scheduler_config.py `step_groups`): the last stage's tensor-parallel rank 0
  sends the step's table (tokens, and logprobs when asked for) point to point to the first
  stage's ranks, which posted the receive when they launched the step and wait for it only
  where the tokens are used: the next step of the same requests, and rank 0's report. So
  the first stage runs the next group's step while later stages finish this one. Middle
  stages never need the tokens (they take the previous stage's hidden state).
- V1 runs one step at a time: the table is broadcast to every rank (`share_sampled`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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
        self.rank = group.rank
        self.first_stage_ranks = tuple(layout.rank_of(0, t) for t in range(group.tp_size))
        self._cpu_group = group.cpu_group
        self._sends: list[tuple[Any, torch.Tensor]] = []
        """Tables sent and not yet known to have arrived, with their buffers."""

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
        table = _new_table(num_rows, max_num_logprobs, device)
        if sampled is not None:
            _pack(sampled, table)
        dist.broadcast(table, src=self.sampler_rank)
        return _unpack(table, max_num_logprobs)

    def send_sampled(
        self,
        sampled: SamplerOutput,  # the whole batch's, on the last stage
        max_num_logprobs: int | None,
    ) -> None:
        """The last stage's side of `recv_sampled`: its tensor-parallel rank 0 sends the
        step's table to every first-stage rank without waiting for them."""
        if self.rank != self.sampler_rank:
            return
        tokens = sampled.sampled_token_ids
        table = _new_table(len(tokens), max_num_logprobs, tokens.device)
        _pack(sampled, table)
        self._sends = [(work, buf) for work, buf in self._sends if not work.is_completed()]
        for rank in self.first_stage_ranks:
            self._sends.append((dist.isend(table, dst=rank), table))

    def recv_sampled(
        self, num_rows: int, max_num_logprobs: int | None, device: torch.device
    ) -> SampledReceipt:
        """A first-stage rank's receive of this step's table, posted now, waited for later."""
        table = _new_table(num_rows, max_num_logprobs, device)
        return SampledReceipt(dist.irecv(table, src=self.sampler_rank), table, max_num_logprobs)

    def finish_sends(self) -> None:
        """Wait until every first-stage rank has taken the tables sent to it (the runner
        closes). A first-stage rank other than 0 may still be behind, waiting on the last
        steps' tables, when rank 0 has every output and closes: were this rank to leave the
        group first, that rank's receive would fail with the connection."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def share_object(self, obj: Any) -> Any:
        """`obj` of the last stage's tensor-parallel rank 0 (host data, e.g. a step's
        prompt logprobs), on every rank; every rank calls it in the same step."""
        carried = [obj]
        dist.broadcast_object_list(carried, src=self.sampler_rank, group=self._cpu_group)
        return carried[0]


class SampledReceipt:
    """A step's sampled table on its way to a first-stage rank: the receive was posted at
    launch; nothing waits for it until the tokens are used."""

    def __init__(self, work: Any, table: torch.Tensor, max_num_logprobs: int | None) -> None:
        self._work = work
        self._table = table  # [num_rows, width] int32, filled by the receive
        self._max_num_logprobs = max_num_logprobs
        self._lock = threading.Lock()
        self._arrived: SamplerOutput | None = None
        """The outputs of a host table once arrived (gloo's wait returns once only)."""
        self._failure: RuntimeError | None = None

    def on_device(self) -> SamplerOutput:
        """The step's outputs where the table lives. On CUDA the current stream waits for
        the receive (the host does not), on every call; on the CPU the first call blocks
        until it has arrived (the launch and the completion threads may both ask)."""
        if self._table.is_cuda:
            self._work.wait()
            return _unpack(self._table, self._max_num_logprobs)
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._arrived is None:
                try:
                    self._work.wait()
                except RuntimeError as exc:  # a second wait would block for ever
                    self._failure = exc
                    raise
                self._arrived = _unpack(self._table, self._max_num_logprobs)
            return self._arrived

    def to_host(self, copy_stream: torch.cuda.Stream | None) -> Callable[[], SamplerOutput]:
        """A call that returns the outputs on the host, blocking until they are there. On
        CUDA the copy is queued now on `copy_stream`, behind the receive and the current
        stream's work (the step's timing events among it)."""
        if copy_stream is None:  # the CPU: the table is on the host already
            return self.on_device
        copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy_stream):
            self._work.wait()
            self._table.record_stream(copy_stream)
            host = self._table.to("cpu", non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(copy_stream)

        def wait() -> SamplerOutput:
            arrived.synchronize()
            return _unpack(host, self._max_num_logprobs)

        return wait


class PipelineSampler:
    """A V2 pipeline-parallel runner's sampler: the last stage samples with `inner` (the
    plain or the batch-sharded sampler) and sends the table to the first stage; the first
    stage's ranks get a `SampledReceipt`; middle stages get placeholder tokens (they never
    read them: their inputs are the previous stage's hidden state)."""

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
    ) -> SamplerOutput | SampledReceipt:
        stage = self.stage
        num_rows = len(idx_mapping_np)
        if stage.is_first:
            return stage.recv_sampled(num_rows, max_num_logprobs, self.device)
        if not stage.is_last:
            return _unpack(_new_table(num_rows, max_num_logprobs, self.device), max_num_logprobs)
        sampled = self.inner(
            logits,
            idx_mapping_gpu,
            idx_mapping_np,
            positions_gpu,
            num_output_tokens_gpu,
            max_num_logprobs,
            ops=ops,
        )
        stage.send_sampled(sampled, max_num_logprobs)
        return sampled


def _new_table(num_rows: int, max_num_logprobs: int | None, device: torch.device) -> torch.Tensor:
    """[num_rows, width] int32: token, then (with logprobs) rank, logprob ids, logprobs as
    float32 bits."""
    width = 1 if max_num_logprobs is None else 2 + 2 * (1 + max_num_logprobs)
    return torch.zeros(num_rows, width, dtype=torch.int32, device=device)


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
