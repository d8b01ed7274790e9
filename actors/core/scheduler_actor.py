"""The scheduler actor: the engine core's step loop, one message at a time.

    schedule  (on_idle: as many steps as the in-flight limit allows) -> GPU actor
    launch    (the GPU actor's threads)
    collect   (StepOutput back from the GPU actor)
    update    (append tokens, decide token-level finishes, free rows and blocks) -> outputs

With two steps in flight it builds step N+1 while step N runs, counting N's decode tokens
as placeholders. Requests arrive and leave as protocol messages (EngineRequest,
AbortRequests); outputs leave through `CoreOutputs`, one message per step per front end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from actors.protocol.mailbox import Actor, ActorStopped
from actors.core.core_outputs import CoreOutputs
from actors.core.grammar_state import MaskFiller
from actors.core.kv_messages import KVUsage
from actors.protocol.messages import (
    AbortRequests,
    AdmittedRequest,
    EngineRequest,
    GrammarBitmask,
    GrammarVocab,
    RequestFinish,
    SchedulerOutput,
    SchedulerStats,
    StepOutput,
)
from actors.core.scheduler import Scheduler

log = structlog.get_logger("tandem.scheduler")
_EMPTY_KV = KVUsage(num_total_blocks=0, num_free_blocks=0, num_used_blocks=0, num_cached_blocks=0,
                    usage_perc=0.0, prefix_cache_queries_tokens=0, prefix_cache_hits_tokens=0)


@dataclass(frozen=True, slots=True)
class Drain:
    """Abort everything still queued or running; `drained` is set once no step is in flight."""

    drained: anyio.Event


@dataclass(frozen=True, slots=True)
class AbortClient:
    """Abort every request of one front end (it restarted: nobody reads them any more)."""

    client_index: int


@dataclass(frozen=True, slots=True)
class GrammarCompiled:
    """A new request's grammar has compiled (or failed to): from the compile thread."""

    request_id: str
    client_index: int
    future: Future[Any]


