"""Sampled tokens that reach a first pipeline stage after its step has moved on.

Under pipeline parallelism a V2 step's tokens are sampled on the last stage, while the
first stage has already launched the next group's step (gpu/distributed/pipeline.py). So
the first stage runs `post_update` at launch with placeholder tokens: the row counters
(computed tokens, length) are right at once, as later steps need them, and only the
sampled token itself (its slot in the token history and `last_sampled`) is written in
when the step's table arrives. That happens before any later step that names one of the
step's sampling requests (the scheduler runs them again only once their token is known)
or frees their rows, so no step ever reads a placeholder.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from actors.protocol.messages import SchedulerOutput
from gpu.distributed.pipeline import SampledReceipt
from gpu.runner_v2.states import RequestStates


@dataclass(frozen=True, slots=True)
class _PendingTokens:
    receipt: SampledReceipt
    rows: torch.Tensor  # [num_reqs] int64, the step's request rows
    slots: torch.Tensor  # [num_reqs] int64, where each row's token went in the history
    stored: torch.Tensor  # [num_reqs] bool, the row sampled and its slot is in the history
    sampled: torch.Tensor  # [num_reqs] bool, the row sampled
    request_ids: frozenset[str]
    """The step's requests that sample."""


class ReceivedTokens:
    """The first stage's steps whose tokens have not been written in yet, oldest first."""

    def __init__(self, states: RequestStates) -> None:
        self._states = states
        self._pending: deque[_PendingTokens] = deque()

    def length_before(self, rows: torch.Tensor) -> torch.Tensor:  # [num_reqs] int32
        """The rows' lengths before `post_update` (`record`'s `length_before`)."""
        return self._states.total_len_gpu[rows].clone()

    def placeholders(self, num_reqs: int) -> torch.Tensor:  # [num_reqs] int64
        """The tokens `post_update` writes until the real ones arrive."""
        return torch.zeros(num_reqs, dtype=torch.int64, device=self._states.device)

    def record(
        self,
        receipt: SampledReceipt,
        rows: torch.Tensor,  # [num_reqs] int32
        length_before: torch.Tensor,  # [num_reqs] int32, from `length_before`
        sched: SchedulerOutput,
    ) -> None:
        """A step whose `post_update` just ran with placeholder tokens."""
        states = self._states
        sampling = (r for r, s in zip(sched.scheduled_request_ids, sched.samples_token) if s)
        rows = rows.long()
        sampled = states.total_len_gpu[rows] > length_before
        max_len = states.token_ids_gpu.shape[1]
        self._pending.append(
            _PendingTokens(
                receipt,
                rows,
                length_before.long().clamp(max=max_len - 1),
                sampled & (length_before < max_len),
                sampled,
                frozenset(sampling),
            )
        )

    def write_before(self, request_ids: Iterable[str]) -> None:
        """Write in every pending step's tokens up to the newest one that names any of
        `request_ids` (a step about to run or free them)."""
        wanted = set(request_ids)
        last = -1
        for index, pending in enumerate(self._pending):
            if not wanted.isdisjoint(pending.request_ids):
                last = index
        for _ in range(last + 1):
            self._write(self._pending.popleft())

    def clear(self) -> None:
        """Forget the pending steps (the runner closes; the next one resets every row)."""
        self._pending.clear()

    def _write(self, pending: _PendingTokens) -> None:
        tokens = pending.receipt.on_device().sampled_token_ids  # [num_reqs] int64
        history = self._states.token_ids_gpu
        rows, slots = pending.rows, pending.slots
        tokens_in_history = tokens.to(history.dtype)
        history[rows, slots] = torch.where(pending.stored, tokens_in_history, history[rows, slots])
        last = self._states.last_sampled_gpu
        last[rows] = torch.where(pending.sampled, tokens, last[rows])
