"""Megatron-style tensor parallelism for the Llama-family decoder.

How the weights split over `tp_size` ranks (rank r):
- q/k/v and gate/up are column-parallel: each rank computes its own heads and its own
  slice of the MLP's intermediate features, with no communication;
- o and down are row-parallel: each rank multiplies its slice of the input features and
  one all-reduce sums the partial outputs (one per attention block, one per MLP);
- query heads split evenly. KV heads split evenly when there are at least as many as
  ranks; otherwise each KV head is replicated on the tp_size / num_kv_heads ranks whose
  query heads read it, so every rank holds exactly the KV head its query heads need;
- the embedding and the LM head are vocab-parallel: rank r holds vocabulary rows
  [r * V_shard, (r + 1) * V_shard) with V_shard = ceil(V / tp_size) (rows past V are
  zero padding). The embedding looks up the ids of its range, zeroes the others and
  all-reduces; the LM head yields [num_tokens, V_shard] logits per rank, which the
  sampler either all-gathers or exchanges all-to-all (gpu/sampling/batch_shard.py).

Under sequence parallelism (gpu/models/sequence_parallel.py) the residual stream is
sharded along tokens instead: the all-reduces become reduce-scatters, and an all-gather
assembles each column-parallel projection's input. The token-shard helpers below pad a
step's T tokens to a multiple of tp_size with zero rows; rank r holds rows
[r * T_pad / tp_size, (r + 1) * T_pad / tp_size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from gpu.models.config import MOE_ARCHITECTURES, ModelConfig, UnsupportedModelError


class Collectives(Protocol):
    """What the sharded model needs of a TP group (gpu/distributed/communicator.py)."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank computes."""

    head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    """KV heads held by this rank (1 when KV heads are replicated)."""


@dataclass(frozen=True, slots=True)
class VocabShard:
    """The vocabulary rows one rank holds of the embedding and the LM head."""

    start: int
    num_rows: int
    """Rows of the shard, padding included: ceil(vocab_size / tp_size) on every rank."""
    num_real_rows: int
    """Rows below vocab_size (the rest are zero padding)."""


def check_tensor_parallel_size(config: ModelConfig, tp_size: int) -> None:
    """Raise UnsupportedModelError unless `config` splits evenly over `tp_size` ranks."""
    if tp_size < 1:
        raise UnsupportedModelError(f"tensor parallel size must be at least 1, got {tp_size}")
    if tp_size > 1 and config.architecture in MOE_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{config.name or config.architecture} is a mixture-of-experts model, which runs "
            f"on one GPU only for now (no tensor or expert parallelism); use tensor parallel "
            f"size 1"
        )
    problems = []
    if config.num_heads % tp_size:
        problems.append(f"its {config.num_heads} attention heads")
    kv_heads = config.num_kv_heads
    if (kv_heads >= tp_size and kv_heads % tp_size) or (kv_heads < tp_size and tp_size % kv_heads):
        problems.append(f"its {kv_heads} KV heads (a multiple or a divisor of the TP size)")
    if config.intermediate_size % tp_size:
        problems.append(f"its MLP width {config.intermediate_size}")
    if problems:
        raise UnsupportedModelError(
            f"tensor parallel size {tp_size} does not divide {' or '.join(problems)} "
            f"({config.name or config.architecture})"
        )


