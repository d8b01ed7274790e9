"""How a front end reaches its engine core, in one of three ways:

- a core process this front end starts (`tandem serve`, one API server);
- a core process the supervisor started (`--api-server-count N`): attach and watch it;
- a core on this event loop (a preloaded model: tests and benchmarks start servers in a
  second), joined by an in-process endpoint.

Either way the front end holds an `EngineClient` and hears EngineReady, EngineDead or
EngineStartupFailed; a core process that dies is noticed at once and reported as dead.

A core process this front end starts gets a fresh launch secret (actors/protocol/launch_secret.py)
and an ipc folder of its own (0700). The folder goes as soon as the core has answered:
the one front end stays connected, and nothing else needs the socket's path, so a crash
of this process later leaves nothing behind (and no other process can connect at all).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from actors.frontend.engine_client import EngineClient
from actors.protocol.config import EngineConfig
from actors.protocol.launch_secret import new_secret
from actors.protocol.messages import (
    CoreLoad,
    EngineReady,
    EngineStartupFailed,
    SchedulerStats,
    Shutdown,
    StepStats,
)
from actors.protocol.transport import TransportClosed, ZmqClientEndpoint, ipc_address
from app.engine_process import start_engine_process, stop_process, wait_process_exit

log = structlog.get_logger("tandem.server")

ENGINE_STOP_TIMEOUT_S = 30.0


class EngineStartError(Exception):
    """The engine core could not start; `is_user_error` when the configuration is at fault."""

    def __init__(self, message: str, is_user_error: bool) -> None:
        super().__init__(message)
        self.is_user_error = is_user_error


@dataclass(frozen=True, slots=True)
class EngineAttachment:
    """A core process started by someone else (the supervisor)."""

    address: str
    pid: int
    client_index: int
    secret: bytes
    """The launch secret the core's socket asks for."""


@dataclass(frozen=True, slots=True)
class EngineCallbacks:
    on_request_finished: Callable[[Any], None] | None = None
    step_observers: Sequence[Callable[[StepStats], None]] = ()
    on_scheduler_stats: Callable[[SchedulerStats], None] | None = None
    on_dead: Callable[[str], None] | None = None
    """The core declared itself dead, or its process died."""
    on_predecessor_aborted: Callable[[int], None] | None = None
    """The core aborted this many requests that an earlier process of this front end
    (same index, killed or crashed) left running."""
    on_load: Callable[[CoreLoad], None] | None = None
    """The core's load, with each step's outputs and heartbeat (a core process only)."""


@dataclass(frozen=True, slots=True)
class ProcessOptions:
    max_consecutive_failed_steps: int = 5
    log_format: str = "json"
    log_level: str = "info"


