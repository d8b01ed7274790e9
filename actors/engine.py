"""The engine: the actors wired together, requests in, pull-based streams out.

    add_request -> sampler actor (registers the stream) -> scheduler actor
    scheduler actor --SchedulerOutput--> GPU actor (own threads) --StepOutput--> sampler actor
    sampler actor --StepUpdate--> scheduler actor;  text --> each request's RequestStream
    scheduler actor <-> KV cache actor (one ask per step)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import structlog

from actors.gpu_actor import GPUActorV1, GPUActorV2
from actors.kv_cache_manager import KVCacheActor, KVCacheManager
from actors.kv_client import KVActorClient
from actors.messages import (
    AbortRequests,
    AddRequest,
    EngineRequest,
    RegisterRequest,
    StepStats,
)
from actors.output_stream import RequestStream
from actors.sampler import OutputProcessor, SamplerActor
from actors.scheduler import Scheduler
from actors.scheduler_actor import Drain, SchedulerActor
from actors.scheduler_config import SchedulerConfig
from actors.step_health import DEFAULT_MAX_CONSECUTIVE_FAILED_STEPS, StepFailureMonitor
from app.config import EngineConfig
from gpu.runner_v1.runner import ModelRunnerV1
from gpu.runner_v2.runner import ModelRunnerV2
from gpu.worker import ModelWorker

if TYPE_CHECKING:
    from telemetry.logging import EngineStatsLog
    from telemetry.metrics import EngineMetrics

log = structlog.get_logger("tandem.engine")

MAX_STEPS_IN_FLIGHT = {"v2": 2, "v1": 1}


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions_total: int


class Engine:
    def __init__(self, worker: ModelWorker, runner_name: str, config: EngineConfig | None = None,
                 *, metrics: EngineMetrics | None = None, stats_log: EngineStatsLog | None = None,
                 max_consecutive_failed_steps: int = DEFAULT_MAX_CONSECUTIVE_FAILED_STEPS,
                 on_dead: Callable[[str], None] | None = None) -> None:
        """`config` may narrow the worker's (scheduling limits, a smaller KV pool); the model,
        device and block size are the worker's. Without a tokenizer (dummy weights) the
        engine takes and returns token ids only. `metrics` receives every step's stats and
        every finished request's record (which then also rides on its final delta);
        `stats_log` every step's stats. Without them the step path does no telemetry.
        A failed step fails only its requests; after `max_consecutive_failed_steps` failed
        steps in a row the engine is dead: `dead_reason` is set and `on_dead` called once."""
        config = config or worker.config
        self.worker = worker
        self.config = config
        self.runner_name = runner_name
        num_blocks = min(config.num_kv_blocks or worker.kv_spec.num_blocks, worker.kv_spec.num_blocks)
        self.num_kv_blocks = num_blocks
        self.kv_actor = KVCacheActor(KVCacheManager(
            num_blocks=num_blocks, block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching))
        max_in_flight = MAX_STEPS_IN_FLIGHT[runner_name]
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=worker.max_model_len, block_size=config.block_size,
            max_steps_in_flight=max_in_flight), KVActorClient(self.kv_actor))
        self.output_processor = OutputProcessor(
            worker.tokenizer, scheduler_sink=self._to_scheduler, max_model_len=worker.max_model_len,
            on_request_finished=None if metrics is None else metrics.observe_request_finished)
        step_observers = [observer.observe_step for observer in (metrics, stats_log)
                          if observer is not None]
        self.sampler_actor = SamplerActor(self.output_processor, step_observers)
        runner_cls, gpu_actor_cls = ((ModelRunnerV2, GPUActorV2) if runner_name == "v2"
                                     else (ModelRunnerV1, GPUActorV1))
        self.step_health = StepFailureMonitor(max_consecutive_failed_steps, on_dead)
        self.gpu_actor = gpu_actor_cls(
            runner_cls(worker, config),
            on_step_output=self.step_health.wrap(self.sampler_actor.tell))
        self.scheduler_actor = SchedulerActor(
            self.scheduler, submit_step=self.gpu_actor.submit, tell_sampler=self.sampler_actor.tell,
            max_steps_in_flight=max_in_flight)
        self._stop = anyio.Event()
        self.is_running = False

    def add_request(self, request: EngineRequest) -> RequestStream:
        stream = RequestStream(request.request_id, num_prompt_tokens=len(request.prompt_token_ids))
        self.sampler_actor.tell(RegisterRequest(request, stream))
        self.scheduler_actor.tell(AddRequest(request))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.scheduler_actor.tell(AbortRequests(tuple(request_ids)))
            self._abort_outputs(request_ids)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every actor until `stop()`; then abort what is left and shut down in order."""
        async with anyio.create_task_group() as tg:
            kv_done = _start(tg, self.kv_actor.run)
            sampler_done = _start(tg, self.sampler_actor.run)
            gpu_done = _start(tg, self.gpu_actor.run)
            scheduler_done = _start(tg, self.scheduler_actor.run)
            self.is_running = True
            task_status.started()
            await self._stop.wait()
            drained = anyio.Event()
            self.scheduler_actor.tell(Drain(drained))
            await drained.wait()
            self.is_running = False
            for actor, done in ((self.scheduler_actor, scheduler_done), (self.gpu_actor, gpu_done),
                                (self.sampler_actor, sampler_done), (self.kv_actor, kv_done)):
                actor.close()
                await done.wait()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is dead (too many consecutive failed steps); None while healthy."""
        return self.step_health.dead_reason

    def stats(self) -> EngineStats:
        return EngineStats(num_running=self.scheduler.num_running,
                           num_waiting=self.scheduler.num_waiting,
                           num_preemptions_total=self.scheduler.num_preemptions_total)

    def recent_step_stats(self) -> tuple[StepStats, ...]:
        """Stats of the most recent steps, oldest first (device step time and idle gap are
        measured on V2 with CUDA)."""
        return tuple(self.gpu_actor.recent_step_stats)

    def stop(self) -> None:
        self._stop.set()

    def _to_scheduler(self, update: object) -> None:
        if self.is_running:
            self.scheduler_actor.tell(update)

    def _abort_outputs(self, request_ids: list[str]) -> None:
        if request_ids:
            self.sampler_actor.tell(AbortRequests(tuple(request_ids)))


def _start(tg: anyio.abc.TaskGroup, run: Callable[[], Awaitable[None]]) -> anyio.Event:
    done = anyio.Event()

    async def _run() -> None:
        try:
            await run()
        finally:
            done.set()

    tg.start_soon(_run)
    return done
