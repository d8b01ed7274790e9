"""Where the decoder's residual stream lies over a TP group, and the collectives that follow.

Without sequence parallelism every rank of a tensor-parallel group holds the whole
residual stream: each attention block and each MLP ends with an all-reduce of
[num_tokens, hidden_size], and every rank runs both RMSNorms and the residual adds on
every token (`Replicated`).

With it (`TokenSharded`) the stream is sharded along tokens: the step's T tokens are
padded with zero rows to T_pad, a multiple of tp_size, and rank r holds rows
[r * T_pad / tp_size, (r + 1) * T_pad / tp_size) (gpu/models/parallel_layers.py). The
all-reduce after o_proj and down_proj becomes a reduce-scatter, the residual add and
RMSNorm run on the shard, and an all-gather of the normed shard is the [T, hidden_size]
input of the next column-parallel projection (qkv, gate_up). A reduce-scatter and an
all-gather move the bytes of one all-reduce, so the norms and adds on 1 / tp_size of the
tokens come at no extra communication. The embedding is reduce-scattered too, and the
final norm's output all-gathered, so the hidden states the LM head reads are the same on
every rank and nothing after the model changes. A pipeline stage boundary carries the
whole (gathered, unpadded) hidden state and residual.

Padding depends on T and tp_size only, and no collective reads a size from the device:
both layouts run inside CUDA graphs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gpu.models.parallel_layers import (
    Collectives,
    all_gather_tokens,
    reduce_scatter_tokens,
    token_shard,
)


class TokenLayout(Protocol):
    """The residual stream's rows on this rank, and how a layer's tensors get there."""

    def reduce(
        self,
        partial: torch.Tensor,  # [num_tokens, hidden_size]: this rank's partial sums
    ) -> torch.Tensor:  # the layout's rows of the sum over ranks
        ...

    def gather(
        self,
        rows: torch.Tensor,  # the layout's rows [..., hidden_size]
        num_tokens: int,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], the same on every rank
        ...

    def shard(
        self,
        full: torch.Tensor,  # [num_tokens, hidden_size], the same on every rank
    ) -> torch.Tensor:  # the layout's rows
        ...


class Replicated:
    """Every rank holds every token: partial sums are all-reduced (nothing without TP)."""

    def __init__(self, tp: Collectives | None) -> None:
        self.tp = tp

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def gather(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return rows

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full


class TokenSharded:
    """Rank r holds token rows [r * T_pad / tp_size, (r + 1) * T_pad / tp_size)."""

    def __init__(self, tp: Collectives) -> None:
        self.tp = tp

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_tokens(partial, self.tp)

    def gather(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return all_gather_tokens(rows, self.tp, num_tokens)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return token_shard(full, self.tp)


def token_layout(tp: Collectives | None, sequence_parallel: bool) -> TokenLayout:
    """Sharded along tokens under TP with sequence parallelism, else replicated (one rank
    has nothing to shard over)."""
    if tp is not None and sequence_parallel:
        return TokenSharded(tp)
    return Replicated(tp)
