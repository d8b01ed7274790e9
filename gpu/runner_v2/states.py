"""The V2 row table: one fixed row of device state per request for its whole life.

A row is taken from a free list when a request enters the runner (new or resumed after a
preemption) and returned when it finishes or is preempted. Nothing is ever reordered:
each step gathers through `idx_mapping` (batch position -> row).

    token_ids_gpu        [R, L]  prompt + outputs; post_update appends sampled tokens
    num_computed_gpu     [R]     tokens whose KV is in the cache; advanced by post_update
    total_len_gpu        [R]     tokens in token_ids_gpu
    prompt_len_gpu       [R]     user prompt length (outputs = total_len - prompt_len)
    last_sampled_gpu     [R]     most recent sampled token
    block_table_gpu      [R, MB] KV block ids
"""

from __future__ import annotations

import numpy as np
import torch

from actors.protocol.messages import NewRequestData
from kernels.staged_write import StagedWrites


class RequestStates:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        self.token_ids_gpu = torch.zeros(
            max_num_reqs, max_model_len, dtype=torch.int32, device=device
        )
        self.num_computed_gpu = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.total_len_gpu = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.prompt_len_gpu = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.last_sampled_gpu = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.block_table_gpu = torch.zeros(
            max_num_reqs, max_blocks_per_req, dtype=torch.int32, device=device
        )
        self.num_blocks_np = np.zeros(max_num_reqs, dtype=np.int64)
        self._token_writes = StagedWrites(pin_memory=device.type == "cuda")
        self._block_writes = StagedWrites(pin_memory=device.type == "cuda")
        self._new_rows: list[int] = []
        self._new_scalars: list[tuple[int, int, int]] = []  # (computed, total_len, prompt_len)

    def reset(self, num_rows: int) -> None:
        """Forget every request and offer rows [0, num_rows) again. Device tensors keep
        their contents: a row is rewritten in full when a request takes it."""
        if not 0 < num_rows <= self.max_num_reqs:
            raise ValueError(f"num_rows must be in [1, {self.max_num_reqs}], got {num_rows}")
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.row_of.clear()
        self.num_blocks_np[:] = 0
        self._token_writes.clear()
        self._block_writes.clear()
        self._new_rows.clear()
        self._new_scalars.clear()

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def add(self, new: NewRequestData) -> int:
        if new.request_id in self.row_of:  # a re-add replaces the stale row
            self.remove(new.request_id)
        row = self._free_rows.pop()
        self.row_of[new.request_id] = row
        self._token_writes.stage(row, 0, np.asarray(new.token_ids, dtype=np.int32))
        self._block_writes.stage(row, 0, np.asarray(new.block_ids, dtype=np.int32))
        self.num_blocks_np[row] = len(new.block_ids)
        self._new_rows.append(row)
        self._new_scalars.append((new.num_computed_tokens, len(new.token_ids), new.prompt_len))
        return row

    def append_blocks(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        if not block_ids:
            return
        row = self.row_of[request_id]
        self._block_writes.stage(
            row, int(self.num_blocks_np[row]), np.asarray(block_ids, dtype=np.int32)
        )
        self.num_blocks_np[row] += len(block_ids)

    def remove(self, request_id: str) -> int | None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
        return row

    def apply_staged(self) -> None:
        """Ship this step's row edits to the device: one launch per tensor."""
        if self._new_rows:
            rows = _to_device(np.asarray(self._new_rows, dtype=np.int64), self.device)
            scalars = _to_device(np.asarray(self._new_scalars, dtype=np.int32), self.device)
            self.num_computed_gpu[rows] = scalars[:, 0]
            self.total_len_gpu[rows] = scalars[:, 1]
            self.prompt_len_gpu[rows] = scalars[:, 2]
            self._new_rows.clear()
            self._new_scalars.clear()
        self._token_writes.apply(self.token_ids_gpu)
        self._block_writes.apply(self.block_table_gpu)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        # A fresh pinned copy per transfer: the CPU never rewrites memory an in-flight
        # copy may still read.
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
