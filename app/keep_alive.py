"""One clock for every open stream's keep-alive comments.

A stream that sends nothing for `interval_s` (queued, long prefill) must send an SSE
comment so that proxies keep the connection. Arming a timer around every read costs a
cancel scope and a timer-heap entry per chunk, which adds up to a large share of a busy
server's CPU; instead one task wakes every second and pokes the readers of the streams
that have been quiet for `interval_s`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import anyio

from actors.frontend.output_stream import RequestStream

_TICK_S = 1.0


class KeepAliveClock:
    def __init__(self, interval_s: float) -> None:
        """`interval_s` 0 turns keep-alives off."""
        self.interval_s = interval_s if interval_s > 0 else math.inf
        self._last_sent: dict[RequestStream, float] = {}

    @contextlib.contextmanager
    def watching(self, stream: RequestStream) -> Iterator[None]:
        """Watch `stream` for the duration of its response."""
        self._last_sent[stream] = time.monotonic()
        try:
            yield
        finally:
            self._last_sent.pop(stream, None)

    def sent(self, stream: RequestStream) -> None:
        """The response just sent something (a chunk or a comment)."""
        if stream in self._last_sent:
            self._last_sent[stream] = time.monotonic()

    async def run(self) -> None:
        """Poke quiet streams until cancelled (the server's lifespan owns this task)."""
        if math.isinf(self.interval_s):
            return
        while True:
            await anyio.sleep(min(_TICK_S, self.interval_s))
            now = time.monotonic()
            for stream, last_sent in list(self._last_sent.items()):
                if now - last_sent >= self.interval_s:
                    self._last_sent[stream] = now
                    stream.poke()
