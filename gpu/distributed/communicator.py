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


class Communicator:
    """all_reduce / all_gather / all_to_all of one TP group (NCCL on CUDA, gloo on CPU):
    the ranks of this rank's pipeline stage."""

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