class EngineConnection:
    def __init__(
        self,
        config: EngineConfig,
        callbacks: EngineCallbacks,
        *,
        preloaded: Any = None,
        attach: EngineAttachment | None = None,
        process_options: ProcessOptions = ProcessOptions(),
    ) -> None:
        self._config, self._callbacks = config, callbacks
        self._tokenizer: Any = None
        self._preloaded, self._attach, self._options = preloaded, attach, process_options
        self.client: EngineClient | None = None
        self.ready: EngineReady | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._inprocess: Any = None
        self._startup_failure: EngineStartupFailed | None = None
        self._ready_or_failed: anyio.Event | None = None
        self._ipc_dir: str | None = None
        self._secret = new_secret()
        self._scope: anyio.CancelScope | None = None
        self._stopping = False

    @property
    def inprocess_engine(self) -> Any:
        """The actors.inprocess_engine.InProcessEngine when the core shares this event loop
        (tests reach into it to inject faults and read its steps); None when the core is
        another process."""
        return self._inprocess

    @property
    def inprocess_core(self) -> Any:
        """The in-process engine's actors.core.engine_core.EngineCore (None when the core is
        another process)."""
        return self._inprocess.core if self._inprocess is not None else None

    @property
    def engine_pid(self) -> int | None:
        if self._process is not None:
            return self._process.pid
        return self._attach.pid if self._attach is not None else None

    def spawn(self) -> None:
        """Start the core's process now (when this front end owns one), so that it loads
        the model while the front end loads its tokenizer."""
        if self._preloaded is None and self._attach is None and self._process is None:
            self._ipc_dir = tempfile.mkdtemp(prefix="tandem-")
            options = self._options
            self._process = start_engine_process(
                self._config,
                ipc_address(self._ipc_dir),
                self._secret,
                max_consecutive_failed_steps=options.max_consecutive_failed_steps,
                log_format=options.log_format,
                log_level=options.log_level,
            )

    async def run(self, tokenizer: Any, *, task_status: anyio.abc.TaskStatus[EngineReady]) -> None:
        """Start (or attach to) the core; `started` with its EngineReady. Raises
        EngineStartError if it cannot start. Then runs until `shutdown()`."""
        self._tokenizer = tokenizer
        self._ready_or_failed = anyio.Event()
        if self._preloaded is not None:
            await self._run_in_process(task_status)
            return
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                client = self._connect()
                await tg.start(client.run)
                tg.start_soon(self._watch_process, tg.cancel_scope)
                if self._ipc_dir is not None:
                    tg.start_soon(self._remove_ipc_dir_once_heard, client)
                await self._ready_or_failed.wait()
                if self.ready is None:
                    tg.cancel_scope.cancel()
                    raise self._start_error()
                task_status.started(self.ready)
        finally:
            self._remove_ipc_dir()  # a start that failed before the core answered

    async def shutdown(self) -> None:
        """Stop the core this front end owns (in-process, or a process it started) after
        the drain; an attached core is the supervisor's to stop."""
        self._stopping = True
        if self._inprocess is not None:
            self._inprocess.stop()
            return
        if self._process is not None:
            if self.ready is None:
                self._process.kill()  # still loading: nothing to drain
            elif self.client is not None:
                try:
                    self.client.endpoint.send(Shutdown())
                except TransportClosed:
                    pass
            await anyio.to_thread.run_sync(stop_process, self._process, ENGINE_STOP_TIMEOUT_S)
        if self._scope is not None:
            self._scope.cancel()
        if self.client is not None:
            self.client.close()
        self._remove_ipc_dir()

    # ---- the three ways -----------------------------------------------------------------

    async def _run_in_process(self, task_status: anyio.abc.TaskStatus[EngineReady]) -> None:
        from actors.core.engine_startup import reuse_engine
        from actors.inprocess_engine import InProcessEngine

        loaded = reuse_engine(self._preloaded, self._config)
        callbacks = self._callbacks
        engine = InProcessEngine(
            loaded.worker,
            loaded.runner,
            self._config,
            tokenizer=self._tokenizer,
            max_consecutive_failed_steps=self._options.max_consecutive_failed_steps,
            on_request_finished=callbacks.on_request_finished,
            step_observers=callbacks.step_observers,
            on_scheduler_stats=callbacks.on_scheduler_stats,
            on_dead=callbacks.on_dead,
        )
        self._inprocess, self.client = engine, engine.client
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            self.ready = engine.ready
            assert self.ready is not None
            task_status.started(self.ready)

    def _connect(self) -> EngineClient:
        if self._attach is not None:
            address, client_index = self._attach.address, self._attach.client_index
            secret = self._attach.secret
        else:
            self.spawn()
            assert self._ipc_dir is not None
            address, client_index, secret = ipc_address(self._ipc_dir), 0, self._secret
        callbacks = self._callbacks
        self.client = EngineClient(
            ZmqClientEndpoint(address, client_index, secret),
            self._tokenizer,
            client_index=client_index,
            on_request_finished=callbacks.on_request_finished,
            step_observers=callbacks.step_observers,
            on_scheduler_stats=callbacks.on_scheduler_stats,
            on_ready=self._on_ready,
            on_dead=callbacks.on_dead,
            on_startup_failed=self._on_startup_failed,
            on_predecessor_aborted=callbacks.on_predecessor_aborted,
            on_load=callbacks.on_load,
        )
        return self.client

    # ---- events ------------------------------------------------------------------------

    def _on_ready(self, ready: EngineReady) -> None:
        self.ready = ready
        if self._ready_or_failed is not None:
            self._ready_or_failed.set()

    def _on_startup_failed(self, failure: EngineStartupFailed) -> None:
        self._startup_failure = failure
        if self._ready_or_failed is not None:
            self._ready_or_failed.set()

    async def _watch_process(self, scope: anyio.CancelScope) -> None:
        pid = self.engine_pid
        assert pid is not None
        await wait_process_exit(pid)
        if self._stopping:
            return
        returncode = self._process.poll() if self._process is not None else None
        log.error("engine_process_died", pid=pid, returncode=returncode)
        if self.ready is None:  # died while starting
            assert self._ready_or_failed is not None
            self._ready_or_failed.set()
            return
        if self.client is not None:
            self.client.fail_all("the engine core process stopped unexpectedly")
        if self._callbacks.on_dead is not None:
            self._callbacks.on_dead(
                f"the engine core process (pid {pid}) exited"
                + ("" if returncode is None else f" with code {returncode}")
            )

    async def _remove_ipc_dir_once_heard(self, client: EngineClient) -> None:
        """A connected DEALER keeps its connection without the socket's path, and no other
        front end will connect to a core this one started."""
        await client.heard.wait()
        self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def _start_error(self) -> EngineStartError:
        failure = self._startup_failure
        if failure is not None:
            return EngineStartError(failure.message, failure.is_user_error)
        code = self._process.poll() if self._process is not None else None
        return EngineStartError(
            f"the engine core process exited during startup (code {code}); its log above says why",
            is_user_error=code == 2,
        )
