"""`tandem serve` as processes: the engine core in its own process, one or more API
servers in front. A dead engine ends every stream at once and turns /health 'dead'; a
stopped one turns it 'stalled' until it runs again; no child outlives the server, and no
ipc folder either, however it ends; whatever another local process writes to the
engine's socket, the core keeps serving; several API servers answer on one port and
/metrics from any of them covers all, the requests a killed one held included."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.actors._hostile_peer import send_hostile_frames
from tests.app._api_servers import (
    StreamInThread,
    abort_count,
    answering_api_servers,
    clients_of_api_server,
    kill_api_server_and_wait_for_its_successor,
)
from tests.app._serve_process import ROOT, ServeProcess, alive, health

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Count to one hundred."}]}
STALL_TIMEOUT_S = 2.0
_TICK_S = 0.5
"""How often a watchdog looks, and the engine core's heartbeat interval."""


def _stream_events(url: str, body: dict[str, Any], on_first: Any) -> tuple[list[str], float]:
    """The SSE data lines of one streamed chat; `on_first()` runs after the first content
    chunk. Returns the lines and when the stream ended (time.monotonic())."""
    lines: list[str] = []
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 2:
                    on_first()
    return lines, time.monotonic()


def _ipc_folders(tmp_path: Path) -> list[Path]:
    """What a server started with TMPDIR=tmp_path left of its ipc folders."""
    return list(tmp_path.glob("tandem-*"))


def test_engine_killed_mid_stream_ends_streams_with_errors_and_health_says_dead(
    tmp_path: Path,
) -> None:
    server = ServeProcess(tmp_path / "serve.log", env={"TMPDIR": str(tmp_path)})
    engine_pid = server.engine_pid()
    assert engine_pid in server.descendants() and engine_pid != server.proc.pid
    killed_at: list[float] = []
    non_stream: dict[str, Any] = {}

    def request_without_streaming() -> None:
        response = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=60,
            json={**CHAT, "max_tokens": 400, "ignore_eos": True},
        )
        non_stream.update(status=response.status_code, at=time.monotonic())

    waiting = threading.Thread(target=request_without_streaming)
    waiting.start()

    def kill_engine() -> None:
        killed_at.append(time.monotonic())
        os.kill(engine_pid, signal.SIGKILL)

    try:
        lines, ended_at = _stream_events(
            server.url, {**CHAT, "max_tokens": 400, "ignore_eos": True}, kill_engine
        )
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
    assert not _ipc_folders(tmp_path)


def test_a_killed_server_takes_its_engine_core_with_it(tmp_path: Path) -> None:
    """SIGKILL, like a segfault of the API server, runs none of its code: the ipc folder
    must be gone before (the core has answered, and nobody else connects)."""
    server = ServeProcess(tmp_path / "serve.log", env={"TMPDIR": str(tmp_path)})
    engine_pid = server.engine_pid()
    server.proc.kill()
    server.proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(engine_pid), "the engine core outlived the server"
    assert not _ipc_folders(tmp_path)


def test_a_supervised_engine_that_refuses_to_start_exits_and_leaves_no_ipc_folder(
    tmp_path: Path,
) -> None:
    """The engine refuses these flags before loading the model (exit 2, one line), and
    exits on its own once it has said so: nobody waits to kill it. (One API server:
    tests/app/test_cli_runner_features.py.)"""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--port",
            "0",
            "--device",
            "cpu",
            "--log-format",
            "console",
            "--api-server-count",
            "2",
            "--runner",
            "v2",
            "--logits-processors",
            "tests.gpu._sample_logits_processor:ForceOrBanTokens",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "does not support custom logits processors" in result.stderr
    assert "engine_process_killed" not in result.stderr
    assert not _ipc_folders(tmp_path)


def _metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


