"""Sampling across tensor-parallel ranks from vocabulary-sharded logits.

After the vocab-parallel LM head every rank holds [B, V_shard] logits. Two samplers turn
them into the step's tokens, the same on every rank:

- BatchShardedSampler: logit row i belongs to rank i % tp_size. One all-to-all along the
  batch hands each rank the full-vocabulary rows it owns ([ceil(B / N), V]); it samples
  them with the ordinary Sampler (bias, penalties, temperature, min-p, top-k/top-p,
  Gumbel, logprobs), and one all-gather of the compact results (int32 rows: token, then
  the logprob ids, logprobs and rank when asked for) gives every rank every row's token.
  No rank ever holds [B, V] logits, and each samples ceil(B / N) rows.
- AllGatherSampler, the plain alternative: all-gather the logits to [B, V] on every
  rank and sample every row everywhere.

Both give exactly the tokens of one-device sampling: Gumbel noise is keyed on (seed,
position, token), so a draw does not depend on the batch it runs in, and the ops are
decided from the whole batch on every rank, so every row takes the path it would take
unsharded. Ownership goes by logit row rather than request row so that the shares stay
balanced whichever rows the requests hold; every rank derives the same plan from B alone,
since every rank receives the same scheduler output.

The all-to-all needs each rank's local logits in owner-major order (rank 0's rows, then
rank 1's, ...). `logits_row_order` gives that order; a runner gathers its hidden states
in it before the LM head (`hidden[logits_indices[order]]`), which reorders [B, hidden]
instead of [B, V / N]. `to_owner_major` reorders logits already in batch order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from gpu.models.parallel_layers import Collectives, gather_vocab_logits, stitch_vocab_shards
from gpu.sampling.sampler import BatchOps, Sampler, SamplerOutput, batch_ops


class ShardingCollectives(Collectives, Protocol):
    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which rank samples which logit row, for a batch of `num_rows` rows."""

    num_rows: int
    tp_size: int
    rows_per_rank: int
    """ceil(num_rows / tp_size): every rank's share, padded to the largest."""
    owner_major_rows_np: np.ndarray
    """[tp_size * rows_per_rank] int64: the logit row for each slot, owner by owner
    (rows r, r + N, r + 2N, ... for rank r); padding slots repeat row 0."""

    def num_owned(self, rank: int) -> int:
        return len(range(rank, self.num_rows, self.tp_size))

    def owned_rows(self, rank: int) -> slice:
        return slice(rank, self.num_rows, self.tp_size)