def head_shard(config: ModelConfig, tp_rank: int, tp_size: int) -> HeadShard:
    check_tensor_parallel_size(config, tp_size)
    num_heads = config.num_heads // tp_size
    if config.num_kv_heads >= tp_size:
        num_kv_heads = config.num_kv_heads // tp_size
        return HeadShard(tp_rank * num_heads, num_heads, tp_rank * num_kv_heads, num_kv_heads)
    # Query head h reads KV head h // group; this rank's heads all share one KV head.
    group = config.num_heads // config.num_kv_heads
    return HeadShard(tp_rank * num_heads, num_heads, tp_rank * num_heads // group, 1)


def intermediate_shard(config: ModelConfig, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first feature, number of features) of the MLP's intermediate width on this rank."""
    width = config.intermediate_size // tp_size
    return tp_rank * width, width


def vocab_shard(vocab_size: int, tp_rank: int, tp_size: int) -> VocabShard:
    num_rows = -(-vocab_size // tp_size)
    start = tp_rank * num_rows
    return VocabShard(start, num_rows, max(0, min(num_rows, vocab_size - start)))


def vocab_parallel_embedding(
    input_ids: torch.Tensor,  # [num_tokens] int
    weight: torch.Tensor,  # [shard.num_rows, hidden_size]: this rank's vocabulary rows
    shard: VocabShard,
) -> torch.Tensor:  # [num_tokens, hidden_size]: this rank's part of the sum over ranks
    """The embeddings of the ids in this rank's range, zero rows for the others: summing
    over ranks (all-reduce, or reduce-scatter under sequence parallelism) gives them all."""
    local_ids = input_ids - shard.start
    is_outside = (local_ids < 0) | (local_ids >= shard.num_real_rows)
    hidden = F.embedding(local_ids.masked_fill(is_outside, 0), weight)
    return hidden.masked_fill_(is_outside.unsqueeze(-1), 0.0)


def overlay_rows(
    partial: torch.Tensor,  # [num_tokens, hidden_size]: this rank's part of a sum over ranks
    token_index: torch.Tensor,  # [num_rows] int64
    rows: torch.Tensor,  # [num_rows, hidden_size]
    tp_rank: int,
) -> None:
    """Make the sum over ranks hold `rows` at `token_index`: rank 0 writes them, the
    others zeros (x + 0 is exact, so the sum is the rows themselves)."""
    if tp_rank == 0:
        partial.index_copy_(0, token_index, rows)
    else:
        partial.index_fill_(0, token_index, 0.0)


def stitch_vocab_shards(
    shards: torch.Tensor,  # [tp_size, num_rows, V_shard]: rank s's vocabulary slice of each row
    vocab_size: int,
) -> torch.Tensor:  # [num_rows, vocab_size] float32, contiguous, padding dropped
    """Full-vocabulary float32 rows from per-rank slices, in one pass over the data."""
    tp_size, num_rows, shard_rows = shards.shape
    logits = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=shards.device)
    for rank in range(tp_size):
        start = rank * shard_rows
        width = max(0, min(shard_rows, vocab_size - start))
        if width:
            logits[:, start : start + width].copy_(shards[rank, :, :width])
    return logits


def gather_vocab_logits(
    local_logits: torch.Tensor,  # [num_rows, V_shard], this rank's vocabulary slice
    tp: Collectives,
    vocab_size: int,
) -> torch.Tensor:  # [num_rows, vocab_size] float32 on every rank
    """The plain alternative to batch-sharded sampling: every rank gets every row."""
    num_rows, shard_rows = local_logits.shape
    gathered = tp.all_gather(local_logits).view(tp.world_size, num_rows, shard_rows)
    return stitch_vocab_shards(gathered, vocab_size)


# ---- token shards (sequence parallelism) ----------------------------------------------


def padded_num_tokens(num_tokens: int, tp_size: int) -> int:
    """num_tokens rounded up to a multiple of tp_size: it depends on the step's token
    count only, so a CUDA graph captured for a count pads the same at every replay."""
    return -(-num_tokens // tp_size) * tp_size


def pad_tokens(
    tensor: torch.Tensor,  # [num_tokens, ...]
    num_padded: int,
) -> torch.Tensor:  # [num_padded, ...]: zero rows appended (`tensor` itself when none)
    num_pad = num_padded - tensor.shape[0]
    if num_pad == 0:
        return tensor
    return F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, num_pad))


def token_shard(
    full: torch.Tensor,  # [num_tokens, ...], the same on every rank
    tp: Collectives,
) -> torch.Tensor:  # [T_pad / tp_size, ...]: this rank's rows, padding included
    """This rank's token shard of a replicated tensor; no communication."""
    rows = padded_num_tokens(full.shape[0], tp.world_size) // tp.world_size
    padded = pad_tokens(full, rows * tp.world_size)
    return padded.narrow(0, tp.rank * rows, rows)


def reduce_scatter_tokens(
    partial: torch.Tensor,  # [num_tokens, ...]: this rank's partial sums
    tp: Collectives,
) -> torch.Tensor:  # [T_pad / tp_size, ...]: this rank's token shard of the sum
    num_padded = padded_num_tokens(partial.shape[0], tp.world_size)
    return tp.reduce_scatter(pad_tokens(partial, num_padded))


def all_gather_tokens(
    shard: torch.Tensor,  # [T_pad / tp_size, ...]: this rank's token shard
    tp: Collectives,
    num_tokens: int,
) -> torch.Tensor:  # [num_tokens, ...], the same on every rank (padding dropped)
    return tp.all_gather(shard)[:num_tokens]
