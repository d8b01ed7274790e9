"""Whether an API server of `tandem serve --api-server-count N` still answers: each one
writes a byte to a pipe of its own every HEARTBEAT_INTERVAL_S from its event loop, and the
supervisor reads them. An API server that is stopped (SIGSTOP) or whose loop is blocked
falls silent; silent for longer than `--api-server-stall-timeout`, the supervisor kills
it and starts another (app/supervisor.py).

A pipe rather than an HTTP probe: the API servers share one listening socket, so a probe
through it reaches whichever process accepts, never a chosen one; and a pipe's bytes wait
in the kernel, so a supervisor that was itself late reads them before it judges.
"""

from __future__ import annotations

import os

import anyio

from actors.protocol.messages import HEARTBEAT_INTERVAL_S

MIN_API_SERVER_STALL_TIMEOUT_S = 2 * HEARTBEAT_INTERVAL_S
"""A shorter bound would call a healthy API server silent between two heartbeats."""
START_GRACE_S = 120.0
"""How long an API server may take to its first heartbeat (imports, tokenizer load) before
the stall bound applies; a longer stall bound applies from the start."""


async def send_heartbeats(fd: int) -> None:
    """The API server's side: a byte every HEARTBEAT_INTERVAL_S until cancelled."""
    os.set_blocking(fd, False)
    try:
        while True:
            try:
                os.write(fd, b".")
            except BlockingIOError:
                pass  # the pipe is full: the supervisor has unread heartbeats enough
            except BrokenPipeError:
                return  # the supervisor is gone (and this process goes with it)
            await anyio.sleep(HEARTBEAT_INTERVAL_S)
    finally:
        os.close(fd)


class HeartbeatReader:
    """The supervisor's side, for one API server: `silent_s(now)` after reading what came."""

    def __init__(self, fd: int, started_at: float, stall_timeout_s: float) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.stall_timeout_s = stall_timeout_s
        self._started_at = started_at
        self._last_heard_at: float | None = None

    def read(self, now: float) -> None:
        """Take every byte waiting in the pipe; any byte means the API server was heard."""
        heard = False
        while True:
            try:
                data = os.read(self.fd, 4096)
            except BlockingIOError:
                break
            if not data:  # the writer closed: the process is exiting, poll() will say so
                break
            heard = True
        if heard:
            self._last_heard_at = now

    def is_silent_too_long(self, now: float) -> bool:
        """Silent beyond the stall bound (before the first heartbeat: beyond
        max(bound, START_GRACE_S) since the start)."""
        if self.stall_timeout_s <= 0:
            return False
        if self._last_heard_at is None:
            return now - self._started_at > max(self.stall_timeout_s, START_GRACE_S)
        return now - self._last_heard_at > self.stall_timeout_s

    def silent_s(self, now: float) -> float:
        return now - (self._last_heard_at or self._started_at)

    def close(self) -> None:
        os.close(self.fd)
