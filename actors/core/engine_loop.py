"""The engine loop: the engine core's one loop, as a recipe.

    while running:
        take the mailbox's messages       (requests, aborts, compiled grammars, ...)
        schedule -> launch                (while fewer steps are in flight than the runner
                                           keeps: 2 for V2, so step N+1 is built and
                                           launched while step N runs; 1 for V1)
        collect the oldest step           (its outputs, once the GPU actor has them)
          -> update                       (tokens appended, token-level finishes decided)
          -> publish                      (one EngineCoreOutputs per front end)
        or wait for a message or the oldest step's outputs

The loop owns the scheduler (and through it the KV cache manager and the grammar state);
the GPU actor runs the steps on threads of its own, so the loop never waits for the
device while there is anything else to do.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Future
from typing import Any, assert_never

import anyio
import structlog

from actors.core.core_outputs import CoreOutputs
from actors.core.gpu_actor import GPUActor
from actors.core.grammar_state import MaskFiller
from actors.core.scheduler import Scheduler
from actors.core.step_batch import StepResult
from actors.core.step_health import StepFailureMonitor
from actors.protocol.mailbox import Actor, ActorStopped
from actors.protocol.messages import (
    AbortClient,
    AbortRequests,
    AdmittedRequest,
    CheckKVInvariants,
    CoreLoad,
    Drain,
    EngineRequest,
    GetSchedulerStats,
    GrammarCompiled,
    GrammarVocab,
    PrefixCacheReset,
    RequestFinish,
    ResetPrefixCache,
    SchedulerOutput,
    SchedulerStats,
    StepOutput,
    ToEngineLoop,
)

log = structlog.get_logger("tandem.engine_loop")
InFlight = deque[tuple[SchedulerOutput, asyncio.Future[StepOutput]]]


class EngineLoop(Actor[ToEngineLoop]):
    name = "engine_loop"

    def __init__(
        self,
        scheduler: Scheduler,
        gpu: GPUActor,
        outputs: CoreOutputs,
        step_health: StepFailureMonitor,
    ) -> None:
        super().__init__()
        self.scheduler = scheduler
        self._gpu = gpu
        self._outputs = outputs
        self._step_health = step_health
        self._mask_filler = MaskFiller(gpu.runner.deferred_masks.provide)
        self._admitted_by_step: dict[int, list[tuple[int, AdmittedRequest]]] = {}
        self._drain_events: list[anyio.Event] = []
        self._wake = anyio.Event()
        self._num_received: dict[int, int] = {}
        """Requests taken in per front end (CoreLoad.num_received)."""

    def _notify(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        in_flight: InFlight = deque()
        self._wake_on_disk_reads()
        try:
            async with self._recv:
                while True:
                    self._wake = anyio.Event()
                    if await self._drain_ready():
                        self._launch_steps(in_flight)
                    elif not in_flight:
                        return  # closed, and every step's outputs published
                    if in_flight and in_flight[0][1].done():
                        self._finish_step(in_flight.popleft()[1].result())
                        continue
                    self._release_drains(in_flight)
                    await self._wake.wait()
        finally:
            self._mask_filler.close()

    def _wake_on_disk_reads(self) -> None:
        """A waiting request whose blocks are read from disk may run once a read ends: the
        disk store's reader thread wakes the loop (which never waits for a read)."""
        offload = self.scheduler.kv.offload
        if offload is None:
            return
        loop = asyncio.get_running_loop()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(self._notify)
            except RuntimeError:  # the loop is closed: the engine has stopped
                pass

        offload.on_read_done = wake

    # ---- the recipe's steps ---------------------------------------------------------------

    def _launch_steps(self, in_flight: InFlight) -> None:
        """Schedule -> launch, while the runner may keep another step in flight."""
        while len(in_flight) < self._gpu.max_steps_in_flight:
            sched = self.scheduler.schedule()
            if sched is None:
                return
            self._record_admissions(sched)
            done = self._gpu.launch(sched)
            done.add_done_callback(lambda _: self._wake.set())
            in_flight.append((sched, done))

    def _finish_step(self, out: StepOutput) -> None:
        """The oldest step's outputs -> update -> publish."""
        self._step_health.observe(out)
        prompt_clients = self._prompt_logprobs_clients(out)
        result = self.scheduler.update_from_step(out)
        self._fill_ready_masks(result)
        self._outputs.step(
            out,
            result,
            self._admitted_by_step.pop(out.step_id, ()),
            self.stats(),
            prompt_clients,
            self.load,
        )

    def _release_drains(self, in_flight: InFlight) -> None:
        if self._drain_events and not in_flight:
            for event in self._drain_events:
                event.set()
            self._drain_events.clear()

    # ---- messages -------------------------------------------------------------------------

    async def handle(self, message: ToEngineLoop) -> object:
        match message:
            case EngineRequest():
                self._add_request(message)
            case AbortRequests():
                self.scheduler.abort_requests(message.request_ids)
            case GrammarVocab():
                if self.scheduler.grammars is not None:
                    self.scheduler.grammars.set_vocab(message)
            case GrammarCompiled():
                self._grammar_compiled(message)
            case AbortClient():
                self._abort_client(message.client_index)
            case GetSchedulerStats():
                self.scheduler.free_finished_blocks()  # finishes since the last step count
                self.scheduler.kv_usage = self.scheduler.kv.stats()
                return self.stats()
            case CheckKVInvariants():
                self.scheduler.kv.check_invariants()
            case ResetPrefixCache():
                return self._reset_prefix_cache()
            case Drain():
                self._drain_events.append(message.drained)
                self._abort_all()
            case _:
                assert_never(message)
        return None

    def _reset_prefix_cache(self) -> PrefixCacheReset:
        scheduler = self.scheduler
        scheduler.free_finished_blocks()  # a finished request's blocks are not in use
        num_dropped_blocks = scheduler.kv.reset_prefix_cache()
        num_dropped_offloaded = scheduler.kv.reset_offload_tiers()
        scheduler.kv_usage = scheduler.kv.stats()
        log.info(
            "prefix_cache_reset",
            num_dropped_blocks=num_dropped_blocks,
            num_dropped_offloaded_blocks=num_dropped_offloaded,
        )
        return PrefixCacheReset(
            num_dropped_blocks, scheduler.kv_usage.num_cached_blocks, num_dropped_offloaded
        )

    def _abort_client(self, client_index: int) -> None:
        self._num_received[client_index] = 0  # a new process: it counts its sends from 0
        orphans = [
            r.request_id
            for r in self.scheduler.unfinished_requests()
            if r.client_index == client_index
        ]
        if not orphans:
            return
        self.scheduler.abort_requests(orphans)
        log.warning(
            "front_end_restarted_requests_aborted",
            client_index=client_index,
            num_requests=len(orphans),
        )
        self._outputs.predecessor_aborted(client_index, len(orphans))

    def _add_request(self, request: EngineRequest) -> None:
        client = request.client_index
        self._num_received[client] = self._num_received.get(client, 0) + 1
        try:
            compiling = self.scheduler.add_request(request)
        except ValueError as exc:  # refused here: the request's stream must still end
            log.warning("request_refused", request_id=request.request_id, error=str(exc))
            self._outputs.finish(
                [(request.client_index, RequestFinish(request.request_id, "error", error=str(exc)))]
            )
            return
        if compiling is not None:  # the compile thread's answer comes back as a message
            self._when_compiled(
                compiling, GrammarCompiled(request.request_id, request.client_index, compiling)
            )

    def _when_compiled(self, compiling: Future[Any], message: GrammarCompiled) -> None:
        loop = asyncio.get_running_loop()

        def tell_unless_stopped() -> None:
            try:
                self.tell(message)
            except ActorStopped:  # the engine is stopping: nobody waits for the request
                pass

        compiling.add_done_callback(lambda _: loop.call_soon_threadsafe(tell_unless_stopped))

    def _grammar_compiled(self, compiled: GrammarCompiled) -> None:
        finish = self.scheduler.grammar_compiled(compiled.request_id, compiled.compiled)
        if finish is not None:
            log.warning("request_refused", request_id=compiled.request_id, error=finish.error)
            self._outputs.finish([(compiled.client_index, finish)])

    def _abort_all(self) -> None:
        requests = self.scheduler.unfinished_requests()
        self.scheduler.abort_requests([r.request_id for r in requests])
        self._outputs.finish(
            [(r.client_index, RequestFinish(r.request_id, "abort")) for r in requests]
        )

    # ---- what a step's outputs carry ------------------------------------------------------

    def _fill_ready_masks(self, result: StepResult) -> None:
        """Deferred grammar masks the step's tokens made exact: first, since a launched step
        waits for its mask."""
        for step_id, pending in result.grammar_masks:
            self._mask_filler.submit(step_id, pending)

    def _prompt_logprobs_clients(self, out: StepOutput) -> list[int | None]:
        """The front end of each request in the step's prompt logprobs (None: gone)."""
        if out.prompt_logprobs is None:
            return []
        requests = (self.scheduler.get_request(r) for r in out.prompt_logprobs.request_ids)
        return [None if r is None else r.client_index for r in requests]

    def _record_admissions(self, sched: SchedulerOutput) -> None:
        """Remember the prefix-cache hit and queue timeline of each request this step admits
        for the first time (a resumed request was reported already); they travel with the
        step's outputs."""
        admitted = []
        for new in sched.new_requests:
            request = self.scheduler.get_request(new.request_id)
            if request is None or request.num_preemptions or request.first_scheduled_time is None:
                continue
            admitted.append(
                (
                    request.client_index,
                    AdmittedRequest(
                        new.request_id,
                        max(request.num_cached_tokens, 0),
                        request.queued_time,
                        request.first_scheduled_time,
                    ),
                )
            )
        if admitted:
            self._admitted_by_step[sched.step_id] = admitted

    def load(self, client_index: int) -> CoreLoad:
        """The core's load now, as told to one front end (read on the core's event loop)."""
        scheduler = self.scheduler
        return CoreLoad(
            scheduler.num_running,
            scheduler.num_waiting,
            self._num_received.get(client_index, 0),
        )

    def stats(self) -> SchedulerStats:
        """The core's load now and the KV usage after the latest step's allocation."""
        scheduler = self.scheduler
        kv = scheduler.kv_usage or scheduler.kv.stats()
        return SchedulerStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_preemptions_total=scheduler.num_preemptions_total,
            num_total_kv_blocks=kv.num_total_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            kv_usage_perc=kv.usage_perc,
            prefix_cache_queries_tokens=kv.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=kv.prefix_cache_hits_tokens,
            num_free_rows=self._gpu.runner.num_free_rows,
            kv_tiers=kv.kv_tiers,
        )
