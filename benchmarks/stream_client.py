"""One streamed request, timed: the POST, its Server-Sent Events split into lines, each event
handed to a benchmarks.serve_metrics.StreamTimeline (which turns arrival times into TTFT,
ITL and the rest), and the Authorization header every benchmark client sends."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson

from benchmarks.serve_metrics import RequestResult, StreamTimeline


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The response's lines as Server-Sent Events end them: at LF or CRLF. (httpx's
    aiter_lines also ends a line at U+2028, U+2029 and U+0085, which a JSON string may
    hold unescaped: it would cut such an event in two.)"""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


async def stream_request(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    on_event: Callable[[dict[str, Any]], None] | None = None,
    by_text: bool = False,
) -> RequestResult:
    """POST one streamed request and time its SSE events; never raises for a bad answer.
    `on_event` also sees every decoded event (benchmarks.multi_turn_chat keeps the text);
    `by_text`: see StreamTimeline."""
    timeline = StreamTimeline(sent_s=time.perf_counter(), by_text=by_text)
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return RequestResult(success=False, error=f"HTTP {response.status_code}: {detail}")
            async for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue  # blank separators and ': keep-alive' comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                at_s, event = time.perf_counter(), orjson.loads(data)
                timeline.on_event(at_s, event)
                if on_event is not None:
                    on_event(event)
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        return RequestResult(success=False, error=f"{type(exc).__name__}: {exc}")
    return timeline.result()
