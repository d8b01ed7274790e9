"""Hostile connections: HTTP/2 (which would let a client hold every response in server
memory by never opening its flow-control window), request smuggling through Content-Length
plus Transfer-Encoding, unknown HTTP versions, and clients that never read their responses
(they must hold no engine capacity; tests/app/test_hostile_send_timeout.py shows them cut).
Each test also checks that /health kept answering within a second and that memory came
back."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import httpx
import pytest

from tests.app._hostile import (
    STALLED,
    connect,
    hostile,
    metric,
    read_until_closed,
    small_send_buffer_server,
    stall,
    wait_until,
)
from tests.app._server_fixtures import RunningServer

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with small_send_buffer_server(max_queued_requests=0, priority_scheduling=True) as running:
        yield running


def _exchange(server: RunningServer, raw: bytes) -> bytes:
    sock = connect(server.url)
    sock.sendall(raw)
    return read_until_closed(sock)


# ---- 2: HTTP/1.1 only --------------------------------------------------------------------


def _settings_frame(**settings: int) -> bytes:
    ids = {"INITIAL_WINDOW_SIZE": 0x4, "MAX_CONCURRENT_STREAMS": 0x3}
    payload = b"".join(struct.pack(">HI", ids[name], value) for name, value in settings.items())
    return struct.pack(">I", len(payload))[1:] + bytes([0x4, 0x0]) + struct.pack(">I", 0) + payload


def test_http2_prior_knowledge_is_refused_and_closed(server: RunningServer) -> None:
    """A client that opens HTTP/2 with a zero flow-control window could park every
    response it asks for in server memory; the server does not speak HTTP/2."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _settings_frame(INITIAL_WINDOW_SIZE=0)
    with hostile(server.url):
        answer = _exchange(server, preface)
    assert answer.startswith(b"HTTP/1.1 505 "), answer[:40]


def test_an_h2c_upgrade_is_served_over_http11(server: RunningServer) -> None:
    request = (
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, HTTP2-Settings"
        b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAQAAAAA\r\n\r\n"
    )
    with hostile(server.url):
        sock = connect(server.url)
        sock.sendall(request)
        sock.settimeout(10)
        answer = sock.recv(65536)
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:40]


@pytest.mark.parametrize("version", [b"HTTP/9.9", b"HTTP/2.0", b"HTTP/1.2"])
def test_an_unknown_http_version_gets_505(server: RunningServer, version: bytes) -> None:
    answer = _exchange(server, b"GET /health " + version + b"\r\nHost: 127.0.0.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 505 "), answer[:40]
    assert b'{"status"' not in answer


# ---- 6: no request smuggling -------------------------------------------------------------


def test_content_length_with_transfer_encoding_is_refused_and_closed(server: RunningServer) -> None:
    body = b'{"prompt": "hi"}'
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    request = (
        b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
        + smuggled
    )
    with hostile(server.url):
        answer = _exchange(server, request)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:40]
    assert answer.count(b"HTTP/1.1") == 1 and b'"object"' not in answer  # one answer only


# ---- 3: a client that never reads holds no engine capacity -----------------------------


def test_clients_that_never_read_hold_no_engine_slot(
    server: RunningServer, http: httpx.Client
) -> None:
    """Two clients fill --max-num-seqs 2 (no queue) and never read. Once the engine has
    finished their answers, which wait to be sent, a third request is admitted."""
    with hostile(server.url):
        stalled = [stall(server, STALLED) for _ in range(2)]
        wait_until(lambda: server.snapshot().num_unfinished_admitted == 2, 30, "not admitted")
        wait_until(
            lambda: (s := server.snapshot()).num_running + s.num_waiting == 0,
            120,
            "the engine did not finish",
        )
        assert server.snapshot().num_unfinished_admitted == 2  # their output waits to be sent
        assert metric(http, "tandem:num_requests_unsent") == 2
        third = http.post(
            CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        )
        assert third.status_code == 200, third.text
        for sock in stalled:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # leave with a reset, as a client that gives up does
        wait_until(lambda: server.snapshot().num_unfinished_admitted == 0, 30, "never released")
        assert metric(http, "tandem:num_requests_unsent") == 0


def test_priority_is_accepted_in_range_once_enabled(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert http.post(CHAT, json={**body, "priority": -3}).status_code == 200
    too_high = http.post(CHAT, json={**body, "priority": 2**31})
    assert too_high.status_code == 400 and too_high.json()["error"]["param"] == "priority"
