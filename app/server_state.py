"""What the routes of one front end share: settings, lifecycle phase, the tokenizer, the
connection to the engine core and the admission actor.

No torch here: the engine core is another process (or, for tests and benchmarks, an
in-process core on a preloaded model, imported only then).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import structlog

from actors.frontend.admission import AdmissionActor, AdmissionLimits
from actors.frontend.engine_client import EngineUnavailable
from actors.frontend.engine_group import EngineGroup
from actors.frontend.prefix_affinity import PrefixAffinity
from actors.protocol.messages import (
    AbortAll,
    BeginDrain,
    EngineReady,
    FailAll,
    GrammarCheckerStart,
    PrefixCacheReset,
    ResumeAdmission,
    SchedulerStats,
)
from actors.protocol.model_source import ModelLoadError
from app.engine_connection import EngineAttachment, EngineStartError, ProcessOptions
from app.engine_cores import EngineCores, core_callbacks
from app.engine_watchdog import EngineWatchdog
from app.grammar_checker import GrammarChecker
from app.keep_alive import KeepAliveClock
from app.serve_settings import EMBEDDED_MODEL_NAME, ServeSettings, default_model_names
from app.tokenizer_loader import load_generation_config, load_warm_tokenizer
from app.tool_calls.request import log_tool_call_parser
from telemetry.metrics import EngineMetrics
from telemetry.tracing import Tracing, setup_tracing

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "EngineSnapshot",
    "ServeSettings",
    "ServerState",
    "default_model_names",
]

log = structlog.get_logger("tandem.server")

Phase = Literal["loading", "serving", "stalled", "draining", "stopped", "dead"]
"""'stalled': the engine core has not answered for the stall bound (app/engine_watchdog.py);
it turns back to 'serving' when the core answers again."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Internal counters for tests and diagnostics (over the protocol)."""

    num_running: int
    num_waiting: int
    num_unfinished_admitted: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_free_rows: int | None
    """Free runner rows (None when the runner does not expose them)."""
    num_rows: int


