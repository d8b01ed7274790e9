"""The engine core: the scheduler, KV cache manager and GPU actors behind one protocol
endpoint. No HTTP, no tokenizer: token ids in, token ids out.

    endpoint --EngineRequest/AbortRequests--> scheduler actor <-> KV cache actor
    scheduler actor --SchedulerOutput--> GPU actor (own threads) --StepOutput--> scheduler actor
    scheduler actor --EngineCoreOutputs (one per step per front end)--> endpoint

It runs in its own process under `tandem serve` (actors/core/engine_core_proc.py) and on the
caller's event loop for the offline `LLM` and the tests (an in-process endpoint).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from actors.protocol.mailbox import ActorStopped
from actors.protocol.config import EngineConfig
from actors.core.core_outputs import CoreOutputs
from actors.core.gpu_actor import GPUActorV1, GPUActorV2
from actors.core.grammar_state import GrammarState
from actors.core.kv_cache_manager import KVCacheActor, KVCacheManager
from actors.core.kv_client import KVActorClient
from actors.core.kv_messages import CheckInvariants, KVStats
from actors.protocol.messages import (
    AbortRequests,
    ClientHello,
    EngineCoreOutputs,
    EngineDead,
    EngineReady,
    EngineRequest,
    GrammarVocab,
    Shutdown,
    ToFrontEnd,
    UtilityCall,
    UtilityResult,
)
from actors.core.scheduler import Scheduler
from actors.core.scheduler_actor import AbortClient, Drain, GetStats, SchedulerActor
from actors.core.scheduler_config import SchedulerConfig
from actors.core.step_health import DEFAULT_MAX_CONSECUTIVE_FAILED_STEPS, StepFailureMonitor
from actors.protocol.transport import CoreEndpoint, TransportClosed
from actors.core.warmup import WARMUP_CLIENT, warmup_requests
from gpu.distributed.tp_engine import TPRunnerV2
from gpu.runner_v1.runner import ModelRunnerV1
from gpu.runner_v2.runner import ModelRunnerV2
from gpu.sampling.grammar_mask import mask_buffer_allocator
from gpu.worker import ModelWorker
from telemetry.logging import log_startup

log = structlog.get_logger("tandem.engine_core")

MAX_STEPS_IN_FLIGHT = {"v2": 2, "v1": 1}
_WARMUP_TIMEOUT_S = 600.0


class EngineCore:
    def __init__(self, worker: ModelWorker, runner: Any, endpoint: CoreEndpoint,
                 config: EngineConfig | None = None, *,
                 max_consecutive_failed_steps: int = DEFAULT_MAX_CONSECUTIVE_FAILED_STEPS,
                 started_at: float | None = None, known_clients: set[int] | None = None) -> None:
        """`runner`: the gpu.runner_selection.RunnerChoice. `config` may narrow the
        worker's (scheduling limits, a smaller KV pool); the model, device and block size
        are the worker's. After `max_consecutive_failed_steps` failed steps in a row the
        core is dead: every front end hears EngineDead. `known_clients`: front ends that
        said hello before the core was built (while the model loaded)."""
        config = config or worker.config
        self.worker, self.config, self.runner_choice = worker, config, runner
        self.endpoint = endpoint
        self._started_at = time.perf_counter() if started_at is None else started_at
        self.num_kv_blocks = min(config.num_kv_blocks or worker.kv_spec.num_blocks,
                                 worker.kv_spec.num_blocks)
        self.kv_actor = KVCacheActor(KVCacheManager(
            num_blocks=self.num_kv_blocks, block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching))
        max_in_flight = MAX_STEPS_IN_FLIGHT[runner.runner]
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=worker.max_model_len, block_size=config.block_size,
            max_steps_in_flight=max_in_flight,
            num_speculative_tokens=(0 if config.speculative_config is None
                                    else config.speculative_config.num_speculative_tokens)),
            KVActorClient(self.kv_actor), GrammarState(
                worker.model_config.vocab_size, max_in_flight,
                allocate_buffer=mask_buffer_allocator(worker.device)))
        tp_leader = getattr(worker, "tp_leader", None)
        v2_runner_cls = ModelRunnerV2 if tp_leader is None else TPRunnerV2
        runner_cls, gpu_actor_cls = ((v2_runner_cls, GPUActorV2) if runner.runner == "v2"
                                     else (ModelRunnerV1, GPUActorV1))
        self.step_health = StepFailureMonitor(max_consecutive_failed_steps, self._on_dead)
        if tp_leader is not None:  # a failed rank kills the engine at once, even when idle
            loop = asyncio.get_running_loop()
            tp_leader.on_failure(lambda reason: loop.call_soon_threadsafe(
                self.step_health.declare_dead, reason))
        runner_impl = runner_cls(worker, config)
        self.scheduler_actor = SchedulerActor(
            self.scheduler, submit_step=self._submit_step, outputs=CoreOutputs(self._send),
            max_steps_in_flight=max_in_flight, kv_usage=self._kv_usage,
            num_free_rows=self._num_free_rows,
            provide_grammar_mask=runner_impl.deferred_masks.provide)
        self.gpu_actor = gpu_actor_cls(runner_impl,
                                       on_step_output=self.step_health.wrap(self.scheduler_actor.tell))
        self.ready: EngineReady | None = None
        self._clients: set[int] = set(known_clients or ())
        self._internal_finished: dict[str, anyio.Event] = {}
        self._stop = anyio.Event()

    # ---- the loop ---------------------------------------------------------------------

    async def run(self, *, warm_up: bool = False,
                  task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every actor, warm up, answer the endpoint until Shutdown (or until the
        endpoint closes), then abort what is left and stop in order."""
        async with anyio.create_task_group() as tg:
            done = [_start(tg, actor.run) for actor in
                    (self.kv_actor, self.gpu_actor, self.scheduler_actor)]
            if warm_up:
                await self._warm_up()
            self._announce_ready()
            task_status.started()
            tg.start_soon(self._serve_endpoint, tg)
            await self._stop.wait()
            drained = anyio.Event()
            self.scheduler_actor.tell(Drain(drained))
            await drained.wait()
            for actor, actor_done in zip((self.scheduler_actor, self.gpu_actor, self.kv_actor),
                                         reversed(done)):
                actor.close()
                await actor_done.wait()
            tg.cancel_scope.cancel()

    def stop(self) -> None:
        self._stop.set()

    @property
    def dead_reason(self) -> str | None:
        """Why the core is dead (too many consecutive failed steps); None while healthy."""
        return self.step_health.dead_reason

    async def _serve_endpoint(self, tg: anyio.abc.TaskGroup) -> None:
        while True:
            try:
                message = await self.endpoint.receive()
            except TransportClosed:
                self.stop()
                return
            if isinstance(message, (EngineRequest, AbortRequests, GrammarVocab)):
                self.scheduler_actor.tell(message)
            elif isinstance(message, UtilityCall):
                tg.start_soon(self._answer, message)
            elif isinstance(message, ClientHello):
                self._hello(message.client_index)
            elif isinstance(message, Shutdown):
                self.stop()
                return

    def _hello(self, client_index: int) -> None:
        if client_index in self._clients:  # the front end restarted
            self.scheduler_actor.tell(AbortClient(client_index))
        self._clients.add(client_index)
        if self.ready is not None:
            self.endpoint.send(client_index, self.ready)

    def _announce_ready(self) -> None:
        worker, choice = self.worker, self.runner_choice
        self.ready = EngineReady(
            model_source=worker.model_source, architecture=worker.model_config.architecture,
            max_model_len=worker.max_model_len, vocab_size=worker.model_config.vocab_size,
            block_size=self.config.block_size, num_kv_blocks=self.num_kv_blocks,
            kv_cache_bytes=self.num_kv_blocks * worker.kv_spec.bytes_per_block,
            max_num_seqs=self.config.max_num_seqs, runner=choice.runner,
            runner_reason=choice.reason, runner_rule=str(getattr(choice, "rule", "")),
            device=str(worker.device), startup_s=round(time.perf_counter() - self._started_at, 3),
            pid=os.getpid())
        log_startup(log, config=self.config, device=str(worker.device), runner=choice,
                    num_kv_blocks=self.num_kv_blocks, block_size=self.config.block_size,
                    kv_cache_bytes=self.ready.kv_cache_bytes)
        log.info("engine_ready", runner=choice.runner, startup_s=self.ready.startup_s)
        for client in self._clients:
            self.endpoint.send(client, self.ready)

    async def _answer(self, call: UtilityCall) -> None:
        result = UtilityResult(call.call_id)
        try:
            if call.method == "stats":
                result = UtilityResult(call.call_id, stats=await self.scheduler_actor.ask(GetStats()))
            elif call.method == "check_kv_invariants":
                await self.kv_actor.ask(CheckInvariants())
            else:
                result = UtilityResult(call.call_id, error=f"unknown method {call.method!r}")
        except (AssertionError, ActorStopped) as exc:
            result = UtilityResult(call.call_id, error=str(exc) or type(exc).__name__)
        self.endpoint.send(call.client_index, result)

    # ---- wiring ------------------------------------------------------------------------

    def _submit_step(self, sched: Any) -> None:
        self.gpu_actor.submit(sched)

    def _send(self, client_index: int, message: ToFrontEnd) -> None:
        if client_index == WARMUP_CLIENT:
            self._on_internal_output(message)
        else:
            self.endpoint.send(client_index, message)

    def _on_dead(self, reason: str) -> None:
        for client in self._clients:
            self.endpoint.send(client, EngineDead(reason))

    async def _kv_usage(self) -> Any:
        return await self.kv_actor.ask(KVStats())

    def _num_free_rows(self) -> int | None:
        states = getattr(self.gpu_actor.runner, "states", None)
        return getattr(states, "num_free_rows", None)

    # ---- warm-up -----------------------------------------------------------------------

    async def _warm_up(self) -> None:
        started = time.perf_counter()
        waves = warmup_requests(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                self.worker.max_model_len, self.worker.model_config.vocab_size)
        with anyio.fail_after(_WARMUP_TIMEOUT_S):
            for wave in waves:
                events = [self._internal_finished.setdefault(r.request_id, anyio.Event())
                          for r in wave]
                for request in wave:
                    self.scheduler_actor.tell(request)
                for event in events:
                    await event.wait()
        log.info("engine_warmed_up", num_waves=len(waves),
                 warmup_s=round(time.perf_counter() - started, 3))

    def _on_internal_output(self, message: ToFrontEnd) -> None:
        if isinstance(message, EngineCoreOutputs):
            for finish in message.finished:
                event = self._internal_finished.pop(finish.request_id, None)
                if event is not None:
                    event.set()


def _start(tg: anyio.abc.TaskGroup, run: Callable[[], Awaitable[None]]) -> anyio.Event:
    done = anyio.Event()

    async def _run() -> None:
        try:
            await run()
        finally:
            done.set()

    tg.start_soon(_run)
    return done