@dataclass(frozen=True, slots=True)
class GetStats:
    """Answered with SchedulerStats (through `ask`)."""


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, scheduler: Scheduler, submit_step: Callable[[SchedulerOutput], None],
                 outputs: CoreOutputs, max_steps_in_flight: int,
                 kv_usage: Callable[[], Awaitable[KVUsage]],
                 num_free_rows: Callable[[], int | None],
                 provide_grammar_mask: Callable[[int, GrammarBitmask | BaseException], None]
                 | None = None) -> None:
        """`provide_grammar_mask(step_id, mask)`: hands a deferred grammar mask (or why it
        could not be computed) to the runner, whose step waits for it before sampling;
        called from the mask filler's thread."""
        super().__init__()
        self.scheduler = scheduler
        self._submit_step = submit_step
        self._outputs = outputs
        self._max_steps_in_flight = max_steps_in_flight
        self._kv_usage = kv_usage
        self._num_free_rows = num_free_rows
        self._mask_filler = (None if provide_grammar_mask is None
                             else MaskFiller(provide_grammar_mask))
        self._drain_events: list[anyio.Event] = []
        self._admitted_by_step: dict[int, list[tuple[int, AdmittedRequest]]] = {}

    async def handle(self, message: object) -> object:
        if isinstance(message, StepOutput):
            self._apply_step(message)
        elif isinstance(message, EngineRequest):
            self._add_request(message)
        elif isinstance(message, AbortRequests):
            self.scheduler.abort_requests(message.request_ids)
        elif isinstance(message, GrammarCompiled):
            self._grammar_compiled(message)
        elif isinstance(message, GrammarVocab):
            self._set_grammar_vocab(message)
        elif isinstance(message, AbortClient):
            self.scheduler.abort_requests([r.request_id for r in self.scheduler.unfinished_requests()
                                           if r.client_index == message.client_index])
        elif isinstance(message, GetStats):
            # Fresh: finishes and aborts since the last step change the usage without one.
            await self.scheduler.free_finished_blocks()
            self.scheduler.kv_usage = await self._kv_usage()
            return self.stats()
        elif isinstance(message, Drain):
            self._drain_events.append(message.drained)
            self._abort_all()
        else:
            raise TypeError(f"scheduler got an unexpected message {type(message).__name__}")
        return None

    def _set_grammar_vocab(self, vocab: GrammarVocab) -> None:
        if self.scheduler.grammars is not None:
            self.scheduler.grammars.set_vocab(vocab)

    def _add_request(self, request: EngineRequest) -> None:
        try:
            compiling = self.scheduler.add_request(request)
        except ValueError as exc:  # refused here: the request's stream must still end
            log.warning("request_refused", request_id=request.request_id, error=str(exc))
            self._outputs.finish([(request.client_index,
                                   RequestFinish(request.request_id, "error", error=str(exc)))])
            return
        if compiling is not None:  # the compile thread's answer comes back as a message
            loop = asyncio.get_running_loop()
            message = GrammarCompiled(request.request_id, request.client_index, compiling)
            compiling.add_done_callback(
                lambda _: loop.call_soon_threadsafe(self._tell_unless_stopped, message))

    def _grammar_compiled(self, compiled: GrammarCompiled) -> None:
        finish = self.scheduler.grammar_compiled(compiled.request_id, compiled.future)
        if finish is not None:
            log.warning("request_refused", request_id=compiled.request_id, error=finish.error)
            self._outputs.finish([(compiled.client_index, finish)])

    def _tell_unless_stopped(self, message: object) -> None:
        try:
            self.tell(message)
        except ActorStopped:  # the engine is stopping: nobody waits for the request
            pass

    def _apply_step(self, out: StepOutput) -> None:
        prompt_clients = self._prompt_logprobs_clients(out)
        result = self.scheduler.update_from_step(out)
        for step_id, pending in result.grammar_masks:  # first: a launched step waits for it
            assert self._mask_filler is not None
            self._mask_filler.submit(step_id, pending)
        self._outputs.step(out, result, self._admitted_by_step.pop(out.step_id, ()),
                           self.stats(), prompt_clients)

    def _prompt_logprobs_clients(self, out: StepOutput) -> list[int | None]:
        """The front end of each request in the step's prompt logprobs (None: gone)."""
        if out.prompt_logprobs is None:
            return []
        requests = (self.scheduler.get_request(r) for r in out.prompt_logprobs.request_ids)
        return [None if r is None else r.client_index for r in requests]

    def _abort_all(self) -> None:
        requests = self.scheduler.unfinished_requests()
        self.scheduler.abort_requests([r.request_id for r in requests])
        self._outputs.finish([(r.client_index, RequestFinish(r.request_id, "abort"))
                              for r in requests])

    def _record_admissions(self, sched: SchedulerOutput) -> None:
        """Remember the prefix-cache hit and queue timeline of each request this step admits
        for the first time (a resumed request was reported already); they travel with the
        step's outputs."""
        admitted = []
        for new in sched.new_requests:
            request = self.scheduler.get_request(new.request_id)
            if request is None or request.num_preemptions or request.first_scheduled_time is None:
                continue
            admitted.append((request.client_index, AdmittedRequest(
                new.request_id, max(request.num_cached_tokens, 0), request.queued_time,
                request.first_scheduled_time)))
        if admitted:
            self._admitted_by_step[sched.step_id] = admitted

    def stats(self) -> SchedulerStats:
        """The core's load now and the KV usage after the latest step's allocation."""
        scheduler = self.scheduler
        kv = scheduler.kv_usage or _EMPTY_KV
        return SchedulerStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_preemptions_total=scheduler.num_preemptions_total,
            num_total_kv_blocks=kv.num_total_blocks, num_free_kv_blocks=kv.num_free_blocks,
            kv_usage_perc=kv.usage_perc,
            prefix_cache_queries_tokens=kv.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=kv.prefix_cache_hits_tokens,
            num_free_rows=self._num_free_rows())

    async def on_stop(self) -> None:
        if self._mask_filler is not None:
            self._mask_filler.close()

    async def on_idle(self) -> None:
        while self.scheduler.num_steps_in_flight < self._max_steps_in_flight:
            sched = await self.scheduler.schedule()
            if sched is None:
                break
            self._record_admissions(sched)
            self._submit_step(sched)
        if self._drain_events and self.scheduler.num_steps_in_flight == 0:
            for event in self._drain_events:
                event.set()
            self._drain_events.clear()