def shard_plan(num_rows: int, tp_size: int) -> ShardPlan:
    if num_rows < 1 or tp_size < 1:
        raise ValueError(f"need num_rows >= 1 and tp_size >= 1, got {num_rows}, {tp_size}")
    rows_per_rank = -(-num_rows // tp_size)
    slots = np.arange(rows_per_rank)[None, :] * tp_size + np.arange(tp_size)[:, None]
    rows = np.where(slots < num_rows, slots, 0).reshape(-1).astype(np.int64)
    return ShardPlan(num_rows, tp_size, rows_per_rank, rows)


def to_owner_major(
    logits: torch.Tensor,  # [num_rows, ...] in batch order
    plan: ShardPlan,
) -> torch.Tensor:  # [tp_size * rows_per_rank, ...] in owner-major order
    order = torch.from_numpy(plan.owner_major_rows_np).to(logits.device)
    return logits.index_select(0, order)


class BatchShardedSampler:
    """Each rank samples its own rows of full-vocabulary logits (see the module doc)."""

    def __init__(self, sampler: Sampler, tp: ShardingCollectives) -> None:
        self.sampler = sampler
        self.tp = tp
        self.vocab_size = sampler.state.vocab_size
        self._plans: dict[int, tuple[ShardPlan, torch.Tensor]] = {}

    def plan(self, num_rows: int) -> ShardPlan:
        return self._plan_and_order(num_rows)[0]

    def logits_row_order(self, num_rows: int) -> torch.Tensor:
        """[tp_size * rows_per_rank] int64 on the state's device: the batch rows, in the
        order the local logits must arrive in."""
        return self._plan_and_order(num_rows)[1]

    def __call__(
        self,
        local_logits: torch.Tensor,  # [tp_size * rows_per_rank, V_shard], owner-major
        idx_mapping_gpu: torch.Tensor,  # [num_rows] int32, logit row -> request row
        idx_mapping_np: np.ndarray,  # [num_rows]
        positions_gpu: torch.Tensor,  # [num_rows] int64
        num_output_tokens_gpu: torch.Tensor,  # [num_rows] int32
        max_num_logprobs: int | None,  # the whole batch's, the same on every rank
        ops: BatchOps | None = None,  # the whole batch's; decided here when None
    ) -> SamplerOutput:  # the whole batch's, in batch order, on every rank
        plan = self.plan(len(idx_mapping_np))
        num_slots, shard_rows = local_logits.shape
        if num_slots != plan.tp_size * plan.rows_per_rank:
            raise ValueError(
                f"local_logits has {num_slots} rows; the plan for {plan.num_rows} "
                f"rows needs {plan.tp_size * plan.rows_per_rank} (owner-major)"
            )
        received = self.tp.all_to_all(local_logits).view(
            plan.tp_size, plan.rows_per_rank, shard_rows
        )
        rank = self.tp.rank
        num_owned = plan.num_owned(rank)
        num_columns = 1 if max_num_logprobs is None else 4 + 2 * max_num_logprobs
        packed = torch.zeros(
            plan.rows_per_rank, num_columns, dtype=torch.int32, device=local_logits.device
        )
        if num_owned:
            logits = stitch_vocab_shards(received[:, :num_owned], self.vocab_size)
            del received
            own = plan.owned_rows(rank)
            output = self.sampler(
                logits,
                idx_mapping_gpu[own].contiguous(),
                idx_mapping_np[own],
                positions_gpu[own].contiguous(),
                num_output_tokens_gpu[own].contiguous(),
                max_num_logprobs,
                ops=ops or batch_ops(self.sampler.state, np.asarray(idx_mapping_np)),
            )
            _pack(output, packed[:num_owned])
        gathered = self.tp.all_gather(packed).view(plan.tp_size, plan.rows_per_rank, num_columns)
        batch_major = gathered.transpose(0, 1).reshape(-1, num_columns)[: plan.num_rows]
        return _unpack(batch_major, max_num_logprobs)

    def _plan_and_order(self, num_rows: int) -> tuple[ShardPlan, torch.Tensor]:
        cached = self._plans.get(num_rows)
        if cached is None:
            plan = shard_plan(num_rows, self.tp.world_size)
            order = torch.from_numpy(plan.owner_major_rows_np).to(self.sampler.state.device)
            cached = self._plans[num_rows] = (plan, order)
        return cached


class AllGatherSampler:
    """Every rank gathers [B, V] logits and samples every row (see the module doc)."""

    def __init__(self, sampler: Sampler, tp: Collectives) -> None:
        self.sampler = sampler
        self.tp = tp
        self.vocab_size = sampler.state.vocab_size

    def logits_row_order(self, num_rows: int) -> torch.Tensor | None:
        """None: the local logits stay in batch order."""
        return None

    def __call__(
        self,
        local_logits: torch.Tensor,  # [num_rows, V_shard] in batch order
        idx_mapping_gpu: torch.Tensor,  # [num_rows] int32
        idx_mapping_np: np.ndarray,  # [num_rows]
        positions_gpu: torch.Tensor,  # [num_rows] int64
        num_output_tokens_gpu: torch.Tensor,  # [num_rows] int32
        max_num_logprobs: int | None,
    ) -> SamplerOutput:
        logits = gather_vocab_logits(local_logits, self.tp, self.vocab_size)
        return self.sampler(
            logits,
            idx_mapping_gpu,
            idx_mapping_np,
            positions_gpu,
            num_output_tokens_gpu,
            max_num_logprobs,
        )


def _pack(
    output: SamplerOutput,
    packed: torch.Tensor,  # [num_owned, num_columns] int32, written
) -> None:
    packed[:, 0] = output.sampled_token_ids
    if output.logprob_token_ids is None or output.logprobs is None or output.sampled_ranks is None:
        return
    width = output.logprob_token_ids.shape[1]
    packed[:, 1 : 1 + width] = output.logprob_token_ids
    packed[:, 1 + width : 1 + 2 * width] = output.logprobs.contiguous().view(torch.int32)
    packed[:, 1 + 2 * width] = output.sampled_ranks


def _unpack(
    rows: torch.Tensor,  # [num_rows, num_columns] int32, batch order
    max_num_logprobs: int | None,
) -> SamplerOutput:
    sampled = rows[:, 0].to(torch.int64)
    if max_num_logprobs is None:
        return SamplerOutput(sampled, None, None, None)
    width = 1 + max_num_logprobs
    token_ids = rows[:, 1 : 1 + width].to(torch.int64)
    logprobs = rows[:, 1 + width : 1 + 2 * width].contiguous().view(torch.float32)
    ranks = rows[:, 1 + 2 * width].to(torch.int64)
    return SamplerOutput(sampled, token_ids, logprobs, ranks)
