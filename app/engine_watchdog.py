"""Whether the engine core still answers: a core process sends every front end a Heartbeat
every HEARTBEAT_INTERVAL_S from its event loop (actors/core/engine_core_proc.py), so a core
that is stopped (SIGSTOP), or whose loop is blocked, falls silent. Silent for longer than
the stall bound, it is reported stalled (/health 503 'stalled', new requests 503 +
Retry-After) until it answers again. Silent for FAIL_AFTER_STALL_TIMEOUTS times the bound, it
is reported unresponsive, once per silence: the front end then ends every request in flight
with an error (a core that never resumes would otherwise hold them forever).

Judging by silence rather than by "work pending and no step finished" keeps both rules
the server needs: an idle core still sends heartbeats, so an idle server is never
stalled; and a step runs on the GPU actor's threads, so one long step (a long prefill on
a CPU) does not delay them and cannot trip the bound, however long it takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from actors.protocol.messages import HEARTBEAT_INTERVAL_S

MIN_STALL_TIMEOUT_S = 2 * HEARTBEAT_INTERVAL_S
"""A shorter bound would call a healthy core stalled between two heartbeats."""
FAIL_AFTER_STALL_TIMEOUTS = 2
"""A core silent this many stall bounds is unresponsive: a stall that long is no pause (a
blocked step does not silence the core), and clients waiting on it get an answer instead."""


class EngineWatchdog:
    def __init__(
        self,
        stall_timeout_s: float,
        last_heard_at: Callable[[], float],
        on_stalled: Callable[[float], None],
        on_resumed: Callable[[], None],
        on_unresponsive: Callable[[float], None],
    ) -> None:
        """`last_heard_at()`: time.monotonic() of the core's latest message;
        `on_stalled(silent_s)` and `on_resumed()` are called on each change,
        `on_unresponsive(silent_s)` once per silence that reaches the fail bound."""
        if stall_timeout_s < MIN_STALL_TIMEOUT_S:
            raise ValueError(f"the stall timeout must be at least {MIN_STALL_TIMEOUT_S} s")
        self.stall_timeout_s = stall_timeout_s
        self._last_heard_at = last_heard_at
        self.fail_after_s = FAIL_AFTER_STALL_TIMEOUTS * stall_timeout_s
        self._on_stalled, self._on_resumed = on_stalled, on_resumed
        self._on_unresponsive = on_unresponsive
        self.is_stalled = False
        self.is_unresponsive = False
        self._scope: anyio.CancelScope | None = None
        self._is_stopped = False

    async def run(self) -> None:
        """Check until `stop()`."""
        tick_s = min(HEARTBEAT_INTERVAL_S, self.stall_timeout_s / 4)
        with anyio.CancelScope() as self._scope:
            if self._is_stopped:  # stopped before it ran
                return
            ticked_at = time.monotonic()
            while True:
                await anyio.sleep(tick_s)
                now = time.monotonic()
                was_late = now - ticked_at > 2 * tick_s
                ticked_at = now
                # This front end's own loop was blocked: the core's heartbeats may be
                # waiting unread, so judge at the next tick, once they have been received.
                if not was_late:
                    self.check(now)

    def check(self, now: float) -> None:
        silent_s = now - self._last_heard_at()
        if not self.is_stalled and silent_s > self.stall_timeout_s:
            self.is_stalled = True
            self._on_stalled(silent_s)
        elif self.is_stalled and silent_s <= self.stall_timeout_s:
            self.is_stalled = self.is_unresponsive = False
            self._on_resumed()
        if self.is_stalled and not self.is_unresponsive and silent_s > self.fail_after_s:
            self.is_unresponsive = True
            self._on_unresponsive(silent_s)

    def stop(self) -> None:
        self._is_stopped = True
        if self._scope is not None:
            self._scope.cancel()
