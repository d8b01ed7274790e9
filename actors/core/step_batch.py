"""The pieces a scheduled step is built from (the batch's columns, the waiting queue) and
what a step's result did to its requests; the Scheduler (actors/core/scheduler.py) drives them."""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from actors.core.grammar_state import GrammarState, PendingMask
from actors.core.kv_allocation import RunningAllocs
from actors.core.kv_cache_manager import KVCacheManager
from actors.core.request import Request, RequestStatus
from actors.core.spec_scheduling import correct_after_step, start_speculating
from actors.protocol.messages import RequestFinish, StepOutput


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


@dataclass(slots=True, eq=False)
class StepBatch:
    """A step's rows as columns, in batch order: the running requests first (planned before
    the KV allocation, so preemption may drop some), then the requests admitted from the
    queue. No request changes until `start_rows` commits the step."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    """Each row's computed tokens before the step."""
    num_draft_slots: list[int] = field(default_factory=list)
    """Of the scheduled tokens, the draft slots after the row's last token (speculation)."""
    samples_token: list[bool] = field(default_factory=list)
    new_block_ids: list[tuple[int, ...]] = field(default_factory=list)
    """Blocks the step's allocation appends to the row's table (running rows)."""

    def add(
        self,
        request: Request,
        num_new_tokens: int,
        num_draft_slots: int = 0,
        num_known_tokens: int | None = None,
    ) -> None:
        """Run `num_new_tokens` of `request` from its computed tokens, the last
        `num_draft_slots` of them draft slots. The row samples when it reaches the end of
        the request's known-or-placeholder tokens (`num_known_tokens`, if the caller has
        them at hand)."""
        if num_known_tokens is None:
            num_known_tokens = request.num_tokens_with_placeholders
        num_computed = request.num_computed_tokens
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_new_tokens)
        self.num_computed_tokens.append(num_computed)
        self.num_draft_slots.append(num_draft_slots)
        self.samples_token.append(
            num_computed + num_new_tokens - num_draft_slots >= num_known_tokens
        )
        self.new_block_ids.append(())

    def __len__(self) -> int:
        return len(self.requests)

    def request_ids(self) -> list[str]:
        return [request.request_id for request in self.requests]

    def running_allocs(self) -> RunningAllocs:
        """The KV each row's blocks must hold once the step ran."""
        return RunningAllocs(
            tuple(self.request_ids()),
            tuple(map(operator.add, self.num_computed_tokens, self.num_scheduled_tokens)),
        )

    def set_new_block_ids(self, new_block_ids: Sequence[tuple[int, ...]]) -> None:
        """The blocks an allocation granted to the first len(new_block_ids) rows."""
        self.new_block_ids[: len(new_block_ids)] = new_block_ids

    def rows(self, start: int, stop: int) -> StepBatch:
        return StepBatch(*(column[start:stop] for column in self._columns()))

    def without(self, request: Request) -> StepBatch:
        """The rows of every request but `request` (one just preempted)."""
        keep = [
            index for index, row_request in enumerate(self.requests) if row_request is not request
        ]
        return StepBatch(*([column[index] for index in keep] for column in self._columns()))

    def joined(self, other: StepBatch) -> StepBatch:
        if not self:
            return other
        return StepBatch(
            *(mine + theirs for mine, theirs in zip(self._columns(), other._columns()))
        )

    def _columns(self) -> tuple[list, ...]:
        return (
            self.requests,
            self.num_scheduled_tokens,
            self.num_computed_tokens,
            self.num_draft_slots,
            self.samples_token,
            self.new_block_ids,
        )


def start_rows(batch: StepBatch) -> tuple[dict[str, Request], dict[str, int]]:
    """Commit the step in its requests: each row's new blocks and scheduled tokens, and an
    output placeholder per sampling row. Returns the sampling rows' requests and the draft
    slots of those that speculate, by request id."""
    sampling: dict[str, Request] = {}
    draft_slots: dict[str, int] = {}
    for request, num_new, num_slots, samples, new_block_ids in zip(
        batch.requests,
        batch.num_scheduled_tokens,
        batch.num_draft_slots,
        batch.samples_token,
        batch.new_block_ids,
    ):
        if new_block_ids:
            request.block_ids.extend(new_block_ids)
        # A speculating row counts its draft slots as outputs and as computed (upper
        # bounds, corrected by its result: actors/core/spec_scheduling.py).
        request.num_computed_tokens += num_new
        if samples:
            request.num_output_placeholders += 1 + num_slots
            sampling[request.request_id] = request
            if num_slots:
                draft_slots[request.request_id] = num_slots
                start_speculating(request)
    return sampling, draft_slots


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


