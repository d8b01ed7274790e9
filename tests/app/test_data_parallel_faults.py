"""`tandem serve --data-parallel-size 2` when a core dies, alone and under the supervisor of
`--api-server-count 2`: as the one core of a usual server (tests/app/test_server_processes.py),
a killed core ends every stream at once and turns /health 'dead', the server exits 1 when
stopped, and no process or ipc folder outlives it. Under the supervisor the API servers share
the prefix table, so a conversation keeps its core whichever API server takes its turn."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from actors.protocol.messages import HEARTBEAT_INTERVAL_S
from tests.app._api_servers import clients_of_api_server
from tests.app._data_parallel import (
    BLOCK_SIZE,
    by_core,
    chat,
    core_of_next_request,
    engine_pids,
    finished_by_core,
)
from tests.app._serve_process import ServeProcess

pytestmark = pytest.mark.slow

DP2 = ("--data-parallel-size", "2", "--cpu-threads", "1")
LONG_CHAT = {"max_tokens": 400, "ignore_eos": True, "stream": True}


def _long_chat(opening: str) -> dict[str, Any]:
    return {**LONG_CHAT, "messages": [{"role": "user", "content": f"{opening}: count to 100."}]}


class _Stream:
    """A long chat streamed in a thread: its SSE data lines, and when it ended."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.lines: list[str] = []
        self.first = threading.Event()
        self.ended_at = 0.0
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.lines.append(line[6:])
                    if len(self.lines) == 2:
                        self.first.set()
        self.ended_at = time.monotonic()


def _health(url: str) -> tuple[int, str]:
    response = httpx.get(url + "/health", timeout=5)
    return response.status_code, response.json()["status"]


def test_a_killed_core_ends_every_stream_and_marks_the_server_dead(tmp_path: Path) -> None:
    """One stream on each core (two prompts that share no prefix beyond the system prompt,
    at idle cores, go one each); SIGKILL core 1:
    both streams end with an error within a second, the one on the living core too, since
    the server is dead."""
    server = ServeProcess(tmp_path / "serve.log", *DP2, env={"TMPDIR": str(tmp_path)})
    try:
        pids = engine_pids(server)
        assert set(pids) <= set(server.descendants())
        streams = [_Stream(server.url, _long_chat(opening)) for opening in ("Apples", "Pears")]
        for stream in streams:
            assert stream.first.wait(60), "a stream produced nothing"
        assert by_core(server.url, "vllm:num_requests_running") == [1, 1]
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        for stream in streams:
            stream.thread.join(timeout=30)
            assert stream.ended_at - killed_at < 1.0, "a stream outlived the core by over 1 s"
            assert stream.lines[-1] == "[DONE]" and '"error"' in stream.lines[-2]
        assert _health(server.url) == (503, "dead")
        refused = httpx.post(
            server.url + "/v1/chat/completions",
            json={**_long_chat("Plums"), "stream": False},
            timeout=10,
        )
        assert refused.status_code == 503 and "Retry-After" in refused.headers
    finally:
        exit_code = server.stop()
    assert exit_code == 1
    assert not server.descendants()
    assert not list(tmp_path.glob("tandem-*"))
    assert any(
        line.get("event") == "engine_process_died" and line.get("pid") == pids[1]
        for line in server.lines()
    )


def test_supervised_api_servers_share_prefix_affinity_and_die_with_a_core(
    tmp_path: Path,
) -> None:
    server = ServeProcess(
        tmp_path / "serve.log", *DP2, "--api-server-count", "2", env={"TMPDIR": str(tmp_path)}
    )
    try:
        pids = engine_pids(server)
        [folder] = tmp_path.glob("tandem-*")
        assert {p.name for p in folder.glob("engine*.sock")} == {"engine.sock", "engine-1.sock"}
        _turns_through_both_api_servers_stay_on_one_core(server)
        os.kill(pids[0], signal.SIGKILL)
        assert _dead_on_every_api_server(server.url, 2) < 2.0
    finally:
        exit_code = server.stop()
    assert exit_code == 1
    assert not server.descendants()
    assert not list(tmp_path.glob("tandem-*"))


def _dead_on_every_api_server(url: str, num_api_servers: int) -> float:
    """Seconds until each API server's /health said 'dead' (asked on one connection with
    /version, which names the API server)."""
    started = time.monotonic()
    dead: set[int] = set()
    while len(dead) < num_api_servers:
        assert time.monotonic() - started < 10, f"only API servers {dead} said dead"
        with httpx.Client(base_url=url, timeout=5) as client:
            index = client.get("/version").json()["api_server"]
            if _health_of(client) == (503, "dead"):
                dead.add(index)
    return time.monotonic() - started


def _health_of(client: httpx.Client) -> tuple[int, str]:
    response = client.get("/health")
    return response.status_code, response.json()["status"]


def _turns_through_both_api_servers_stay_on_one_core(server: ServeProcess) -> None:
    """Turn 1 through API server 0, turn 2 through API server 1 (its own connection): the
    shared table sends turn 2 to turn 1's core, where its prefix is cached. (API server 1
    learns that turn 1 ended there from the core's next heartbeat; until then it counts
    it as running, and a short history is worth less than one request.)"""
    [first] = clients_of_api_server(server.url, 0, 1)
    [second] = clients_of_api_server(server.url, 1, 1)
    try:
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Rivers: write one sentence about them."}
        ]
        core_1, body_1 = core_of_next_request(server.url, lambda: chat(first, messages))
        time.sleep(2 * HEARTBEAT_INTERVAL_S)  # API server 1 hears the core is idle again
        messages += [
            {"role": "assistant", "content": body_1["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And another one."},
        ]
        core_2, body_2 = core_of_next_request(server.url, lambda: chat(second, messages))
    finally:
        first.close()
        second.close()
    assert core_1 == core_2
    cached = body_2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= body_1["usage"]["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    assert sum(finished_by_core(server.url)) >= 2
