"""Connections spread over the API servers of `tandem serve --api-server-count N`.

The API servers share one listening socket. Left to Hypercorn (uvloop), each process
accepts every connection waiting whenever it wakes, so a burst of connections (a load
balancer or a benchmark opening its pool) lands almost whole on one process: 19 to 24 of
24 in four measurements, 7 of 8 in others, and such connections then stream for minutes.

Here each API server accepts one connection at a time and first gives way to a less busy
one: the open connections of every API server are counted in a small file they all map
(`ConnectionLoads`), and a process holding more than SLACK connections above the least
busy live peer waits up to MAX_YIELD_S for that peer (woken by the same connection) to
take it. A peer that is stopped or blocked marks its slot live no more and is not waited
for once its mark is STALE_AFTER_S old; until then the wait costs a new connection at most
MAX_YIELD_S.

Why not SO_REUSEPORT with a socket per process: the kernel hashes each connection to one
socket whatever its process is doing, so the share of a stopped or blocked API server would
wait in its queue until the supervisor replaced it (up to --api-server-stall-timeout),
where a shared socket lets the others take every new connection meanwhile.

The HTTP side is Hypercorn's own: its lifespan handling (`worker_serve`, given no socket
of its own) and its connection protocol (`TCPServer`) on each accepted connection.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import select
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import structlog
from hypercorn.asyncio.run import worker_serve
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.utils import wrap_app

log = structlog.get_logger("tandem.server")

SLACK = 1
"""Shares within one connection of each other are even enough: a difference of one never
delays a connection, and which process takes it is then left to the kernel."""
MAX_YIELD_S = 0.02
"""The longest a busier API server leaves a waiting connection to a less busy one."""
_YIELD_STEP_S = 0.001
BEAT_INTERVAL_S = 0.25
"""How often an API server marks its slot live."""
STALE_AFTER_S = 1.0
"""A peer whose mark is older than this (stopped, blocked, dead) is not yielded to."""
_ACCEPT_RETRY_S = 0.1
_SLOT = 2  # int64 fields per API server: open connections, last heartbeat (monotonic ns)


class ConnectionLoads:
    """Open connections per API server, in a file every API server maps (one slot each).

    Reads and writes are single aligned 8-byte words, and the numbers only steer a
    heuristic: a stale or torn value costs at most one connection placed unevenly."""

    def __init__(self, path: str, index: int) -> None:
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
        self._words = memoryview(self._map).cast("q")
        self.count = len(self._words) // _SLOT
        if not 0 <= index < self.count:
            raise ValueError(f"API server index {index} outside the {self.count} slots")
        self.index = index
        self._words[index * _SLOT] = 0  # a restarted API server's connections died with it
        self.beat()

    @staticmethod
    def create(path: str, count: int) -> None:
        """The supervisor's side: a zeroed table for `count` API servers."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, bytes(8 * _SLOT * count))
        finally:
            os.close(fd)

    def open_connections(self, index: int) -> int:
        return int(self._words[index * _SLOT])

    def opened(self) -> None:
        self._words[self.index * _SLOT] += 1

    def closed(self) -> None:
        self._words[self.index * _SLOT] -= 1

    def beat(self) -> None:
        self._words[self.index * _SLOT + 1] = time.monotonic_ns()

    def busier_than_a_live_peer(self) -> bool:
        """Whether a peer that beat within STALE_AFTER_S holds more than SLACK fewer open
        connections than this API server."""
        live_since = time.monotonic_ns() - int(STALE_AFTER_S * 1e9)
        mine = self.open_connections(self.index)
        return any(
            self._words[peer * _SLOT + 1] >= live_since
            and self.open_connections(peer) < mine - SLACK
            for peer in range(self.count)
            if peer != self.index
        )

    def close(self) -> None:
        self._words.release()
        self._map.close()


async def serve_balanced(
    app: Any,
    config: HypercornConfig,
    sock: socket.socket,
    loads: ConnectionLoads,
    shutdown_trigger: Callable[[], Awaitable[Any]],
) -> None:
    """Serve `app` on the shared listening socket `sock` until `shutdown_trigger()` returns,
    as `hypercorn.asyncio.serve` does: lifespan startup first, and at shutdown the listener
    closes, idle connections close and busy ones get `config.graceful_timeout` before they
    are cancelled and the lifespan shuts down."""
    wrapped = wrap_app(app, config.wsgi_max_body_size, None)
    context = WorkerContext(None)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()

    async def serve_connection(conn: socket.socket) -> None:
        closed = _Once(loads.closed)
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except OSError:  # the client went away before its connection was set up
            conn.close()
            closed()
            return
        try:
            await TCPServer(wrapped, loop, config, context, {}, _EofReader(reader, closed), writer)
        except Exception:  # one connection's failure must not end the others
            log.exception("connection_failed")
        finally:
            closed()

    async def serve_until_shutdown() -> None:
        async with anyio.create_task_group() as connections:
            async with anyio.create_task_group() as accepting:
                accepting.start_soon(_accept, sock, loads, connections, serve_connection)
                accepting.start_soon(_beat, loads)
                await shutdown_trigger()
                accepting.cancel_scope.cancel()
            sock.close()
            await context.terminated.set()  # idle keep-alive connections close now
            connections.cancel_scope.deadline = anyio.current_time() + config.graceful_timeout

    try:
        # Hypercorn runs the lifespan around the trigger: startup before it, shutdown
        # after it returns, that is once every connection has ended.
        await worker_serve(
            wrapped, config, sockets=Sockets([], [], []), shutdown_trigger=serve_until_shutdown
        )
    finally:
        loads.close()


async def _accept(
    sock: socket.socket,
    loads: ConnectionLoads,
    connections: anyio.abc.TaskGroup,
    serve_connection: Callable[[socket.socket], Coroutine[Any, Any, None]],
) -> None:
    while True:
        await anyio.wait_readable(sock)
        if loads.busier_than_a_live_peer():
            # The same connection woke every API server: leave it to a less busy one.
            with anyio.move_on_after(MAX_YIELD_S):
                while loads.busier_than_a_live_peer() and _waiting(sock):
                    await anyio.sleep(_YIELD_STEP_S)
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            continue  # another API server took it
        except OSError as exc:  # out of file descriptors or buffers: let some close first
            log.warning("accept_failed", error=str(exc))
            await anyio.sleep(_ACCEPT_RETRY_S)
            continue
        loads.opened()
        connections.start_soon(serve_connection, conn)


class _Once:
    """Calls `fn` the first time it is called, never again."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _EofReader:
    """The connection's reader, which reports the connection closed once its client has
    closed it: Hypercorn's connection task lives on after that until its keep-alive idle
    timer ends (up to --keep-alive-timeout), and counting it open meanwhile would steer
    new connections away from an API server that holds none."""

    def __init__(self, reader: asyncio.StreamReader, on_eof: Callable[[], None]) -> None:
        self._reader, self._on_eof = reader, on_eof

    def at_eof(self) -> bool:
        return self._reader.at_eof()

    async def read(self, n: int = -1) -> bytes:
        try:
            data = await self._reader.read(n)
        except BaseException:
            self._on_eof()
            raise
        if not data:
            self._on_eof()
        return data


def _waiting(sock: socket.socket) -> bool:
    """Whether a connection still waits to be accepted."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


async def _beat(loads: ConnectionLoads) -> None:
    while True:
        loads.beat()
        await anyio.sleep(BEAT_INTERVAL_S)
