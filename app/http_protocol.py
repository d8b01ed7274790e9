"""The HTTP/1.1 connection protocol `tandem serve` runs inside Hypercorn.

Hypercorn speaks HTTP/2 on a cleartext port to any client that asks (`PRI * HTTP/2.0`
prior knowledge, or `Upgrade: h2c`), and offers no setting to turn that off. An HTTP/2
client that never opens its flow-control window makes every response wait in server
memory for as long as it stays connected. tandem therefore speaks HTTP/1.1 only (HTTP/2
belongs in the load balancer in front of it) and replaces Hypercorn's HTTP/1.1 protocol
with a stricter one:

- A request line whose version is not HTTP/1.0 or HTTP/1.1 (HTTP/2.0 prior knowledge,
  HTTP/9.9) is answered 505 and the connection closed.
- `Upgrade: h2c` is ignored (RFC 9110 section 7.8 lets a server ignore Upgrade): the
  request is served over HTTP/1.1.
- A request with both Content-Length and Transfer-Encoding is answered 400 and the
  connection closed (RFC 9112 section 6.1), so bytes smuggled after its body never run as
  a second request.
- A response write that makes no progress for `send_timeout` seconds (the client stopped
  reading) aborts the connection: its buffered output is dropped at once and the request
  sees a disconnect. Large bodies are written in pieces, so the timeout bounds the time
  between two writes the client accepts, not the whole transfer.

`install()` puts the protocol in place; Hypercorn constructs it for each connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import hypercorn.protocol
import structlog
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed
from hypercorn.protocol.events import Body, Event
from hypercorn.protocol.h11 import H11Protocol

log = structlog.get_logger("tandem.server")

HTTP_VERSIONS = (b"1.0", b"1.1")
WRITE_PIECE_BYTES = 64 * 1024
"""Bodies are written in pieces of at most this size (asyncio's default high-water mark),
so each write waits only for the client to take about one piece."""


class TandemHypercornConfig(HypercornConfig):
    send_timeout: float | None = 60.0
    """Seconds one response write may wait for the client to take data; None: no limit."""


class StrictH11Connection(h11.Connection):
    """h11 with the request checks RFC 9112 asks of a server and h11 leaves to it."""

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            if event.http_version not in HTTP_VERSIONS:
                raise h11.RemoteProtocolError(
                    f"HTTP/{event.http_version.decode('ascii', 'replace')} is not supported",
                    error_status_hint=505,
                )
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                raise h11.RemoteProtocolError(
                    "Content-Length and Transfer-Encoding together", error_status_hint=400
                )
            if _asks_for_h2c(event.headers):
                event = h11.Request(
                    method=event.method,
                    target=event.target,
                    http_version=event.http_version,
                    headers=[(n, v) for n, v in event.headers if n != b"upgrade"],
                )
        return event


def _asks_for_h2c(headers: Any) -> bool:
    return any(name == b"upgrade" and value.strip().lower() == b"h2c" for name, value in headers)


class Http11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol on a StrictH11Connection, with a send timeout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection = StrictH11Connection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )
        self._send_timeout_s: float | None = getattr(self.config, "send_timeout", None)
        self._aborted = False

    async def stream_send(self, event: Event) -> None:
        if self._aborted:  # the client stopped reading: what the request still sends is dropped
            return
        if isinstance(event, Body) and len(event.data) > WRITE_PIECE_BYTES:
            data = event.data
            for start in range(0, len(data), WRITE_PIECE_BYTES):
                piece = Body(
                    stream_id=event.stream_id, data=data[start : start + WRITE_PIECE_BYTES]
                )
                if not await self._send_within_timeout(piece):
                    return
            return
        await self._send_within_timeout(event)

    async def _send_within_timeout(self, event: Event) -> bool:
        try:
            async with asyncio.timeout(self._send_timeout_s):
                await super().stream_send(event)
        except TimeoutError:
            log.info("send_timeout", timeout_s=self._send_timeout_s, client=_peer(self.client))
            await self._abort()
            return False
        return True

    async def _abort(self) -> None:
        """Drop the connection and everything buffered for it; the request's task sees a
        disconnect. A graceful close would wait for the client to read that buffer."""
        self._aborted = True
        writer = getattr(getattr(self.send, "__self__", None), "writer", None)
        if writer is not None:
            writer.transport.abort()
        await self.handle(Closed())


def _peer(client: tuple[str, int] | None) -> str | None:
    return None if client is None else f"{client[0]}:{client[1]}"


def install() -> None:
    """Make Hypercorn build `Http11Protocol` for every connection (idempotent)."""
    if not hasattr(hypercorn.protocol, "H11Protocol"):
        raise RuntimeError(
            "this Hypercorn version builds its HTTP/1.1 protocol elsewhere; "
            "tandem cannot restrict it to HTTP/1.1"
        )
    hypercorn.protocol.H11Protocol = Http11Protocol  # type: ignore[misc]
