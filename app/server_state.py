"""What the routes of one server share: settings, lifecycle phase, the loaded model, the
engine and the admission actor."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import structlog

from actors.admission import (
    AbortAll,
    AdmissionActor,
    AdmissionLimits,
    BeginDrain,
    FailAll,
)
from app.config import EngineConfig
from telemetry.logging import EngineStatsLog, log_startup
from telemetry.metrics import EngineMetrics
from telemetry.tracing import Tracing, setup_tracing

log = structlog.get_logger("tandem.server")

T = TypeVar("T")
Phase = Literal["loading", "serving", "draining", "stopped", "dead"]
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class ServeSettings:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    """Names clients may send as `model`; the first is listed in /v1/models. Empty: derived
    from the model."""
    api_key: str | None = None
    max_queued_requests: int = 1024
    max_queued_prompt_tokens: int | None = None
    max_request_body_bytes: int = 16 * 1024 * 1024
    keep_alive_interval_s: float = 10.0
    shutdown_timeout_s: float = 30.0
    clamp_max_tokens: bool = False
    max_n: int = 16
    retry_after_s: int = 1
    access_log: bool = False
    max_consecutive_failed_steps: int = 5
    """This many failed engine steps in a row mark the engine dead: /health 503."""
    keep_alive_timeout_s: float = 65.0
    """An idle connection (no request yet, or between requests) is closed after this; a
    request's headers must arrive within it."""
    request_body_timeout_s: float = 60.0
    """A request body that has not fully arrived this long after its headers gets 408."""
    send_timeout_s: float = 60.0
    """A response the client stops taking (a 64 KiB piece not taken within this long) has
    its connection aborted and its buffered output dropped (0: no limit)."""
    priority_scheduling: bool = False
    """Accept a request's `priority` (otherwise a non-zero priority gets 400)."""

    def model_names(self) -> tuple[str, ...]:
        if self.served_model_names:
            return self.served_model_names
        return default_model_names(self.engine.model)


