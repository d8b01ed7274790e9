"""SIGTERM drain of a real `tandem serve` process: in-flight requests finish (or are aborted
at --shutdown-timeout with finish_reason "abort"), new work is refused, exit code 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.server import drain_bound_s
from tests._embedded_model import embedded_gguf_path

pytestmark = pytest.mark.slow

SHUTDOWN_TIMEOUT_S = 8.0  # room for a 10-token request on a loaded 2-core machine
ENGINE_STOP_S = 3.0
"""After the drain, the engine core's stop and the process's exit (about half a second)."""
_START_TIMEOUT_S = 180.0


def _start_server(log_path: Path) -> tuple[subprocess.Popen[bytes], str, list[int | None]]:
    """Start `tandem serve`; returns the process, its URL and the /health statuses seen
    while it started. Skips the test where the embedded model is not installed."""
    embedded_gguf_path()
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-model-len",
            "2048",
            "--max-num-batched-tokens",
            "512",
            "--log-format",
            "json",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log_file,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + _START_TIMEOUT_S
    url = None
    statuses: list[int | None] = []
    while time.monotonic() < deadline and proc.poll() is None:
        if url is None:
            url = _listening_url(log_path)
        else:
            statuses.append(_health(url))
            if statuses[-1] == 200:
                return proc, url, statuses
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log_path.read_text()[-3000:]}")


def _listening_url(log_path: Path) -> str | None:
    for line in log_path.read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "server_listening":
                return str(event["url"])
    return None


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def _health_once_it_changes(url: str, timeout_s: float = 10.0) -> httpx.Response:
    """The first /health answer that is not 200 (the signal takes a moment to arrive)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(url + "/health", timeout=5)
        if response.status_code != 200 or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


class _Stream(threading.Thread):
    """One streamed chat request, recording its chunks and whether it saw [DONE]."""

    def __init__(self, url: str, **fields: Any) -> None:
        super().__init__(daemon=True)
        self.url, self.fields = url, fields
        self.chunks: list[dict[str, Any]] = []
        self.done = False
        self.first_chunk = threading.Event()

    def run(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "stream": True,
            "temperature": 0,
            **self.fields,
        }
        with httpx.stream(
            "POST", self.url + "/v1/chat/completions", json=body, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.chunks.append(json.loads(line[len("data: ") :]))
                    self.first_chunk.set()

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c["choices"][0]["finish_reason"]
            for c in self.chunks
            if c["choices"] and c["choices"][0]["finish_reason"]
        ]


def test_sigterm_drains_then_exits_zero(tmp_path: Path) -> None:
    proc, url, statuses = _start_server(tmp_path / "server.log")
    # The port answered while the model loaded: 503 first, then 200.
    assert statuses[0] == 503 and statuses[-1] == 200
    try:
        short = _Stream(url, max_tokens=10, ignore_eos=True)
        endless = _Stream(url, max_tokens=1500, min_tokens=1500)
        short.start()
        endless.start()
        assert short.first_chunk.wait(60) and endless.first_chunk.wait(60)
        signalled_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # While requests are in flight the listener stays open: probes read "draining" and
        # new work is refused with 503 + Retry-After, not with a closed port.
        health = _health_once_it_changes(url)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert health.headers.get("retry-after")
        refused = httpx.post(
            url + "/v1/chat/completions",
            timeout=10,
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        )
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        assert refused.json()["error"]["code"] == 503
        short.join(60)
        endless.join(60)
        exit_code = proc.wait(timeout=60)
        exited_after_s = time.monotonic() - signalled_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert short.done and short.finish_reasons == ["length"]
    assert (
        sum(1 for c in short.chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
        >= 1
    )
    assert endless.done and endless.finish_reasons == ["abort"]
    assert exit_code == 0
    assert (
        SHUTDOWN_TIMEOUT_S - 0.5
        < exited_after_s
        < drain_bound_s(SHUTDOWN_TIMEOUT_S) + ENGINE_STOP_S
    )


def test_serve_help_lists_every_server_flag_with_its_environment_variable() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--api-key",
        "--max-queued-requests",
        "--max-queued-prompt-tokens",
        "--max-request-body-bytes",
        "--keep-alive-interval",
        "--shutdown-timeout",
        "--clamp-max-tokens",
        "--log-level",
        "--log-format",
        "--engine-stall-timeout",
        "--max-model-len",
        "--runner",
    ):
        assert flag in text
        if flag not in ("--max-model-len", "--runner"):
            assert "TANDEM_" + flag[2:].upper().replace("-", "_") in text, flag
