"""The pieces a scheduled step is built from (the batch's columns, the waiting queue) and
what a step's result did to its requests; the Scheduler (actors/scheduler.py) drives them."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from actors.kv_messages import RunningAlloc
from actors.grammar_state import PendingMask
from actors.messages import RequestFinish, StepOutput
from actors.request import Request, RequestStatus


@dataclass(slots=True, eq=False)
class PlannedRun:
    request: Request
    num_new_tokens: int
    alloc: RunningAlloc
    num_draft_slots: int = 0


Granted = tuple[PlannedRun, tuple[int, ...]]
"""A running entry that got its blocks, with the block ids appended this step."""


@dataclass(slots=True)
class StepResult:
    """What one step did to its requests, for the front ends."""

    rows: list[int] = field(default_factory=list)
    """Where in StepOutput.sampled_token_ids each kept request's tokens start (its row when
    every request sampled one token); only requests with tokens appended (live or just
    finished) are listed."""
    requests: list[Request] = field(default_factory=list)
    """The request of each of those rows."""
    num_tokens: list[int] = field(default_factory=list)
    """Tokens appended per row (1 without speculation; a stop may cut a run short)."""
    num_drafts: list[int] = field(default_factory=list)
    """Drafts verified per row (speculative steps only)."""
    finished: list[tuple[Request, RequestFinish]] = field(default_factory=list)
    """Requests this step finished: token-level stops and failures."""
    grammar_masks: list[tuple[int, PendingMask]] = field(default_factory=list)
    """Deferred grammar masks of steps in flight, ready now: (step id, mask)."""


@dataclass(slots=True)
class StepBatch:
    """The columns of a SchedulerOutput, filled in batch order."""

    request_ids: list[str]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]
    samples_token: list[bool]
    sampling_requests: dict[str, Request]
    num_draft_slots: dict[str, int] = field(default_factory=dict)
    """Speculating rows' draft slots (absent: 0)."""


class WaitingQueue:
    """Waiting and preempted requests, best first: lower priority value, then preempted
    before new, then earlier arrival, then earlier push."""

    def __init__(self) -> None:
        # Sorted ascending by the negated key, so the best request sits at the end: taking
        # it is cheap, and a new arrival (usually the worst) is inserted near the front.
        self._entries: list[tuple[tuple[int, int, float, int], Request]] = []
        self._keys: dict[int, tuple[int, int, float, int]] = {}
        self._push_seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, request: Request) -> None:
        is_new = 0 if request.status is RequestStatus.PREEMPTED else 1
        key = (-request.priority, -is_new, -request.arrival_time, -next(self._push_seq))
        self._keys[id(request)] = key
        bisect.insort(self._entries, (key, request))

    def remove(self, request: Request) -> None:
        key = self._keys.pop(id(request))
        index = bisect.bisect_left(self._entries, (key,))
        del self._entries[index]

    def best_first(self) -> Iterator[Request]:
        for index in range(len(self._entries) - 1, -1, -1):
            yield self._entries[index][1]


def schedule_tokens(batch: StepBatch, request: Request, num_new_tokens: int,
                     num_slots: int = 0) -> None:
    batch.request_ids.append(request.request_id)
    batch.num_scheduled_tokens.append(num_new_tokens)
    batch.num_computed_tokens.append(request.num_computed_tokens)
    request.num_computed_tokens += num_new_tokens - num_slots
    samples = request.num_computed_tokens >= request.num_tokens_with_placeholders
    batch.samples_token.append(samples)
    if samples:
        # A speculating row counts its draft slots as outputs and as computed (upper
        # bounds, corrected by its result: actors/spec_scheduling.py).
        request.num_computed_tokens += num_slots
        request.num_output_placeholders += 1 + num_slots
        batch.sampling_requests[request.request_id] = request
        if num_slots:
            batch.num_draft_slots[request.request_id] = num_slots


def slots_column(batch: StepBatch) -> tuple[int, ...]:
    return tuple(batch.num_draft_slots.get(request_id, 0) for request_id in batch.request_ids)


def grammar_rows(batch: StepBatch) -> list[tuple[int, Request]]:
    """(batch index, request) of the rows that sample under a grammar."""
    rows = []
    for index, request_id in enumerate(batch.request_ids):
        request = batch.sampling_requests.get(request_id)
        if request is not None and request.grammar is not None and batch.samples_token[index]:
            rows.append((index, request))
    return rows


def token_stop(request: Request, token_id: int) -> RequestFinish | None:
    if len(request.output_token_ids) >= request.sampling_params.min_tokens:
        if token_id in request.eos_token_set:
            return RequestFinish(request.request_id, "stop")
        if token_id in request.stop_token_set:
            return RequestFinish(request.request_id, "stop", stop_token_id=token_id)
    if request.num_tokens >= request.max_total_tokens:
        return RequestFinish(request.request_id, "length")
    return None


def check_tokens_are_expected(out: StepOutput, sampling: dict[str, Request]) -> None:
    """A token for a request that did not sample in the step (or two for one) is a runner
    bug: refuse the whole step before applying any of it."""
    if len(set(out.request_ids)) != len(out.request_ids) or not sampling.keys() >= set(
            out.request_ids):
        unexpected = [rid for rid in out.request_ids if rid not in sampling]
        raise ValueError(f"step output {out.step_id}: tokens for requests that did not sample "
                         f"in that step, or twice: {unexpected or list(out.request_ids)}")
