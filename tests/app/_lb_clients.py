"""Clients for tests/app/test_load_balancers.py: a stream timed as it arrives, a stream held
open unread, steady traffic that records every request that did not complete, and a wait
for a balancer's log line."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.app._load_balancers import BalancerProcess

_PROMPT = [1, 2, 3]


class TimedStream:
    """A streamed completion read as it arrives (`run()`, in any thread): when its first
    token and its end arrived, how many tokens it had, and the error its client saw."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.first_token = threading.Event()
        self.first_token_at = 0.0
        self.done_at = 0.0
        self.num_tokens = 0
        self.completed = False
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "prompt": _PROMPT,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}"
                    return
                for line in r.iter_lines():
                    self._take(line)
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def _take(self, line: str) -> None:
        if line == "data: [DONE]":
            self.completed = True
            self.done_at = time.monotonic()
        elif line.startswith("data: "):
            chunk: dict[str, Any] = json.loads(line[len("data: ") :])
            if "error" in chunk:
                self.error = str(chunk["error"])
            elif chunk["choices"] and not self.first_token.is_set():
                self.first_token_at = time.monotonic()
                self.first_token.set()
            elif chunk.get("usage"):
                self.num_tokens = chunk["usage"]["completion_tokens"]


class HeldStream:
    """A streamed completion on a raw connection, read only when asked: it keeps its slot
    on the server until it is closed (the server then aborts it)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        address = urlsplit(url)
        self.sock = socket.create_connection((address.hostname, address.port), timeout=30)
        body = json.dumps(
            {"prompt": _PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        ).encode()
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json"
            + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"\ndata: " not in received:  # its first token
            data = self.sock.recv(65536)
            assert data, f"the server closed the stream: {received!r}"
            received += data
        assert received.startswith(b"HTTP/1.1 200"), received[:200]

    def read_more(self) -> bytes:
        """What the server sends from now on (what it sent before is skipped)."""
        self.sock.setblocking(False)
        try:
            while self.sock.recv(65536):
                pass
        except BlockingIOError:
            pass
        self.sock.settimeout(30)
        return self.sock.recv(65536)

    def close(self) -> None:
        self.sock.close()


class Traffic:
    """Small completions back to back through each URL in turn, in a thread, from the
    `with` block's start to its end; every one that did not complete is recorded."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.num_sent = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def wait_for(self, num_sent: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_sent < num_sent:
            assert time.monotonic() < deadline, f"only {self.num_sent} requests went out"
            time.sleep(0.02)

    def assert_all_completed(self) -> None:
        assert not self.failures, self.failures

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                url = self.urls[self.num_sent % len(self.urls)]
                body = {"prompt": [*_PROMPT, self.num_sent], "max_tokens": 2, "ignore_eos": True}
                try:
                    response = client.post(url + "/v1/completions", json=body)
                    if response.status_code != 200:
                        self.failures.append(f"{url}: {response.status_code} {response.text}")
                    elif response.json()["usage"]["completion_tokens"] != 2:
                        self.failures.append(f"{url}: {response.text}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{url}: {exc!r}")
                self.num_sent += 1


def wait_for_log(balancer: BalancerProcess, pattern: str, timeout_s: float) -> float:
    """Seconds until `balancer` logged a line matching `pattern` (fails after timeout_s)."""
    started = time.monotonic()
    while re.search(pattern, balancer.log()) is None:
        assert time.monotonic() - started < timeout_s, (
            f"no {pattern!r} in {timeout_s} s:\n{balancer.log()[-2000:]}"
        )
        time.sleep(0.05)
    return time.monotonic() - started
