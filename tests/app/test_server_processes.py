"""`tandem serve` as processes: the engine core in its own process, one or more API
servers in front. A dead engine ends every stream at once and turns /health 'dead'; no
child outlives the server; several API servers answer on one port and /metrics from any
of them covers all."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.app._serve_process import ServeProcess, alive, health

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Count to one hundred."}]}


def _stream_events(url: str, body: dict[str, Any], on_first: Any) -> tuple[list[str], float]:
    """The SSE data lines of one streamed chat; `on_first()` runs after the first content
    chunk. Returns the lines and when the stream ended (time.monotonic())."""
    lines: list[str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 2:
                    on_first()
    return lines, time.monotonic()


def test_engine_killed_mid_stream_ends_streams_with_errors_and_health_says_dead(
        tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "serve.log")
    engine_pid = server.engine_pid()
    assert engine_pid in server.descendants() and engine_pid != server.proc.pid
    killed_at: list[float] = []
    non_stream: dict[str, Any] = {}

    def request_without_streaming() -> None:
        response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                              json={**CHAT, "max_tokens": 400, "ignore_eos": True})
        non_stream.update(status=response.status_code, at=time.monotonic())

    waiting = threading.Thread(target=request_without_streaming)
    waiting.start()

    def kill_engine() -> None:
        killed_at.append(time.monotonic())
        os.kill(engine_pid, signal.SIGKILL)

    try:
        lines, ended_at = _stream_events(
            server.url, {**CHAT, "max_tokens": 400, "ignore_eos": True}, kill_engine)
        waiting.join(timeout=30)
        assert ended_at - killed_at[0] < 1.0, "the stream outlived the engine by over a second"
        assert lines[-1] == "[DONE]" and '"error"' in lines[-2]
        assert non_stream["status"] == 500 and non_stream["at"] - killed_at[0] < 1.0
        response = httpx.get(server.url + "/health", timeout=5)
        assert (response.status_code, response.json()["status"]) == (503, "dead")
        refused = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
    finally:
        exit_code = server.stop()
    assert exit_code == 1  # an engine that died makes the server exit non-zero
    assert not server.descendants()


def test_a_killed_server_takes_its_engine_core_with_it(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "serve.log")
    engine_pid = server.engine_pid()
    server.proc.kill()
    server.proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(engine_pid), "the engine core outlived the server"


def _metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


def test_two_api_servers_answer_on_one_port_and_metrics_cover_both(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "serve.log", "--api-server-count", "2")
    try:
        supervisor_children = server.descendants()
        assert len(supervisor_children) == 3  # one engine core, two API servers
        answered_by: set[int] = set()
        num_tokens = 0
        for attempt in range(60):  # a new connection each time: either process accepts it
            version = httpx.get(server.url + "/version", timeout=10).json()
            answered_by.add(version["api_server"])
            response = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": [1, 2, 3, attempt], "max_tokens": 3, "ignore_eos": True})
            assert response.status_code == 200
            num_tokens += response.json()["usage"]["completion_tokens"]
            if answered_by == {0, 1} and attempt >= 3:
                break
        assert answered_by == {0, 1}, "one API server never answered"
        scraped_by: set[int] = set()
        for _ in range(60):
            scraped_by.add(httpx.get(server.url + "/version", timeout=10).json()["api_server"])
            text = httpx.get(server.url + "/metrics", timeout=10).text
            assert _metric(text, "vllm:generation_tokens_total") == num_tokens
            if len(scraped_by) == 2:
                break
        lines = server.lines()
        assert {line.get("process") for line in lines} >= {"supervisor", "engine_core",
                                                             "api_server_0", "api_server_1"}
        _an_api_server_that_dies_is_restarted(server)
    finally:
        exit_code = server.stop()
    assert exit_code == 0
    assert not server.descendants()
    assert health(server.url) is None  # the port is closed


def _api_server_pids(server: ServeProcess) -> dict[int, int]:
    return {int(line["process"].rsplit("_", 1)[1]): int(line["pid"]) for line in server.lines()
            if str(line.get("process", "")).startswith("api_server_")}


def _an_api_server_that_dies_is_restarted(server: ServeProcess) -> None:
    victim = _api_server_pids(server)[1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = _api_server_pids(server)
        restarted = pids.get(1) not in (None, victim) and any(
            line.get("event") == "engine_ready" and line.get("pid") == pids[1]
            for line in server.lines())
        if restarted:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the killed API server was not restarted")
    assert any(line.get("event") == "api_server_died_restarting" for line in server.lines())
    answered_by = {httpx.get(server.url + "/version", timeout=10).json()["api_server"]
                   for _ in range(40)}
    assert answered_by == {0, 1}
