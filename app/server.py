"""`tandem serve`: the Starlette app, its lifespan and the Hypercorn server around it.

Lifecycle:
  * The listening socket is bound first, so a port clash fails at once and probes connect
    from the first second. The ASGI lifespan startup only starts a background task, so
    Hypercorn's startup timeout can never kill a slow model load; `/health` answers 503
    "loading" until the engine runs.
  * SIGTERM (or SIGINT): `/health` turns 503, new work gets 503 + Retry-After, in-flight
    requests may finish for up to `shutdown_timeout_s`, the rest are aborted (their
    streams end with finish_reason "abort"); then Hypercorn stops, the engine shuts down
    in order and the spans still queued are exported, all within `drain_bound_s`. A second
    signal skips the wait. Exit code 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import structlog
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from starlette.applications import Starlette
from starlette.middleware import Middleware

from app import http_protocol
from app.connection_balance import ConnectionLoads, serve_balanced
from app.endpoints import exception_handlers
from app.loop_lag import watch_loop_lag
from app.routes_admin import admin_routes
from app.routes_openai import openai_routes
from app.serve_settings import ServeSettings
from app.server_state import ServerState
from app.unread_body import CloseIfBodyUnread

log = structlog.get_logger("tandem.server")
T = TypeVar("T")

_FLUSH_AFTER_ABORT_S = 2.0
"""After aborting what is left, how long streams get to send their final chunks (aborts
end within an engine step: from the abort to the process's exit took 0.6 s on a busy
2-core CPU), and then how long Hypercorn leaves connections to write their last bytes."""
_ENGINE_STOP_S = 30.0


def drain_bound_s(shutdown_timeout_s: float) -> float:
    """The longest from SIGTERM until the server has closed every connection: in-flight
    requests get `shutdown_timeout_s`, the aborted ones _FLUSH_AFTER_ABORT_S to end their
    streams, connections as long again to write their last bytes. The engine's stop follows
    (well under a second when nothing is wrong). A deployment's stop grace period must be
    longer: docker and podman give 10 s, Kubernetes 30 s unless told otherwise."""
    return shutdown_timeout_s + 2 * _FLUSH_AFTER_ABORT_S


class ServerStartError(Exception):
    """The server cannot start (e.g. the port is taken); the message says why."""


def create_app(state: ServerState) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        async with anyio.create_task_group() as tg:
            tg.start_soon(state.run_engine)
            tg.start_soon(state.keep_alive.run)
            tg.start_soon(watch_loop_lag, state.metrics)
            yield
            state.stop_engine()
            with anyio.move_on_after(_ENGINE_STOP_S):
                await state.engine_stopped.wait()
            tg.cancel_scope.cancel()

    app = Starlette(
        routes=[*openai_routes(), *admin_routes()],
        lifespan=lifespan,
        exception_handlers=exception_handlers(),
        middleware=[Middleware(CloseIfBodyUnread)],
    )
    # A redirect to the path without its trailing slash would be built from the client's
    # Host header (an open redirect); such a path gets 404 instead.
    app.router.redirect_slashes = False
    app.state.tandem = state
    return app


def hypercorn_config(settings: ServeSettings, fd: int) -> HypercornConfig:
    http_protocol.install()  # HTTP/1.1 only, strict request framing, send timeout
    config = http_protocol.TandemHypercornConfig()
    config.bind = [f"fd://{fd}"]
    config.alpn_protocols = ["http/1.1"]
    config.send_timeout = settings.send_timeout_s or None
    # Lifespan startup only starts the background load, so this bounds nothing slow.
    config.startup_timeout = 60.0
    # Lifespan shutdown stops the engine after the drain; it must not cut that short.
    config.shutdown_timeout = _ENGINE_STOP_S + 5.0
    # The drain already waited for in-flight requests before Hypercorn is told to stop;
    # this only covers connections still writing their last bytes.
    config.graceful_timeout = _FLUSH_AFTER_ABORT_S
    # Hypercorn's read timeout fires when the client sends nothing, which is normal while a
    # long response streams; it would cut healthy streams, so it stays off. A client that
    # sends headers and then stalls its body is cut by the routes instead (408 after
    # `request_body_timeout_s`).
    config.read_timeout = None
    # Hypercorn runs this timer whenever a connection has no request in progress: from
    # accept until a request's headers are complete, and between keep-alive requests. So it
    # also bounds a client that dribbles its headers. The default (65 s) is longer than the
    # usual proxy idle timeouts (60 s), so the proxy closes idle connections first and never
    # sends a request onto one the server is closing.
    config.keep_alive_timeout = settings.keep_alive_timeout_s
    config.backlog = 2048
    # Hypercorn logs through the standard logging tree that `tandem serve` configured.
    config.accesslog = logging.getLogger("hypercorn.access") if settings.access_log else None
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


@dataclass(slots=True)
class _Signals:
    drain: anyio.Event
    force: anyio.Event


class TandemServer:
    """One `tandem serve` process (or a test's server thread).

    server = TandemServer(settings)     # binds the socket
    exit_code = anyio.run(server.serve)
    """

    def __init__(
        self,
        settings: ServeSettings,
        state: ServerState | None = None,
        sock: socket.socket | None = None,
        connection_loads: ConnectionLoads | None = None,
    ) -> None:
        """`sock`: a listening socket to serve on (an API server of several shares its
        parent's); otherwise the server binds settings.host:settings.port.
        `connection_loads`: the API servers' shared connection counts, with which this one
        takes its share of the connections on the shared `sock` (app/connection_balance.py)."""
        self.settings = settings
        self._connection_loads = connection_loads
        self.state = state or ServerState(settings)
        self._socket = (
            sock if sock is not None else bind_listening_socket(settings.host, settings.port)
        )
        self.port: int = self._socket.getsockname()[1]
        self._loop: Any = None
        self._signals: _Signals | None = None

    @property
    def url(self) -> str:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"http://{host}:{self.port}"

    async def serve(self, handle_signals: bool = True) -> int:
        """Serve until a shutdown completes; returns the process exit code."""
        self._loop = asyncio.get_running_loop()
        signals = self._signals = _Signals(anyio.Event(), anyio.Event())
        self.state.bind_loop()
        app = create_app(self.state)
        config = hypercorn_config(self.settings, self._socket.fileno())
        log.info("server_listening", url=self.url, model=self.settings.engine.model)
        async with anyio.create_task_group() as tg:
            if handle_signals and threading.current_thread() is threading.main_thread():
                tg.start_soon(_watch_signals, signals)
            tg.start_soon(self._drain_when_asked, signals)
            tg.start_soon(self._serve_http, app, config, tg.cancel_scope)
        await self.state.shutdown_tracing()
        log.info("server_stopped", exit_code=self.state.exit_code)
        return self.state.exit_code

    async def _serve_http(
        self, app: Starlette, config: HypercornConfig, done: anyio.CancelScope
    ) -> None:
        # A task of its own: Hypercorn's asyncio.TaskGroup (Python 3.11) leaves its task
        # marked as cancelling after a shutdown, which would then leak a CancelledError out
        # of any cancel scope that task later uses.
        stop = self.state.stop_serving.wait
        if self._connection_loads is not None:
            await serve_balanced(app, config, self._socket, self._connection_loads, stop)
        else:
            self._socket.detach()  # Hypercorn owns the descriptor (config.bind)
            await hypercorn_serve(app, config, shutdown_trigger=stop)
        done.cancel()

    def run_coroutine(self, fn: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run `fn()` on the server's event loop from another thread (tests, diagnostics)."""
        if self._loop is None:
            raise RuntimeError("the server is not running")
        return asyncio.run_coroutine_threadsafe(_as_coroutine(fn), self._loop)

    def request_shutdown(self, force: bool = False) -> None:
        """Start the drain from any thread (what SIGTERM does; `force` = a second signal)."""
        signals = self._signals
        if self._loop is None or signals is None:
            raise RuntimeError("the server is not running")
        self._loop.call_soon_threadsafe(signals.drain.set)
        if force:
            self._loop.call_soon_threadsafe(signals.force.set)

    async def _drain_when_asked(self, signals: _Signals) -> None:
        await signals.drain.wait()
        await self.state.drain(
            self.settings.shutdown_timeout_s, signals.force, flush_timeout_s=_FLUSH_AFTER_ABORT_S
        )


async def _as_coroutine(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


async def _watch_signals(signals: _Signals) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for signum in received:
            if signals.drain.is_set():
                log.warning("second_signal_aborting_requests", signal=signal.Signals(signum).name)
                signals.force.set()
            else:
                log.info("draining", signal=signal.Signals(signum).name)
                signals.drain.set()


def bind_listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        # Listening now lets early connections wait in the backlog instead of being refused.
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ServerStartError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