def default_model_names(model: str) -> tuple[str, ...]:
    """A path is served under its base name (never the full path, which would leak in
    /v1/models), with the original string as an alias."""
    if model == "default":
        return (EMBEDDED_MODEL_NAME, "default")
    base = os.path.basename(os.path.normpath(model))
    base = base.removesuffix(".gguf") if base.endswith(".gguf") else base
    return (base, model) if base != model else (model,)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Internal counters for tests and diagnostics."""

    num_running: int
    num_waiting: int
    num_unfinished_admitted: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_free_rows: int | None
    """Free runner rows (None when the runner does not expose them)."""
    num_rows: int


class ServerState:
    def __init__(self, settings: ServeSettings, preloaded: Any = None, *,
                 tracing: Tracing | None = None) -> None:
        """`preloaded`: an app.startup.LoadedEngine to serve instead of loading the model
        (same model and block size; tests and benchmarks start servers in a second).
        `tracing` defaults to what the OTEL_* variables configure (raises
        telemetry.tracing.TracingConfigError when they ask for the impossible)."""
        self.settings = settings
        self._preloaded = preloaded
        self.phase: Phase = "loading"
        self.model_names = settings.model_names()
        self.tracing = tracing if tracing is not None else setup_tracing("tandem")
        self.metrics = EngineMetrics(self.model_names[0])
        self.created = int(time.time())
        self.exit_code = 0
        self.failure_message: str | None = None
        """Why the model could not be served, when the user's configuration is at fault."""
        self.loaded: Any = None
        self.engine: Any = None
        self.admission: AdmissionActor | None = None
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
        self._load_scope = anyio.CancelScope()

    # ---- engine lifecycle ---------------------------------------------------------------

    async def run_engine(self) -> None:
        """Load the model in a worker thread, run the engine until `stop_engine()`. Never
        raises: a failure marks the server dead and asks it to stop."""
        try:
            await self._load_and_run()
        except Exception as exc:  # noqa: BLE001 - reported, and the process exits non-zero
            self._on_engine_failure(exc)
        finally:
            self.engine_stopped.set()

    async def _load_and_run(self) -> None:
        config = self.settings.engine
        started = time.perf_counter()
        if self._preloaded is not None:
            from app.startup import reuse_engine

            loaded = reuse_engine(self._preloaded, config)
        else:
            with self._load_scope:
                loaded = await _run_in_daemon_thread(_load_model, config)
            if self._load_scope.cancelled_caught:
                return
        from actors.engine import Engine  # imported by the load already: torch is slow

        worker = loaded.worker
        self.loaded = loaded
        self.tokenizer = worker.tokenizer
        self.generation_config = dict(worker.generation_config or {})
        self.max_model_len = worker.max_model_len
        self.vocab_size = worker.model_config.vocab_size
        self.eos_token_ids = worker.eos_token_ids
        engine = Engine(worker, loaded.runner.runner, config, metrics=self.metrics,
                        stats_log=EngineStatsLog(),
                        max_consecutive_failed_steps=self.settings.max_consecutive_failed_steps,
                        on_dead=self._on_engine_dead)
        self.metrics.set_runner(loaded.runner)
        log_startup(log, config=config, device=loaded.platform.device, runner=loaded.runner,
                    num_kv_blocks=engine.num_kv_blocks, block_size=config.block_size,
                    kv_cache_bytes=engine.num_kv_blocks * worker.kv_spec.bytes_per_block)
        limits = AdmissionLimits(
            max_num_running=config.max_num_seqs,
            max_queued_requests=self.settings.max_queued_requests,
            max_queued_prompt_tokens=self.settings.max_queued_prompt_tokens,
            max_n=self.settings.max_n, retry_after_s=self.settings.retry_after_s)
        admission = AdmissionActor(engine, limits)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            tg.start_soon(admission.run)
            self.engine, self.admission = engine, admission
            if self.phase == "loading":
                self.phase = "serving"
            log.info("engine_ready", runner=loaded.runner.runner, reason=loaded.runner.reason,
                     max_model_len=self.max_model_len,
                     startup_s=round(time.perf_counter() - started, 3))
            await self._stop_engine.wait()
            admission.close()
            engine.stop()

    def _on_engine_failure(self, exc: Exception) -> None:
        from app.cli_errors import user_errors

        if isinstance(exc, user_errors()):
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
        """Steps keep failing: /health turns 503 (an orchestrator then restarts the process),
        new requests get 503, every admitted request ends with an error, and the process
        exits 1 when it is stopped."""
        if self.phase in ("loading", "serving"):
            self.phase = "dead"
        self.exit_code = 1
        if self.admission is not None:
            self.admission.tell(FailAll(reason))

    def stop_engine(self) -> None:
        self._stop_engine.set()
        self._load_scope.cancel()  # a load still running is abandoned

    async def shutdown_tracing(self) -> None:
        """Export the spans still queued and stop the exporter (it may wait on the network,
        so off the event loop)."""
        await anyio.to_thread.run_sync(self.tracing.shutdown)

    async def drain(self, timeout_s: float, force: anyio.Event, flush_timeout_s: float) -> None:
        """Refuse new work, give in-flight requests `timeout_s`, abort the rest, then ask
        Hypercorn to stop."""
        if self.phase in ("serving", "loading"):
            self.phase = "draining"
        admission = self.admission
        if admission is not None:
            admission.tell(BeginDrain())
            finished = await _wait_idle_or(admission, force, timeout_s)
            if not finished:
                stats = await admission.stats()
                log.warning("drain_timeout_aborting", num_requests=stats.num_unfinished)
                admission.tell(AbortAll())
                await _wait_idle_or(admission, anyio.Event(), flush_timeout_s)
        self.stop_serving.set()

    # ---- queries ------------------------------------------------------------------------

    def resolve_model(self, requested: str | None) -> str | None:
        """The served name for `requested`; None if this server does not serve it."""
        if requested is None or requested in self.model_names:
            return self.model_names[0]
        return None

    async def engine_snapshot(self) -> EngineSnapshot:
        from actors.kv_messages import KVStats

        engine, admission = self.engine, self.admission
        if engine is None or admission is None:
            raise RuntimeError("the engine is not running")
        kv = await engine.kv_actor.ask(KVStats())
        stats = engine.stats()
        admitted = await admission.stats()
        runner = engine.gpu_actor.runner
        states = getattr(runner, "states", None)
        return EngineSnapshot(
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            num_unfinished_admitted=admitted.num_unfinished,
            num_free_kv_blocks=kv.num_free_blocks, num_total_kv_blocks=kv.num_total_blocks,
            num_free_rows=getattr(states, "num_free_rows", None),
            num_rows=self.settings.engine.max_num_seqs)


def _load_model(config: EngineConfig) -> Any:
    # Imported here, in the loading thread: importing torch takes seconds, during which the
    # event loop must keep answering /health.
    from app.startup import load_engine

    return load_engine(config)


async def _run_in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` in a daemon thread and wait for it. Cancelling the wait abandons the
    thread: a SIGTERM during a long model load must not keep the process alive until the
    load ends (anyio's worker threads would)."""
    done = anyio.Event()
    outcome: dict[str, Any] = {}
    token = anyio.lowlevel.current_token()

    def work() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting task
            outcome["error"] = exc
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except RuntimeError:  # the event loop is gone: nobody waits any more
            pass

    threading.Thread(target=work, name="tandem-model-load", daemon=True).start()
    await done.wait()
    if "error" in outcome:
        raise outcome["error"]
    value: T = outcome["value"]
    return value


async def _wait_idle_or(admission: AdmissionActor, force: anyio.Event, timeout_s: float) -> bool:
    """True once no admitted request is left; False on timeout or when `force` is set."""
    idle = False
    with anyio.move_on_after(timeout_s):
        async with anyio.create_task_group() as tg:
            async def wait_idle() -> None:
                nonlocal idle
                await admission.wait_idle()
                idle = True
                tg.cancel_scope.cancel()

            async def wait_force() -> None:
                await force.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(wait_idle)
            tg.start_soon(wait_force)
    return idle
