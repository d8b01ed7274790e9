"""Collectives over one TP group's device tensors.

Every rank calls the same collectives in the same order with tensors of the same shape
and dtype; a rank that never arrives makes the others fail after the group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpu.distributed.group import TPGroup

# torch 2.13 renames all_gather_into_tensor; older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Likewise reduce_scatter_tensor. gloo implements it too (torch 2.13 checked), so CPU groups
# run the real reduce-scatter as NCCL does, not an all-reduce and a slice.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Communicator:
    """all_reduce / all_gather / reduce_scatter / all_to_all of one TP group (NCCL on
    CUDA, gloo on CPU): the ranks of this rank's pipeline stage."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.rank = group.tp_rank
        self.world_size = group.tp_size
        self.device = group.device
        self._process_group = group.tp_process_group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `tensor`."""
        dist.all_reduce(tensor, group=self._process_group)
        return tensor

    def all_gather(
        self,
        tensor: torch.Tensor,  # [rows, ...] on every rank
    ) -> torch.Tensor:  # [world_size * rows, ...]: rank 0's rows, then rank 1's, ...
        tensor = tensor.contiguous()
        gathered = torch.empty(
            (self.world_size * tensor.shape[0], *tensor.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        _all_gather_single(gathered, tensor, group=self._process_group)
        return gathered

    def reduce_scatter(
        self,
        tensor: torch.Tensor,  # [world_size * rows, ...]: this rank's addends, chunk d for rank d
    ) -> torch.Tensor:  # [rows, ...]: chunk `rank` of the sum over ranks
        if tensor.shape[0] % self.world_size:
            raise ValueError(
                f"reduce_scatter needs a multiple of {self.world_size} rows, got {tensor.shape[0]}"
            )
        tensor = tensor.contiguous()
        reduced = torch.empty(
            (tensor.shape[0] // self.world_size, *tensor.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        _reduce_scatter_single(reduced, tensor, group=self._process_group)
        return reduced

    def all_to_all(
        self,
        tensor: torch.Tensor,  # [world_size * rows, ...]: chunk d goes to rank d
    ) -> torch.Tensor:  # [world_size * rows, ...]: chunk s came from rank s
        if tensor.shape[0] % self.world_size:
            raise ValueError(
                f"all_to_all needs a multiple of {self.world_size} rows, got {tensor.shape[0]}"
            )
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        dist.all_to_all_single(received, tensor, group=self._process_group)
        return received