@pytest.fixture(scope="module")
def two_api_servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServeProcess, Path]]:
    """`tandem serve --api-server-count 2` with a short stall bound; its ipc folder goes
    in the fixture's own folder."""
    tmp = tmp_path_factory.mktemp("two_api_servers")
    server = ServeProcess(
        tmp / "serve.log",
        "--api-server-count",
        "2",
        "--engine-stall-timeout",
        str(STALL_TIMEOUT_S),
        env={"TMPDIR": str(tmp)},
    )
    try:
        yield server, tmp
    finally:
        exit_code = server.stop()
    assert exit_code == 0
    assert not server.descendants()
    assert health(server.url) is None  # the port is closed
    assert not _ipc_folders(tmp)


def test_a_burst_of_connections_is_spread_over_the_api_servers(
    two_api_servers: tuple[ServeProcess, Path],
) -> None:
    """24 connections opened at once, as a load balancer or a benchmark opens its pool, then
    held open: each of two API servers takes at least a third. (Before, each process
    accepted whatever waited when it woke, and one took 19 to 24 of the 24.) The first
    test on the module's server: only the closed connections of its start's /health
    probes came before."""
    server, _ = two_api_servers
    address = urlsplit(server.url)
    connections = [
        http.client.HTTPConnection(str(address.hostname), address.port, timeout=30)
        for _ in range(24)
    ]
    try:
        for connection in connections:
            connection.connect()
        held_by = {0: 0, 1: 0}
        for connection in connections:  # the server says which API server answered
            connection.request("GET", "/version")
            held_by[json.loads(connection.getresponse().read())["api_server"]] += 1
    finally:
        for connection in connections:
            connection.close()
    assert min(held_by.values()) >= 8, held_by


def _completion_by_each_api_server(url: str) -> set[int]:
    """Which API servers completed a request (one connection each: /version and the
    completion go to the same process)."""
    answered_by: set[int] = set()
    for attempt in range(60):
        with httpx.Client(base_url=url, timeout=30) as client:
            index = client.get("/version").json()["api_server"]
            response = client.post(
                "/v1/completions",
                json={"prompt": [1, 2, 3, attempt], "max_tokens": 3, "ignore_eos": True},
            )
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
        answered_by.add(index)
        if answered_by == {0, 1}:
            break
    return answered_by


def test_hostile_frames_on_the_engine_socket_leave_the_core_serving(
    two_api_servers: tuple[ServeProcess, Path],
) -> None:
    """Garbage, a 3-part message and hellos forged for indexes 0 and 1 are dropped: requests
    through either API server still complete (a hijacked index would leave them hanging)."""
    server, tmp = two_api_servers
    [socket_path] = tmp.glob("tandem-*/engine.sock")
    engine_pid = server.engine_pid()
    send_hostile_frames(socket_path)
    time.sleep(0.5)
    assert _completion_by_each_api_server(server.url) == {0, 1}
    assert alive(engine_pid) and server.engine_pid() == engine_pid
    assert any(
        line.get("event") == "engine_socket_frame_dropped" and line.get("process") == "engine_core"
        for line in server.lines()
    )


def _health(url: str) -> tuple[int, str]:
    response = httpx.get(url + "/health", timeout=5)
    return response.status_code, response.json()["status"]


def _wait_for_health(url: str, expected: tuple[int, str], timeout_s: float) -> float:
    """Seconds until /health answered `expected` (fails after `timeout_s`)."""
    started = time.monotonic()
    while _health(url) != expected:
        assert time.monotonic() - started < timeout_s, f"/health never answered {expected}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_stopped_engine_core_is_reported_stalled_until_it_runs_again(
    two_api_servers: tuple[ServeProcess, Path],
) -> None:
    """SIGSTOP: /health 503 'stalled' within the bound on both API servers, and a new
    request 503 at once instead of hanging; SIGCONT: 200 again within a second. An idle
    server past the bound is not stalled."""
    server, _ = two_api_servers
    url = server.url
    time.sleep(STALL_TIMEOUT_S + 2 * _TICK_S)
    assert _health(url) == (200, "ok")
    engine_pid = server.engine_pid()
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        stalled_after_s = _wait_for_health(url, (503, "stalled"), STALL_TIMEOUT_S + 5)
        assert stalled_after_s < STALL_TIMEOUT_S + 3 * _TICK_S
        time.sleep(2 * _TICK_S)  # the other API server's watchdog has looked too
        for _ in range(6):
            assert _health(url) == (503, "stalled")
        started = time.monotonic()
        refused = httpx.post(
            url + "/v1/completions", timeout=10, json={"prompt": [1, 2, 3], "max_tokens": 3}
        )
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert time.monotonic() - started < 1.0
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    assert _wait_for_health(url, (200, "ok"), 5.0) < 4 * _TICK_S
    time.sleep(2 * _TICK_S)
    for _ in range(4):
        assert _health(url) == (200, "ok")
    response = httpx.post(
        url + "/v1/completions",
        timeout=30,
        json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
    )
    assert response.status_code == 200
    events = [line.get("event") for line in server.lines()]
    assert "engine_stalled" in events and "engine_resumed" in events