class ServerState:
    def __init__(
        self,
        settings: ServeSettings,
        preloaded: Any = None,
        *,
        tracing: Tracing | None = None,
        attach: Sequence[EngineAttachment] = (),
        metrics: EngineMetrics | None = None,
        affinity: PrefixAffinity | None = None,
    ) -> None:
        """`preloaded`: an actors.core.engine_startup.LoadedEngine to serve on this event loop
        instead of starting the engine core's process (same model and block size; tests
        and benchmarks start servers in a second). `attach`: the core processes someone
        else started (--api-server-count > 1), one per core. `affinity`: the prefix table
        the API servers share (--data-parallel-size > 1). `tracing` defaults to what the
        OTEL_* variables configure (raises telemetry.tracing.TracingConfigError when they
        ask for the impossible)."""
        self.settings = settings
        self._preloaded = preloaded
        self._attach, self._affinity = tuple(attach), affinity
        self.client_index = attach[0].client_index if attach else 0
        self.num_cores = settings.engine.data_parallel_size
        self.phase: Phase = "loading"
        self.model_names = settings.model_names()
        self.tracing = tracing if tracing is not None else setup_tracing("tandem")
        self.metrics = metrics or EngineMetrics(self.model_names[0], num_engines=self.num_cores)
        self.keep_alive = KeepAliveClock(settings.keep_alive_interval_s)
        """Keep-alive comments for every open stream (its task runs in the lifespan)."""
        self.created = int(time.time())
        self.exit_code = 0
        self.failure_message: str | None = None
        """Why the model could not be served, when the user's configuration is at fault."""
        self.engine_info: EngineReady | None = None
        self.engine: EngineGroup | None = None
        """The engine cores' clients, once every core is ready."""
        self.connection: EngineCores | None = None
        self.admission: AdmissionActor | None = None
        self.grammar_checker: GrammarChecker
        """Checks new structured-output specs (set once the engine is ready)."""
        self.tokenizer: Any = None
        self.generation_config: dict[str, Any] = {}
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_token_ids: tuple[int, ...] = ()

    def bind_loop(self) -> None:
        """Create the events on the serving event loop."""
        self.stop_serving = anyio.Event()
        self.engine_stopped = anyio.Event()
        self._stop_engine = anyio.Event()

    # ---- engine lifecycle ---------------------------------------------------------------

    async def run_engine(self) -> None:
        """Load the tokenizer, start (or attach to) the engine core and serve until
        `stop_engine()`. Never raises: a failure marks the server dead and asks it to stop."""
        try:
            await self._start_and_run()
        except Exception as exc:  # noqa: BLE001 - reported, and the process exits non-zero
            self._on_engine_failure(_single(exc))
        finally:
            self.engine_stopped.set()

    async def _start_and_run(self) -> None:
        config = self.settings.engine
        started = time.perf_counter()
        connection = self.connection = self._make_connection()
        connection.spawn()
        try:
            self.tokenizer = await anyio.to_thread.run_sync(
                load_warm_tokenizer, config.model, config.tokenizer
            )
            self.generation_config = load_generation_config(config.model)
        except Exception:
            await connection.shutdown()  # the core it spawned, and its ipc folder
            raise
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        log_tool_call_parser(self.settings.tool_call_parser, self.tokenizer)
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as start_scope:
                self._start_scope = start_scope
                info: EngineReady = await tg.start(connection.run, self.tokenizer)
            if start_scope.cancelled_caught:
                await connection.shutdown()
                return
            try:
                self._check_tokenizer_fits(info)
            except ModelLoadError:
                await connection.shutdown()
                raise
            self._serve_with(info, connection)
            log.info(
                "engine_ready",
                runner=info.runner,
                reason=info.runner_reason,
                max_model_len=info.max_model_len,
                weights=info.weights,
                kv_cache_dtype=info.kv_cache_dtype,
                engine_pid=info.pid,
                **({"engine_pids": connection.engine_pids} if self.num_cores > 1 else {}),
                startup_s=round(time.perf_counter() - started, 3),
            )
            assert self.admission is not None
            tg.start_soon(self.admission.run)
            watchdog = self._make_watchdog(connection)
            if watchdog is not None:
                tg.start_soon(watchdog.run)
            try:
                await self._stop_engine.wait()
            finally:
                await self.grammar_checker.aclose()
            if watchdog is not None:
                watchdog.stop()
            self.admission.close()
            await connection.shutdown()

    def _make_connection(self) -> EngineCores:
        settings = self.settings
        options = ProcessOptions(
            max_consecutive_failed_steps=settings.max_consecutive_failed_steps,
            log_format=settings.log_format,
            log_level=settings.log_level,
        )
        return EngineCores(
            settings.engine,
            core_callbacks(self.metrics, self.num_cores, self._on_engine_dead),
            preloaded=self._preloaded,
            attach=self._attach,
            process_options=options,
            affinity=self._affinity,
            client_index=self.client_index,
        )

    def _make_watchdog(self, connection: EngineCores) -> EngineWatchdog | None:
        timeout_s = self.settings.engine_stall_timeout_s
        client = connection.client
        if connection.inprocess_core is not None or timeout_s <= 0 or client is None:
            return None  # a core on this event loop cannot stall without this loop
        return EngineWatchdog(
            timeout_s,
            lambda: client.last_heard_at,
            self._on_engine_stalled,
            self._on_engine_resumed,
            self._on_engine_unresponsive,
        )

    def _on_engine_stalled(self, silent_s: float) -> None:
        if self.phase == "dead":  # its process is gone: silence says nothing more
            return
        if self.phase == "serving":
            self.phase = "stalled"
        log.error(
            "engine_stalled",
            silent_s=round(silent_s, 3),
            stall_timeout_s=self.settings.engine_stall_timeout_s,
        )

    def _on_engine_unresponsive(self, silent_s: float) -> None:
        """Silent for twice the stall bound: the requests in flight end now (503) rather than
        wait on a core that may never come back; aborted in the core too, so that one that
        resumes frees their KV. New requests get 503 until it answers."""
        if self.phase == "dead":
            return
        log.error(
            "engine_unresponsive",
            silent_s=round(silent_s, 3),
            stall_timeout_s=self.settings.engine_stall_timeout_s,
        )
        if self.admission is not None:
            message = (
                f"The engine stopped responding: it has sent nothing for {silent_s:.0f} s; "
                "retry shortly"
            )
            self.admission.tell(FailAll(message, retryable=True))

    def _on_engine_resumed(self) -> None:
        if self.phase == "dead":
            return
        if self.phase == "stalled":
            self.phase = "serving"
        if self.admission is not None:
            self.admission.tell(ResumeAdmission())
        log.warning("engine_resumed")

    def _check_tokenizer_fits(self, info: EngineReady) -> None:
        if self.tokenizer is not None and self.tokenizer.vocab_size > info.vocab_size:
            raise ModelLoadError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's "
                f"vocabulary holds {info.vocab_size}: pass the model's own tokenizer "
                f"(--tokenizer)"
            )

    def _serve_with(self, info: EngineReady, connection: EngineCores) -> None:
        assert connection.client is not None
        self.engine_info, self.engine = info, connection.client
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        self.metrics.set_runner(info.runner, info.runner_reason, info.runner_rule)
        config = self.settings.engine
        self.metrics.request_shape.configure(
            self.max_model_len,
            {
                "block_size": info.block_size,
                "num_gpu_blocks": info.num_kv_blocks,
                "enable_prefix_caching": config.enable_prefix_caching,
                "gpu_memory_utilization": config.gpu_memory_utilization,
                "cache_dtype": config.kv_cache_dtype,
            },
        )
        limits = AdmissionLimits(
            max_num_running=config.max_num_seqs * self.num_cores,
            max_queued_requests=self.settings.max_queued_requests,
            max_queued_prompt_tokens=self.settings.max_queued_prompt_tokens,
            max_n=self.settings.max_n,
            retry_after_s=self.settings.retry_after_s,
        )
        self.admission = AdmissionActor(self.engine, limits)
        tokenizer = self.tokenizer
        self.grammar_checker = GrammarChecker(
            lambda: GrammarCheckerStart(
                None if tokenizer is None else tokenizer.raw.to_str(),
                info.vocab_size,
                self.eos_token_ids,
            ),
            timeout_s=self.settings.grammar_compile_timeout_s,
        )
        if self.phase == "loading":
            self.phase = "serving"

    def _on_engine_failure(self, exc: Exception) -> None:
        user_error = isinstance(exc, EngineStartError) and exc.is_user_error
        if user_error or isinstance(exc, ModelLoadError):
            log.error("model_load_failed", error=str(exc))
            self.failure_message = str(exc)
            self.exit_code = 2
        else:
            log.exception("engine_failed")
            self.exit_code = 1
        self.phase = "dead"
        if self.admission is not None:
            self.admission.fail_streams("the engine stopped unexpectedly")
        self.stop_serving.set()

    def _on_engine_dead(self, reason: str) -> None:
        """The core cannot serve (steps keep failing, or its process died): /health turns
        503 (an orchestrator then restarts the server), new requests get 503, every
        admitted request ends with an error, and the process exits 1 when it is stopped."""
        if self.phase in ("loading", "serving", "stalled"):
            self.phase = "dead"
        self.exit_code = 1
        if self.admission is not None:
            self.admission.tell(FailAll(reason))

    def stop_engine(self) -> None:
        self._stop_engine.set()
        scope = getattr(self, "_start_scope", None)
        if scope is not None and self.engine_info is None:
            scope.cancel()  # a start still running is abandoned

    async def shutdown_tracing(self) -> None:
        """Export the spans still queued and stop the exporter (it may wait on the network,
        so off the event loop)."""
        await anyio.to_thread.run_sync(self.tracing.shutdown)

    async def drain(self, timeout_s: float, force: anyio.Event, flush_timeout_s: float) -> None:
        """Refuse new work, give in-flight requests `timeout_s`, abort the rest, then ask
        Hypercorn to stop."""
        if self.phase in ("serving", "stalled", "loading"):
            self.phase = "draining"
        admission = self.admission
        if admission is not None:
            admission.tell(BeginDrain())
            finished = await admission.wait_idle_or(force, timeout_s)
            if not finished:
                stats = await admission.stats()
                log.warning("drain_timeout_aborting", num_requests=stats.num_unfinished)
                admission.tell(AbortAll())
                await admission.wait_idle_or(anyio.Event(), flush_timeout_s)
        self.stop_serving.set()

    # ---- queries ------------------------------------------------------------------------

    def resolve_model(self, requested: str | None) -> str | None:
        """The served name for `requested`; None if this server does not serve it."""
        if requested is None or requested in self.model_names:
            return self.model_names[0]
        return None

    @property
    def cores(self) -> EngineGroup:
        """The engine cores' clients; raises EngineUnavailable until they are ready."""
        if self.engine is None:
            raise EngineUnavailable("the engine is not running")
        return self.engine

    async def engine_stats(self) -> SchedulerStats:
        """The cores' load and KV usage, asked over the protocol (summed over the cores)."""
        return await self.cores.stats()

    async def check_kv_invariants(self) -> None:
        await self.cores.check_kv_invariants()  # AssertionError naming what is broken

    async def reset_prefix_cache(self) -> PrefixCacheReset:
        return await self.cores.reset_prefix_cache()  # POST /reset_prefix_cache

    async def engine_snapshot(self) -> EngineSnapshot:
        admission = self.admission
        if admission is None:
            raise EngineUnavailable("the engine is not running")
        stats = await self.engine_stats()
        admitted = await admission.stats()
        return EngineSnapshot(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_unfinished_admitted=admitted.num_unfinished,
            num_free_kv_blocks=stats.num_free_kv_blocks,
            num_total_kv_blocks=stats.num_total_kv_blocks,
            num_free_rows=stats.num_free_rows,
            num_rows=self.settings.engine.max_num_seqs * self.num_cores,
        )


def _single(exc: Exception) -> Exception:
    """The one error inside task-group wrappers, so that it is reported as itself."""
    while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
