"""Misbehaving connections: a client that stops reading its stream stalls nobody else and
holds at most its own output; idle and slow connections are cut by the server's
timeouts; a shutdown during a burst ends every request cleanly."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx
import pytest

from tests.app._hostile import connect
from tests.app._server_fixtures import RunningServer

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def _post_bytes(
    path: str, body: bytes, *, content_length: int | None = None, keep_alive: bool = True
) -> bytes:
    length = len(body) if content_length is None else content_length
    connection = "keep-alive" if keep_alive else "close"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nConnection: {connection}\r\n\r\n"
    )
    return head.encode() + body


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - started


# ---- a client that never reads ---------------------------------------------------------

STALLED = {
    "prompt": "List every word you know:",
    "n": 8,
    "max_tokens": 48,
    "min_tokens": 48,
    "logprobs": 20,
    "stream": True,
}
"""8 samples of big events (20 top logprobs per token), about 0.3 MB."""


async def _others_complete(url: str, num_requests: int) -> list[float]:
    async def one(client: httpx.AsyncClient, index: int) -> float:
        started = time.monotonic()
        response = await client.post(
            CMPL, json={"prompt": f"Fact {index}:", "max_tokens": 8, "ignore_eos": True}
        )
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        return time.monotonic() - started

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return list(await asyncio.gather(*[one(client, i) for i in range(num_requests)]))


def test_a_client_that_stops_reading_stalls_nobody_and_holds_only_its_output() -> None:
    server = RunningServer()
    try:
        stalled = connect(server.url, recv_buffer_bytes=4096)
        stalled.sendall(_post_bytes(CMPL, json.dumps(STALLED).encode()))
        latencies = asyncio.run(_others_complete(server.url, 4))
        # The engine finished the stalled request's samples although nobody read them (it
        # never waits for a reader) and freed their KV blocks and rows.
        snap = _wait_engine_done(server)
        assert snap.num_free_kv_blocks == snap.num_total_kv_blocks
        # What the client has not read is its own output, nothing more: the request's
        # stream buffer holds at most n x max_tokens tokens, and past it only the socket
        # buffers (Hypercorn awaits the transport's drain before it writes more).
        assert max(latencies) < 60
        # Reading now delivers everything that was held back, coalesced.
        data, _ = _read_until_closed_or_done(stalled)
        events = [
            line[len(b"data: ") :] for line in data.split(b"\n") if line.startswith(b"data: ")
        ]
        assert events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        finished = [
            c["choices"][0]["finish_reason"]
            for c in chunks
            if c["choices"] and c["choices"][0]["finish_reason"]
        ]
        assert finished == ["length"] * STALLED["n"]
        assert server.wait_engine_idle().num_unfinished_admitted == 0
    finally:
        server.stop()


def _wait_engine_done(server: RunningServer, timeout_s: float = 60.0) -> Any:
    """The first snapshot with nothing running or waiting (admitted requests whose client
    has not read everything yet may remain)."""
    deadline = time.monotonic() + timeout_s
    while (snap := server.snapshot()).num_running or snap.num_waiting:
        assert time.monotonic() < deadline, snap
        time.sleep(0.05)
    return snap


def _read_until_closed_or_done(sock: socket.socket, timeout_s: float = 60.0) -> tuple[bytes, float]:
    started = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    while b"data: [DONE]" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    return data, time.monotonic() - started


# ---- idle and slow connections ---------------------------------------------------------

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def strict_server() -> Any:
    server = RunningServer(keep_alive_timeout_s=TIMEOUT_S, request_body_timeout_s=TIMEOUT_S)
    yield server
    server.stop()


def test_an_idle_connection_is_closed(strict_server: RunningServer) -> None:
    sock = connect(strict_server.url)
    data, closed_after_s = _read_until_closed(sock, timeout_s=10)
    assert data == b"" and TIMEOUT_S * 0.8 < closed_after_s < TIMEOUT_S + 3


def test_an_idle_keep_alive_connection_is_closed_after_its_request(
    strict_server: RunningServer,
) -> None:
    sock = connect(strict_server.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data, closed_after_s = _read_until_closed(sock, timeout_s=10)
    assert data.startswith(b"HTTP/1.1 200") and closed_after_s < TIMEOUT_S + 3


def test_dribbled_headers_are_cut(strict_server: RunningServer) -> None:
    sock = connect(strict_server.url)
    started = time.monotonic()
    closed = False
    for byte in b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            closed = True
            break
        time.sleep(0.05)
        if time.monotonic() - started > TIMEOUT_S + 3:
            break
    if not closed:
        data, _ = _read_until_closed(sock, timeout_s=5)
        assert b"200" not in data
    assert time.monotonic() - started < TIMEOUT_S + 4


def test_a_stalled_body_gets_408_and_the_connection_closes(strict_server: RunningServer) -> None:
    sock = connect(strict_server.url)
    sock.sendall(_post_bytes(CMPL, b'{"prompt": "hel', content_length=200))
    data, closed_after_s = _read_until_closed(sock, timeout_s=10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert json.loads(body)["error"]["code"] == 408
    assert TIMEOUT_S * 0.8 < closed_after_s < TIMEOUT_S + 3


def test_a_stream_longer_than_the_timeouts_is_not_cut(strict_server: RunningServer) -> None:
    started = time.monotonic()
    body = {
        "messages": [{"role": "user", "content": "Write a poem."}],
        "stream": True,
        "max_tokens": 40,
        "min_tokens": 40,
    }
    lines = []
    with httpx.stream("POST", strict_server.url + CHAT, json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert time.monotonic() - started > TIMEOUT_S  # it really outlived the timeouts


# ---- shutdown during a burst -----------------------------------------------------------

BURST_MAX_TOKENS = (1000, 2, 20, 40)
"""1000 tokens cannot finish within the drain (aborted), 2 always do; the rest either."""


async def _burst_then_shutdown(server: RunningServer, num_requests: int) -> list[Any]:
    async def one(client: httpx.AsyncClient, index: int) -> Any:
        fields = {"max_tokens": BURST_MAX_TOKENS[index % 4], "ignore_eos": True}
        if index % 2:
            response = await client.post(CMPL, json={"prompt": f"Item {index}:", **fields})
            return response.status_code, response.json()
        body = {
            "messages": [{"role": "user", "content": f"Item {index}"}],
            "stream": True,
            **fields,
        }
        async with client.stream("POST", CHAT, json=body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            return response.status_code, lines

    limits = httpx.Limits(max_connections=num_requests)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(num_requests)]
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(server.snapshot)).num_unfinished_admitted < num_requests:
            assert time.monotonic() < deadline, "the burst was not admitted"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        server.server.request_shutdown()  # what SIGTERM does
        return list(await asyncio.gather(*tasks, return_exceptions=True))


def test_shutdown_during_a_burst_ends_every_request_cleanly() -> None:
    # Long enough for the 2-token requests to finish even when a loaded machine makes the
    # burst's first prefill step take seconds; far too short for 1000 tokens.
    server = RunningServer(shutdown_timeout_s=6.0)
    results = asyncio.run(_burst_then_shutdown(server, 24))
    deadline = time.monotonic() + 60
    while server.exit_code is None and time.monotonic() < deadline:
        time.sleep(0.05)
    finish_reasons: dict[int, list[str]] = {}
    for index, result in enumerate(results):
        assert not isinstance(result, BaseException), repr(result)
        status, payload = result
        assert status == 200, payload  # all were admitted before the drain began
        if isinstance(payload, dict):
            reasons = [c["finish_reason"] for c in payload["choices"]]
        else:
            assert payload[-1] == "data: [DONE]"
            chunks = [json.loads(line[len("data: ") :]) for line in payload[:-1]]
            reasons = [
                c["choices"][0]["finish_reason"]
                for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]
            ]
        finish_reasons[index] = reasons
    assert all(len(reasons) == 1 for reasons in finish_reasons.values()), finish_reasons
    for index, (reason,) in finish_reasons.items():
        expected = {1000: {"abort"}, 2: {"length"}}.get(
            BURST_MAX_TOKENS[index % 4], {"length", "abort"}
        )
        assert reason in expected, (index, reason)
    assert server.exit_code == 0
