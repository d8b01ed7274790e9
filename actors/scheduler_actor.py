"""The scheduler actor: owns the Scheduler and keeps up to N steps in flight.

After every burst of messages (arrivals, aborts, step results) it schedules as many steps
as the in-flight limit allows and hands them to the GPU actor. With two steps in flight it
builds step N+1 while step N runs, counting N's decode tokens as placeholders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio
import structlog

from actors.base import Actor
from actors.messages import (
    AbortRequests,
    AddRequest,
    AdmittedRequest,
    FinishRequests,
    RequestsAdmitted,
    SchedulerOutput,
    StepUpdate,
)
from actors.request import Request, RequestStatus
from actors.scheduler import Scheduler

log = structlog.get_logger("tandem.scheduler")


@dataclass(frozen=True, slots=True)
class Drain:
    """Abort everything still queued or running; `drained` is set once no step is in flight."""

    drained: anyio.Event


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, scheduler: Scheduler, submit_step: Callable[[SchedulerOutput], None],
                 tell_sampler: Callable[[object], None], max_steps_in_flight: int) -> None:
        super().__init__()
        self.scheduler = scheduler
        self._submit_step = submit_step
        self._tell_sampler = tell_sampler
        self._max_steps_in_flight = max_steps_in_flight
        self._drain_events: list[anyio.Event] = []

    async def handle(self, message: object) -> None:
        if isinstance(message, StepUpdate):
            self._apply_step_update(message)
        elif isinstance(message, AddRequest):
            self._add_request(message)
        elif isinstance(message, AbortRequests):
            self.scheduler.abort_requests(list(message.request_ids))
        elif isinstance(message, Drain):
            self._drain_events.append(message.drained)
            aborted = self.scheduler.abort_requests(self.scheduler.unfinished_request_ids())
            if aborted:
                self._tell_sampler(FinishRequests(tuple((r, "abort") for r in aborted)))
        else:
            raise TypeError(f"scheduler got an unexpected message {type(message).__name__}")

    def _add_request(self, message: AddRequest) -> None:
        try:
            self.scheduler.add_request(message.request)
        except ValueError as exc:  # refused here: the request's stream must still end
            log.warning("request_refused", request_id=message.request.request_id, error=str(exc))
            self._tell_sampler(FinishRequests(((message.request.request_id, "error"),), str(exc)))

    def _apply_step_update(self, update: StepUpdate) -> None:
        finished = self.scheduler.update_from_step(update)
        # Finishes the sampler did not decide (safety nets) must still close their streams.
        unreported = tuple((r.request_id, _finish_reason(r)) for r in finished
                           if r.request_id not in update.finished)
        if unreported:
            self._tell_sampler(FinishRequests(unreported))

    def _report_admissions(self, sched: SchedulerOutput) -> None:
        """Tell the sampler the prefix-cache hit and queue timeline of each request this
        step admits for the first time (a resumed request was reported already)."""
        admitted = []
        for new in sched.new_requests:
            request = self.scheduler.get_request(new.request_id)
            if request is None or request.num_preemptions or request.first_scheduled_time is None:
                continue
            admitted.append(AdmittedRequest(new.request_id, max(request.num_cached_tokens, 0),
                                            request.queued_time, request.first_scheduled_time))
        if admitted:
            self._tell_sampler(RequestsAdmitted(tuple(admitted)))

    async def on_idle(self) -> None:
        while self.scheduler.num_steps_in_flight < self._max_steps_in_flight:
            sched = await self.scheduler.schedule()
            if sched is None:
                break
            self._submit_step(sched)
            self._report_admissions(sched)
        if self._drain_events and self.scheduler.num_steps_in_flight == 0:
            for event in self._drain_events:
                event.set()
            self._drain_events.clear()


def _finish_reason(request: Request) -> str:
    return _FINISH_REASONS.get(request.status, "error")


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}
