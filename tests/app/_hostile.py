"""What every hostile-input test asserts besides its own answer: while the hostile request
runs, GET /health keeps answering within a second, and afterwards the test process's
resident memory (the in-process server runs in it) comes back near where it was."""

from __future__ import annotations

import gc
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

import app.server
from benchmarks.soak_server import resident_bytes
from tests.app._server_fixtures import ENGINE, RunningServer

MAX_HEALTH_S = 2.0
"""The freezes these tests guard against held /health for 4-27 s; on a quiet machine it
answers within 0.1 s, and on two shared cores beside a second test worker scheduling alone
has delayed it 1.2 s."""
RSS_SLACK_BYTES = 150 * 1024 * 1024
"""Allocator caches and the engine's own buffers move RSS by tens of MiB; the defects these
tests guard against moved it by hundreds of MiB to gigabytes."""
_RSS_SETTLE_S = 10.0


class HealthProbe:
    """GETs /health back to back in a thread; records the slowest answer and any non-200."""

    def __init__(self, url: str, interval_s: float = 0.02) -> None:
        self.url = url
        self.interval_s = interval_s
        self.max_latency_s = 0.0
        self.num_probes = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def wait_for_probes(self, num_probes: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_probes < num_probes:
            assert time.monotonic() < deadline, "/health did not answer"
            time.sleep(0.01)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    status = client.get(self.url + "/health").status_code
                except httpx.HTTPError as exc:
                    status = -1
                    self.failures.append(repr(exc))
                latency_s = time.monotonic() - started
                self.max_latency_s = max(self.max_latency_s, latency_s)
                self.num_probes += 1
                if status != 200 and status != -1:
                    self.failures.append(f"/health answered {status}")
                self._stop.wait(self.interval_s)


@contextmanager
def hostile(url: str) -> Iterator[HealthProbe]:
    """Run the block (the hostile request) under a HealthProbe, then check /health stayed
    quick and RSS came back within RSS_SLACK_BYTES of its value before the block."""
    gc.collect()
    baseline = resident_bytes(os.getpid())
    with HealthProbe(url) as probe:
        probe.wait_for_probes(1)  # probing before the hostile request starts
        yield probe
        probe.wait_for_probes(probe.num_probes + 1)  # and one probe after it
    assert not probe.failures, probe.failures
    assert probe.max_latency_s < MAX_HEALTH_S, f"/health took {probe.max_latency_s:.2f} s"
    deadline = time.monotonic() + _RSS_SETTLE_S
    while (grown := resident_bytes(os.getpid()) - baseline) > RSS_SLACK_BYTES:
        assert time.monotonic() < deadline, f"RSS stayed {grown / 2**20:.0f} MiB above baseline"
        gc.collect()
        time.sleep(0.2)


def connect(url: str, recv_buffer_bytes: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if recv_buffer_bytes is not None:  # before connect, so the window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer_bytes)
    sock.connect((host, int(port)))
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return data


# ---- clients that never read -------------------------------------------------------------

SEND_BUFFER_BYTES = 8192
"""The server's kernel send buffer in tests with stalled clients. On loopback Linux lets one
grow to megabytes, more than a small model's whole answer; a real network path holds far
less. With a small one, a client that stops reading stalls the server's writer within
about 100 kB."""
STALLED = {
    "messages": [{"role": "user", "content": "Count to a thousand."}],
    "stream": True,
    "max_tokens": 100,
    "min_tokens": 100,
    "logprobs": True,
    "top_logprobs": 20,
}
"""About 1.8 kB of events per token: the writer stalls well before the engine is done."""


def small_send_buffer_server(**settings: Any) -> RunningServer:
    """A server (max_num_seqs 2) whose connections have a SEND_BUFFER_BYTES send buffer."""
    real_bind = app.server.bind_listening_socket

    def bind_small_send_buffer(host: str, port: int) -> socket.socket:
        sock = real_bind(host, port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        return sock  # accepted connections inherit the listener's buffer size

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app.server, "bind_listening_socket", bind_small_send_buffer)
        return RunningServer(engine=ENGINE.replace(max_num_seqs=2), **settings)


def stall(server: RunningServer, body: dict[str, Any]) -> socket.socket:
    """A client that sends a streamed chat request and never reads the answer."""
    data = json.dumps(body).encode()
    sock = connect(server.url, recv_buffer_bytes=4096)
    sock.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        + data
    )
    return sock


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not exported")


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
