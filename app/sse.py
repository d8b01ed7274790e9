"""Server-sent events for streamed chat and text completions (vLLM's wire format).

    data: {chunk}\\n\\n ... data: [DONE]\\n\\n

This module frames the stream and writes it: the chunks come from a formatter
(app/sse_chunks.py and its chat and completion kinds), the batches from app/sse_pull.py.
An error after the headers is an error event followed by [DONE]. While nothing arrives for
`keep_alive_s` seconds (queued, long prefill) an SSE comment keeps proxies from cutting the
connection.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
import structlog
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from actors.frontend.admitted_group import AdmittedGroup
from actors.frontend.output_stream import StreamDelta
from app.errors import request_failed_error
from app.keep_alive import KeepAliveClock
from app.request_telemetry import RequestTelemetry
from app.responses import ChoiceState
from app.sse_chunks import ChunkFormatter
from app.sse_pull import Batch, pull_batches
from telemetry.logging import bind_request

log = structlog.get_logger("tandem.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"
KEEP_ALIVE_COMMENT = b": keep-alive\n\n"

_UNICODE_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)
"""U+0085, U+2028, U+2029 in UTF-8, and their JSON escapes."""


def sse_event(payload: Any) -> bytes:
    """One `data:` event. JSON leaves U+0085, U+2028 and U+2029 unescaped, and clients that
    split lines the way Python's str.splitlines does (httpx's iter_lines among them) would
    end the line there and read half an event: those three go out escaped."""
    body = orjson.dumps(payload)
    if b"\xe2\x80" in body or b"\xc2\x85" in body:
        for raw, escaped in _UNICODE_LINE_BREAKS:
            body = body.replace(raw, escaped)
    return b"data: " + body + b"\n\n"


@dataclass(frozen=True, slots=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage: bool = False
    keep_alive: KeepAliveClock = field(default_factory=lambda: KeepAliveClock(10.0))
    """The server's clock for keep-alive comments (one timer for every stream)."""


class EventStreamResponse(Response):
    """Streams one admitted request as SSE. The client going away (http.disconnect) cancels
    the writer, and `group.close()` aborts whatever still runs in the engine. `telemetry`,
    when given, is ended once the stream is (finished, failed or disconnected)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        group: AdmittedGroup,
        formatter: ChunkFormatter,
        options: StreamOptions,
        request_id: str,
        headers: dict[str, str] | None = None,
        telemetry: RequestTelemetry | None = None,
    ) -> None:
        # Like StreamingResponse: no body attribute, so no Content-Length header.
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})
        self.group = group
        self.formatter = formatter
        self.options = options
        self.request_id = request_id
        self.telemetry = telemetry
        self._started = [False] * len(group.streams)
        self._failure: str | None = None
        """Why a choice failed, in the engine's words (the stream's error event says it)."""
        self._failure_retryable = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        telemetry = self.telemetry
        completed = False
        with bind_request(self.request_id, None if telemetry is None else telemetry.trace_id):
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status_code,
                        "headers": self.raw_headers,
                    }
                )
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
                    await self._write_events(send)
                    completed = True
                    tg.cancel_scope.cancel()
                # Outside the watcher: once the body is complete the server reports a
                # disconnect, which is no reason to log one.
                if completed:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                log.info("client_disconnected", request_id=self.request_id)
            finally:
                self.group.close()
                if telemetry is not None:
                    telemetry.end(
                        self.formatter.choices,
                        self.formatter.prompt_lens,
                        disconnected=not completed,
                    )

    async def _write_events(self, send: Send) -> None:
        async def send_bytes(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            failed = await pull_batches(
                self.group,
                self.options.keep_alive,
                lambda batch: self._on_batch(batch, send_bytes),
                lambda: send_bytes(KEEP_ALIVE_COMMENT),
            )
        except Exception as exc:
            log.exception("stream_failed", request_id=self.request_id)
            if self.telemetry is not None:
                self.telemetry.failed(exc)
            failed = True
        if failed:
            # The headers are gone: the event's body alone says whether a retry may succeed.
            error = request_failed_error(self.request_id, self._failure, self._failure_retryable)
            await send_bytes(sse_event(error.body()) + DONE_EVENT)
            return
        tail = sse_event(self.formatter.chunk(None)) if self.options.include_usage else b""
        await send_bytes(tail + DONE_EVENT)

    async def _on_batch(self, batch: Batch, send_bytes: Callable[[bytes], Awaitable[None]]) -> bool:
        """Send a batch; True when a choice failed (the stream then ends with an error)."""
        out = bytearray()
        for index, delta in batch:
            choice = self.formatter.choices[index]
            _count(choice, delta)
            if delta.finish_reason == "error":
                log.error("request_failed", request_id=self.request_id, error=delta.error)
                self._failure, self._failure_retryable = delta.error, delta.retryable
                if out:
                    await send_bytes(bytes(out))
                return True
            first = not self._started[index]
            self._started[index] = True
            for chunk in self.formatter.chunks(choice, delta, first):
                out += sse_event(chunk)
        if out:
            await send_bytes(bytes(out))
        return False


def _count(choice: ChoiceState, delta: StreamDelta) -> None:
    choice.num_output_tokens = delta.num_output_tokens
    choice.num_cached_tokens = max(choice.num_cached_tokens, delta.num_cached_tokens)
    if delta.finished:
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        choice.record = delta.record


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            log.info("client_disconnected")
            scope.cancel()
            return
