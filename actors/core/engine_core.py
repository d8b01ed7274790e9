"""The engine core: the engine loop with its scheduler (and KV cache manager) and the GPU
actor, behind one protocol endpoint. No HTTP, no tokenizer: token ids in, token ids out.

    endpoint --EngineRequest/AbortRequests/GrammarVocab--> engine loop (actors/core/engine_loop.py)
      engine loop: schedule -> launch (GPU actor, own threads) -> collect -> update -> publish
    engine loop --EngineCoreOutputs (one per step per front end)--> endpoint

It runs in its own process under `tandem serve` (actors/core/engine_core_proc.py) and on the
caller's event loop for the offline `LLM` and the tests (an in-process endpoint).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

import anyio
import structlog

from actors.core.core_outputs import CoreOutputs
from actors.core.engine_loop import EngineLoop
from actors.core.gpu_actor import GPUActor
from actors.core.grammar_state import GrammarState
from actors.core.kv_cache_manager import KVCacheManager
from actors.core.kv_claims import KeptPrefixCache, claim_kv_tensors, take_kept
from actors.core.kv_offload import KVOffload
from actors.core.kv_offload_setup import make_offload_tiers
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.core.step_health import DEFAULT_MAX_CONSECUTIVE_FAILED_STEPS, StepFailureMonitor
from actors.core.warmup import WARMUP_CLIENT, warmup_requests
from actors.protocol.config import EngineConfig
from actors.protocol.mailbox import ActorStopped
from actors.protocol.messages import (
    AbortClient,
    AbortRequests,
    CheckKVInvariants,
    ClientHello,
    CoreLoad,
    Drain,
    EngineCoreOutputs,
    EngineDead,
    EngineReady,
    EngineRequest,
    GetSchedulerStats,
    GrammarVocab,
    PrefixCacheReset,
    ResetPrefixCache,
    SchedulerStats,
    Shutdown,
    ToFrontEnd,
    UtilityCall,
    UtilityResult,
)
from actors.protocol.transport import CoreEndpoint, TransportClosed
from gpu.attention.kv_cache_dtype import kv_cache_dtype_name
from gpu.distributed.tp_engine import ParallelRunner
from gpu.runner import Runner
from gpu.runner_selection import RunnerChoice
from gpu.runner_v1.runner import ModelRunnerV1
from gpu.runner_v2.runner import ModelRunnerV2
from gpu.sampling.grammar_mask import mask_buffer_allocator
from gpu.worker import ModelWorker
from telemetry.logging import log_startup

log = structlog.get_logger("tandem.engine_core")

_WARMUP_TIMEOUT_S = 600.0


class EngineCore:
    def __init__(
        self,
        worker: ModelWorker,
        runner: RunnerChoice,
        endpoint: CoreEndpoint,
        config: EngineConfig | None = None,
        *,
        max_consecutive_failed_steps: int = DEFAULT_MAX_CONSECUTIVE_FAILED_STEPS,
        started_at: float | None = None,
        known_clients: set[int] | None = None,
        kept_prefix_cache: KeptPrefixCache | None = None,
    ) -> None:
        """`runner`: the runner the startup rules chose. `config` may narrow the worker's
        (scheduling limits, a smaller KV pool); the model, device and block size are the
        worker's. After `max_consecutive_failed_steps` failed steps in a row the core is
        dead: every front end hears EngineDead. `known_clients`: front ends that said hello
        before the core was built (while the model loaded). `kept_prefix_cache`: an earlier
        core's `prefix_cache` on this worker, which this one goes on with where it still
        holds and fits (actors/core/kv_claims.py); None: an empty one."""
        config = config or worker.config
        self.worker, self.config, self.runner_choice = worker, config, runner
        self.endpoint = endpoint
        self._started_at = time.perf_counter() if started_at is None else started_at
        self.num_kv_blocks = min(
            config.num_kv_blocks or worker.kv_spec.num_blocks, worker.kv_spec.num_blocks
        )
        self.step_health = StepFailureMonitor(max_consecutive_failed_steps, self._on_dead)
        model_runner = self._make_runner(worker, runner, config)
        kept = take_kept(worker, kept_prefix_cache, self.num_kv_blocks, config)
        self.offload_tiers = kept.offload_tiers if kept else make_offload_tiers(worker, config)
        self.gpu_actor = GPUActor(
            model_runner,
            None if self.offload_tiers is None else self.offload_tiers.loads_done_through,
        )
        self.scheduler = _make_scheduler(
            worker,
            config,
            self.num_kv_blocks,
            self.gpu_actor.max_steps_in_flight,
            None if self.offload_tiers is None else self.offload_tiers.offload,
            None if kept is None else kept.kv,
        )
        claim_kv_tensors(worker, self.scheduler.kv)
        self.engine_loop = EngineLoop(
            self.scheduler, self.gpu_actor, CoreOutputs(self._send), self.step_health
        )
        self.ready: EngineReady | None = None
        self._clients: set[int] = set(known_clients or ())
        self._internal_finished: dict[str, anyio.Event] = {}
        self._stop = anyio.Event()

    def _make_runner(
        self, worker: ModelWorker, choice: RunnerChoice, config: EngineConfig
    ) -> Runner:
        tp_leader = getattr(worker, "tp_leader", None)
        if tp_leader is None:
            if choice.runner == "v1":
                return ModelRunnerV1(worker, config)
            return ModelRunnerV2(worker, config)
        loop = asyncio.get_running_loop()  # a failed rank kills the engine at once, even idle
        tp_leader.on_failure(
            lambda reason: loop.call_soon_threadsafe(self.step_health.declare_dead, reason)
        )
        return ParallelRunner(worker, config, choice.runner)

    @property
    def prefix_cache(self) -> KeptPrefixCache:
        """This core's prefix cache, for the next core on the worker to go on with."""
        return KeptPrefixCache(self.scheduler.kv, self.offload_tiers)

    # ---- the loop ---------------------------------------------------------------------

    async def run(
        self,
        *,
        warm_up: bool = False,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the GPU actor and the engine loop, warm up, answer the endpoint until
        Shutdown (or until the endpoint closes), then abort what is left and stop in
        order."""
        async with anyio.create_task_group() as tg:
            gpu_done = _start(tg, self.gpu_actor.run)
            loop_done = _start(tg, self.engine_loop.run)
            if warm_up:
                await self._warm_up()
            self._announce_ready()
            task_status.started()
            tg.start_soon(self._serve_endpoint, tg)
            await self._stop.wait()
            drained = anyio.Event()
            self.engine_loop.tell(Drain(drained))
            await drained.wait()
            self.engine_loop.close()
            await loop_done.wait()
            self.gpu_actor.close()
            await gpu_done.wait()
            tg.cancel_scope.cancel()

    def stop(self) -> None:
        self._stop.set()

    def load(self, client_index: int) -> CoreLoad:
        """The core's load now, as told to front end `client_index` (for the heartbeat: read
        on the core's event loop, between the engine loop's turns)."""
        return self.engine_loop.load(client_index)

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
                self.engine_loop.tell(message)
            elif isinstance(message, UtilityCall):
                tg.start_soon(self._answer, message)
            elif isinstance(message, ClientHello) and message.client_index is not None:
                self._hello(message.client_index)
            elif isinstance(message, Shutdown):
                self.stop()
                return

    def _hello(self, client_index: int) -> None:
        if client_index in self._clients:  # the front end restarted
            self.engine_loop.tell(AbortClient(client_index))
        self._clients.add(client_index)
        if self.ready is not None:
            self.endpoint.send(client_index, self.ready)

    def _announce_ready(self) -> None:
        worker, choice = self.worker, self.runner_choice
        self.ready = EngineReady(
            model_source=worker.model_source,
            architecture=worker.model_config.architecture,
            max_model_len=worker.max_model_len,
            vocab_size=worker.model_config.vocab_size,
            block_size=self.config.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_bytes=self.num_kv_blocks * worker.kv_spec.bytes_per_block,
            max_num_seqs=self.config.max_num_seqs,
            runner=choice.runner,
            runner_reason=choice.reason,
            runner_rule=str(getattr(choice, "rule", "")),
            device=str(worker.device),
            startup_s=round(time.perf_counter() - self._started_at, 3),
            pid=os.getpid(),
            weights=getattr(worker, "weights_precision", ""),
            kv_cache_dtype=kv_cache_dtype_name(worker.kv_cache_dtype),
            hidden_size=worker.model_config.hidden_size,
            kv_offload="" if self.offload_tiers is None else self.offload_tiers.description,
        )
        log_startup(
            log,
            config=self.config,
            device=str(worker.device),
            runner=choice,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.config.block_size,
            kv_cache_bytes=self.ready.kv_cache_bytes,
        )
        log.info("engine_ready", runner=choice.runner, startup_s=self.ready.startup_s)
        for client in self._clients:
            self.endpoint.send(client, self.ready)

    async def _answer(self, call: UtilityCall) -> None:
        result = UtilityResult(call.call_id)
        try:
            if call.method == "stats":
                stats = await self.engine_loop.ask(GetSchedulerStats())
                assert isinstance(stats, SchedulerStats)
                result = UtilityResult(call.call_id, stats=stats)
            elif call.method == "check_kv_invariants":
                await self.engine_loop.ask(CheckKVInvariants())
            elif call.method == "reset_prefix_cache":
                reset = await self.engine_loop.ask(ResetPrefixCache())
                assert isinstance(reset, PrefixCacheReset)
                result = UtilityResult(call.call_id, prefix_cache_reset=reset)
            else:
                result = UtilityResult(call.call_id, error=f"unknown method {call.method!r}")
        except (AssertionError, ActorStopped) as exc:
            result = UtilityResult(call.call_id, error=str(exc) or type(exc).__name__)
        self.endpoint.send(call.client_index, result)

    # ---- wiring ------------------------------------------------------------------------

    def _send(self, client_index: int, message: ToFrontEnd) -> None:
        if client_index == WARMUP_CLIENT:
            self._on_internal_output(message)
        else:
            self.endpoint.send(client_index, message)

    def _on_dead(self, reason: str) -> None:
        for client in self._clients:
            self.endpoint.send(client, EngineDead(reason))

    # ---- warm-up -----------------------------------------------------------------------

    async def _warm_up(self) -> None:
        started = time.perf_counter()
        waves = warmup_requests(
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.worker.max_model_len,
            self.worker.model_config.vocab_size,
        )
        with anyio.fail_after(_WARMUP_TIMEOUT_S):
            for wave in waves:
                events = [
                    self._internal_finished.setdefault(r.request_id, anyio.Event()) for r in wave
                ]
                for request in wave:
                    self.engine_loop.tell(request)
                for event in events:
                    await event.wait()
        log.info(
            "engine_warmed_up",
            num_waves=len(waves),
            warmup_s=round(time.perf_counter() - started, 3),
        )

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


def _make_scheduler(
    worker: ModelWorker,
    config: EngineConfig,
    num_kv_blocks: int,
    max_steps_in_flight: int,
    offload: KVOffload | None = None,
    kept_kv: KVCacheManager | None = None,
) -> Scheduler:
    kv = kept_kv
    if kv is None:
        kv = KVCacheManager(
            num_blocks=num_kv_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            cache_outputs=config.prefix_caching_outputs,
            offload=offload,
        )
    spec = config.speculative_config
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=worker.max_model_len,
        block_size=config.block_size,
        max_steps_in_flight=max_steps_in_flight,
        # V2 keeps a step per stage in flight; V1 runs one step at a time.
        step_groups=config.pipeline_parallel_size if max_steps_in_flight > 1 else 1,
        num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
        prompt_embeds_hidden_size=(
            worker.model_config.hidden_size if config.enable_prompt_embeds else None
        ),
    )
    grammars = GrammarState(
        worker.model_config.vocab_size,
        max_steps_in_flight,
        allocate_buffer=mask_buffer_allocator(worker.device),
    )
    return Scheduler(scheduler_config, kv, grammars)
