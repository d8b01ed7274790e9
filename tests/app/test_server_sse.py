"""The SSE bytes on the wire: framing, role/finish/usage chunks, [DONE], keep-alive comments
while a request waits, and the in-band error event."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from actors.frontend.output_stream import RequestStream
from app.keep_alive import KeepAliveClock
from app.responses import ChoiceState, ResponseMeta
from app.sse import EventStreamResponse, StreamOptions, sse_event
from app.sse_chat_chunks import ChatChunkFormatter
from tests.app._server_fixtures import ENGINE, RunningServer

pytestmark = pytest.mark.slow

KEEP_ALIVE_S = 0.05
MESSAGES = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    # One running request at a time, so a second one provably waits in the queue.
    running = RunningServer(
        engine=ENGINE.replace(max_num_seqs=1), keep_alive_interval_s=KEEP_ALIVE_S
    )
    yield running
    running.stop()


def _stream_bytes(url: str, body: dict[str, Any]) -> tuple[httpx.Headers, bytes]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        return response.headers, b"".join(response.iter_raw())


def _events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    return raw[:-2].split(b"\n\n")


def test_sse_framing_role_finish_usage_done(server: RunningServer) -> None:
    headers, raw = _stream_bytes(
        server.url,
        {
            "messages": MESSAGES,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    events = [e for e in _events(raw) if not e.startswith(b":")]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["choices"][0]["finish_reason"] is None
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    assert all("usage" not in c for c in chunks[:-1])
    assert len({(c["id"], c["created"], c["object"]) for c in chunks}) == 1


def test_keep_alive_comments_while_queued(server: RunningServer) -> None:
    long_body = {
        "messages": MESSAGES,
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    first_started = threading.Event()

    def run_first() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json=long_body, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first_started.set()

    thread = threading.Thread(target=run_first)
    thread.start()
    assert first_started.wait(60)
    _, raw = _stream_bytes(server.url, {**long_body, "max_tokens": 2})
    thread.join(120)
    events = _events(raw)
    first_data = next(i for i, e in enumerate(events) if e.startswith(b"data: "))
    # The second request waited behind the first: comments came before its first chunk.
    assert first_data >= 3 and all(e == b": keep-alive" for e in events[:first_data])
    assert events[-1] == b"data: [DONE]"


class _FailingGroup:
    """Stands in for an admitted request whose engine step failed after one token."""

    def __init__(self) -> None:
        self.streams = [RequestStream("r-0", num_prompt_tokens=3)]
        self.closed = False
        self.streams[0].push((11,), "Hi")
        self.streams[0].push(finish_reason="error", error="step failed")

    async def get(self, index: int) -> Any:
        return await self.streams[index].get()

    def close(self) -> None:
        self.closed = True


def test_error_after_headers_is_an_error_event_then_done() -> None:
    group = _FailingGroup()
    meta = ResponseMeta("chatcmpl-x", int(time.time()), "m")
    choices = [ChoiceState(index=0)]
    response = EventStreamResponse(
        group,
        ChatChunkFormatter(meta, [3], choices, False),  # type: ignore[arg-type]
        StreamOptions(keep_alive=KeepAliveClock(0)),
        "req-1",
    )
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        return {}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    anyio.run(response, {"type": "http"}, receive, send)
    raw = b"".join(m.get("body", b"") for m in sent[1:])
    events = _events(raw)
    assert sent[0]["status"] == 200
    error = json.loads(events[-2][len(b"data: ") :])["error"]
    assert error["code"] == 500 and "req-1" in error["message"]
    assert events[-1] == b"data: [DONE]" and group.closed


def test_unicode_line_breaks_go_out_escaped() -> None:
    # JSON may carry U+0085, U+2028 and U+2029 raw; clients that split lines as
    # str.splitlines does (httpx's iter_lines) would cut the event there.
    text = "a\u2028b\x85c\u2029d \u201cquoted\u201d \u2026"
    event = sse_event({"choices": [{"delta": {"content": text}}]})
    lines = event.decode().splitlines()
    assert lines[1:] == [""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :])["choices"][0]["delta"]["content"] == text
    assert "\u201c" in event.decode()  # other characters stay as they are