def grammar_rows(batch: StepBatch) -> list[tuple[int, Request]]:
    """(batch index, request) of the rows that sample under a grammar."""
    return [
        (index, request)
        for index, (request, samples) in enumerate(zip(batch.requests, batch.samples_token))
        if samples and request.grammar is not None
    ]


def append_one_each(
    requests: list[Request], token_ids: list[int], result: StepResult
) -> list[tuple[Request, RequestFinish]]:
    """Apply a step without speculation (one token per request: requests[i] sampled
    token_ids[i]) to `result`; returns the requests its tokens finish, with their finish."""
    finished = []
    for row, (request, token_id) in enumerate(zip(requests, token_ids)):
        if request.is_finished:
            continue  # aborted while the step ran
        request.output_token_ids.append(token_id)
        request.num_output_placeholders -= 1
        result.rows.append(row)
        finish = token_finish(request, token_id)
        if finish is not None:
            finished.append((request, finish))
    result.requests = [requests[row] for row in result.rows]
    result.num_tokens = [1] * len(result.rows)
    return finished


def append_runs(
    out: StepOutput,
    requests: list[Request],
    token_ids: list[int],
    counts: list[int],
    draft_slots: dict[str, int],
    next_step_id: int,
    result: StepResult,
) -> list[tuple[Request, RequestFinish]]:
    """Apply a speculative step (requests[i] emitted a run of counts[i] tokens) to
    `result`, each run up to its first stop; returns the requests it finishes, with their
    finish. `next_step_id`: the next step the scheduler will build."""
    num_drafts = None if out.num_draft_tokens is None else out.num_draft_tokens.tolist()
    finished = []
    start = 0
    for row, (request, count) in enumerate(zip(requests, counts)):
        if not request.is_finished:  # else aborted while the step ran
            num_kept, finish = _append_run(request, token_ids[start : start + count])
            correct_after_step(request, draft_slots.get(request.request_id, 0), count, next_step_id)
            result.rows.append(start)
            result.requests.append(request)
            result.num_tokens.append(num_kept)
            if num_drafts is not None:
                result.num_drafts.append(num_drafts[row])
            if finish is not None:
                finished.append((request, finish))
        start += count
    return finished


def _append_run(request: Request, tokens: list[int]) -> tuple[int, RequestFinish | None]:
    """Append `tokens` up to the first that finishes the request: (tokens kept, finish)."""
    for num_kept, token_id in enumerate(tokens, 1):
        request.output_token_ids.append(token_id)
        finish = token_finish(request, token_id)
        if finish is not None:
            return num_kept, finish
    return len(tokens), None


def token_finish(request: Request, token_id: int) -> RequestFinish | None:
    """What the token just appended to `request`'s outputs finishes: a token-level stop,
    else the request's grammar, which sees every token (grammar rows never speculate)."""
    if token_id in request.stop_tokens and len(request.output_token_ids) >= request.min_tokens:
        return RequestFinish(
            request.request_id, "stop", stop_token_id=request.stop_tokens[token_id]
        )
    if request.num_tokens >= request.max_total_tokens:
        return RequestFinish(request.request_id, "length")
    if request.grammar is not None:
        return GrammarState.advance(request, token_id)
    return None


def offer_completed_blocks(kv: KVCacheManager, result: StepResult) -> None:
    """Offer the blocks a step's tokens completed to the prefix cache: `kv` publishes those
    whose KV is computed or in a step already built. Only rows whose known tokens crossed a
    block boundary ask (adding n tokens to reach t crosses one exactly when
    t % block_size < n). A row preempted while its step ran restarts from 0 computed
    tokens: it offers nothing now, and hashes its outputs when it is admitted again."""
    block_size = kv.block_size
    running = RequestStatus.RUNNING
    for request, num_new in zip(result.requests, result.num_tokens):
        # Per row per step: the sum is Request.num_tokens without the property's call.
        num_tokens = request.num_prompt_tokens + len(request.output_token_ids)
        if num_tokens % block_size < num_new and request.status is running:
            kv.cache_blocks(
                request.request_id,
                request.prompt_token_ids,
                request.output_token_ids,
                request.num_computed_tokens,
            )


def check_tokens_are_expected(out: StepOutput, sampling: dict[str, Request]) -> None:
    """A token for a request that did not sample in the step (or two for one) is a runner
    bug: refuse the whole step before applying any of it."""
    request_ids = set(out.request_ids)
    if len(request_ids) != len(out.request_ids) or not sampling.keys() >= request_ids:
        unexpected = [rid for rid in out.request_ids if rid not in sampling]
        raise ValueError(
            f"step output {out.step_id}: tokens for requests that did not sample "
            f"in that step, or twice: {unexpected or list(out.request_ids)}"
        )