def test_two_api_servers_answer_on_one_port_and_metrics_cover_both(
    two_api_servers: tuple[ServeProcess, Path],
) -> None:
    server, _ = two_api_servers
    supervisor_children = server.descendants()
    assert len(supervisor_children) == 3  # one engine core, two API servers
    num_tokens_before = _metric(
        httpx.get(server.url + "/metrics", timeout=10).text, "vllm:generation_tokens_total"
    )
    num_tokens = 0
    for attempt in range(4):  # a new connection each time: either process accepts it
        response = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"prompt": [1, 2, 3, attempt], "max_tokens": 3, "ignore_eos": True},
        )
        assert response.status_code == 200
        num_tokens += response.json()["usage"]["completion_tokens"]
    assert answering_api_servers(server.url) == {0, 1}, "one API server never answered"
    scraped_by: set[int] = set()
    for _ in range(60):
        scraped_by.add(httpx.get(server.url + "/version", timeout=10).json()["api_server"])
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert _metric(text, "vllm:generation_tokens_total") == num_tokens_before + num_tokens
        if len(scraped_by) == 2:
            break
    lines = server.lines()
    assert {line.get("process") for line in lines} >= {
        "supervisor",
        "engine_core",
        "api_server_0",
        "api_server_1",
    }
    _an_api_server_that_dies_is_restarted(server)


def _an_api_server_that_dies_is_restarted(server: ServeProcess) -> None:
    kill_api_server_and_wait_for_its_successor(server, 1)
    assert any(line.get("event") == "api_server_died_restarting" for line in server.lines())
    assert answering_api_servers(server.url) == {0, 1}


def test_requests_cut_by_a_killed_api_server_count_as_aborted(
    two_api_servers: tuple[ServeProcess, Path],
) -> None:
    """SIGKILL runs none of the API server's code, so nobody there records the end of the
    streams it held. The engine core aborts them when the successor says hello and tells
    it how many: they show in vllm:request_success_total{finished_reason="abort"} on
    /metrics, whichever process answers the scrape. (API server 0 is the victim here: the
    one the core sends its step stats to.)"""
    server, _ = two_api_servers
    victim_index, num_cut = 0, 2
    aborted_before = abort_count(httpx.get(server.url + "/metrics", timeout=10).text)
    clients = clients_of_api_server(server.url, victim_index, num_cut)
    long_chat = {**CHAT, "max_tokens": 400, "ignore_eos": True}
    streaming = [StreamInThread(client, long_chat) for client in clients]
    for stream in streaming:
        assert stream.first_chunk.wait(60), "a stream produced nothing"
    kill_api_server_and_wait_for_its_successor(server, victim_index)
    for stream in streaming:
        stream.thread.join(timeout=30)
        assert stream.cut, "a stream on the killed API server went on"
    deadline = time.monotonic() + 30
    while True:  # the successor hears it just after its hello
        text = httpx.get(server.url + "/metrics", timeout=10).text
        if abort_count(text) >= aborted_before + num_cut or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert abort_count(text) == aborted_before + num_cut
    # vLLM's older names are copies of the families summed over both processes.
    for old, new in (
        ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        ("vllm:time_per_output_token_seconds_count", "vllm:inter_token_latency_seconds_count"),
    ):
        assert _metric(text, old) == _metric(text, new)
