"""Stopped processes (SIGSTOP) under a real `tandem serve`: an engine core stopped and
resumed within twice the stall bound finishes the requests in flight, unchanged, while
/health says 'stalled'; one that stays stopped longer has them end with a clear 503-style
error, and once resumed it frees what they held and serves again; an API server stopped
under the supervisor is found silent, killed and restarted, its client's connection ends
instead of hanging, and the core frees what it held. Throughout, /health on a new
connection answers within a second, and afterwards the server's resident memory is back
near its baseline.

The issue's stall lasts 30 s; these last a few times the (shortened) stall bound, which
exercises the same paths in a fraction of the CI time."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.soak_server import resident_bytes
from tests.app._hostile import MAX_HEALTH_S, RSS_SLACK_BYTES, metric, wait_until
from tests.app._serve_process import ServeProcess, alive

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 2.0
STOPPED_S = 1.5 * STALL_TIMEOUT_S
"""Past the stall bound, short of the bound at which requests in flight are failed (2x)."""
GREEDY_CHAT = {
    "messages": [{"role": "user", "content": "Count to one hundred."}],
    "max_tokens": 40,
    "ignore_eos": True,
    "temperature": 0.0,
}


class FreshConnectionProbe:
    """GETs /health on a new connection each time (a kept-alive one could belong to a
    stopped API server), in a thread; records each (status, body status), the failures and
    the slowest answer.

    `stopped_at`, set when an API server is stopped: a probe that connected before then and
    ends with its connection reset was accepted by that server just before the stop (the
    API servers share one listening socket), so no other process could answer it; it ends
    when the supervisor kills the stopped one, and counts neither as a failure nor for the
    latency. Any other probe does."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[int, str]] = []
        self.stopped_at: float | None = None
        self._attempts: list[tuple[float, float, Exception | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            error: Exception | None = None
            try:
                response = httpx.get(self.url + "/health", timeout=30)
                self.answers.append((response.status_code, response.json()["status"]))
            except httpx.HTTPError as exc:
                error = exc
            self._attempts.append((started, time.monotonic() - started, error))
            self._stop.wait(0.05)

    def _counted(self) -> list[tuple[float, float, Exception | None]]:
        return [a for a in self._attempts if not self._taken_by_the_stopped_server(a[0], a[2])]

    def _taken_by_the_stopped_server(self, started: float, error: Exception | None) -> bool:
        reset = isinstance(error, httpx.ReadError | httpx.RemoteProtocolError)
        return reset and self.stopped_at is not None and started < self.stopped_at

    @property
    def failures(self) -> list[str]:
        return [repr(error) for _, _, error in self._counted() if error is not None]

    @property
    def max_latency_s(self) -> float:
        return max((latency_s for _, latency_s, _ in self._counted()), default=0.0)


@contextmanager
def probed(server: ServeProcess) -> Iterator[FreshConnectionProbe]:
    """The block under a FreshConnectionProbe; then /health was quick throughout and the
    server's processes hold no more than RSS_SLACK_BYTES over their RSS before it."""
    baseline = _tree_rss(server)
    probe = FreshConnectionProbe(server.url)
    probe._thread.start()
    try:
        wait_until(lambda: bool(probe.answers), 10.0, "/health did not answer")
        yield probe
    finally:
        probe._stop.set()
        probe._thread.join()
    assert not probe.failures, probe.failures
    assert probe.max_latency_s < MAX_HEALTH_S, f"/health took {probe.max_latency_s:.2f} s"
    grown = _tree_rss(server) - baseline
    assert grown < RSS_SLACK_BYTES, f"RSS stayed {grown / 2**20:.0f} MiB above baseline"


def _tree_rss(server: ServeProcess) -> int:
    return sum(resident_bytes(pid) for pid in [server.proc.pid, *server.descendants()])


def _stream_text(client: httpx.Client, body: dict[str, Any], on_first: Any = None) -> str:
    """The content of a streamed chat; `on_first()` runs after the first content chunk."""
    import json

    text = ""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            delta = chunk["choices"][0]["delta"].get("content") or ""
            if delta and not text and on_first is not None:
                on_first()
            text += delta
    return text


def _assert_engine_idle(url: str, api_server: int | None = None) -> None:
    """The core runs nothing and holds no KV, as `api_server` (any when None) reports it:
    a freshly started API server exports the core's gauges only once the core reports."""
    http = (
        httpx.Client(base_url=url, timeout=10)
        if api_server is None
        else _client_of_api_server(url, api_server)
    )
    try:
        wait_until(
            lambda: metric(http, "vllm:num_requests_running") == 0,
            10.0,
            "requests still run in the core",
        )
        assert metric(http, "vllm:kv_cache_usage_perc") == 0.0
    finally:
        http.close()


@pytest.fixture(scope="module")
def one_api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """`tandem serve` with one API server, the stall bound STALL_TIMEOUT_S and
    --max-logprobs 30; the engine-core tests share it (each leaves its core running and
    idle), and it must exit 0 after them."""
    server = ServeProcess(
        tmp_path_factory.mktemp("stalls") / "serve.log",
        "--engine-stall-timeout",
        str(STALL_TIMEOUT_S),
        "--max-logprobs",
        "30",
    )
    try:
        yield server
    finally:
        exit_code = server.stop()
    assert exit_code == 0


def test_a_stopped_and_resumed_engine_core_finishes_the_requests_in_flight(
    one_api_server: ServeProcess,
) -> None:
    """Stopped for one and a half stall bounds mid-stream: /health says 'stalled'
    meanwhile (and answers within a second), the streamed and the plain request both
    complete once the core runs again, each with the text it gives without a stall."""
    server = one_api_server
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            # The plain request during the stall is checked against this text too.
            expected = _stream_text(client, GREEDY_CHAT)
        engine_pid = server.engine_pid()
        stopped_at: list[float] = []

        def stop_engine_for_a_while() -> None:
            os.kill(engine_pid, signal.SIGSTOP)
            stopped_at.append(time.monotonic())
            threading.Timer(STOPPED_S, os.kill, (engine_pid, signal.SIGCONT)).start()

        answers: dict[str, Any] = {}

        def plain_request() -> None:
            with httpx.Client(base_url=server.url, timeout=120) as client:
                answers["plain"] = client.post("/v1/chat/completions", json=GREEDY_CHAT)

        with probed(server) as probe:
            other = threading.Thread(target=plain_request)
            other.start()
            with httpx.Client(base_url=server.url, timeout=120) as client:
                streamed = _stream_text(client, GREEDY_CHAT, on_first=stop_engine_for_a_while)
            other.join(timeout=60)
            resumed_after_s = time.monotonic() - stopped_at[0] - STOPPED_S
            assert resumed_after_s < 10.0, "the requests took too long after the resume"
            wait_until(lambda: probe.answers[-1] == (200, "ok"), 5.0, "/health stayed 503")
        assert (503, "stalled") in probe.answers
        assert set(probe.answers) <= {(200, "ok"), (503, "stalled")}
        assert streamed == expected
        assert answers["plain"].status_code == 200
        assert answers["plain"].json()["choices"][0]["message"]["content"] == expected
        _assert_engine_idle(server.url)
    finally:
        os.kill(server.engine_pid(), signal.SIGCONT)


def _streamed_error(client: httpx.Client, body: dict[str, Any], on_first: Any) -> dict[str, Any]:
    """The `error` of the event that ends a streamed chat; `on_first()` runs after its first
    content chunk. Fails if the stream ends without one."""
    import json

    error = None
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
            elif chunk["choices"][0]["delta"].get("content") and on_first is not None:
                on_first()
                on_first = None
    assert error is not None, "the stream ended without an error"
    return dict(error)


def _assert_stopped_responding(error: dict[str, Any]) -> None:
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError", error
    assert "engine stopped responding" in error["message"], error


def test_an_engine_core_that_stays_stopped_fails_the_requests_in_flight(
    one_api_server: ServeProcess,
) -> None:
    """Stopped mid-stream and not resumed: once silent for twice the stall bound, the
    streamed request ends with an error event and the plain one with a 503 + Retry-After,
    both saying that the engine stopped responding; new requests get 503; /health says
    'stalled' and answers within a second throughout. Resumed, the core frees what the
    failed requests held (their late outputs dropped, no error logged) and a fresh request
    is served: one asking for more logprobs than vLLM's default 20 (--max-logprobs 30), so
    that such a request is shown to cross to the core's process too."""
    fail_by_s = 2 * STALL_TIMEOUT_S + 2.0  # the fail bound, the watchdog's tick, slack
    server = one_api_server
    engine_pid = server.engine_pid()
    is_stopped = False
    try:
        long_chat = {**GREEDY_CHAT, "max_tokens": 400}
        stopped_at: list[float] = []
        answers: dict[str, Any] = {}

        def stop_engine() -> None:
            nonlocal is_stopped
            os.kill(engine_pid, signal.SIGSTOP)
            is_stopped = True
            stopped_at.append(time.monotonic())

        def plain_request() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                answers["plain"] = client.post("/v1/chat/completions", json=long_chat)
            answers["plain_after_s"] = time.monotonic() - stopped_at[0]

        with probed(server) as probe:
            plain = threading.Thread(target=plain_request)
            plain.start()
            with httpx.Client(base_url=server.url, timeout=60) as client:
                wait_until(
                    lambda: metric(client, "vllm:num_requests_running") >= 1,
                    10.0,
                    "the plain request did not start",
                )
                error = _streamed_error(client, long_chat, on_first=stop_engine)
                streamed_after_s = time.monotonic() - stopped_at[0]
                plain.join(timeout=60)
                refused = client.post("/v1/chat/completions", json=GREEDY_CHAT)
            num_lines_stopped = len(server.lines())
            os.kill(engine_pid, signal.SIGCONT)
            is_stopped = False
            wait_until(lambda: probe.answers[-1] == (200, "ok"), 5.0, "/health stayed 503")
        assert STALL_TIMEOUT_S < streamed_after_s < fail_by_s
        _assert_stopped_responding(error)
        plain_answer = answers["plain"]
        assert plain_answer.status_code == 503 and plain_answer.headers["Retry-After"] == "1"
        _assert_stopped_responding(plain_answer.json()["error"])
        assert answers["plain_after_s"] < fail_by_s
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert (503, "stalled") in probe.answers
        assert set(probe.answers) <= {(200, "ok"), (503, "stalled")}
        _assert_engine_idle(server.url)  # the core read the aborts: KV back to 0
        with httpx.Client(base_url=server.url, timeout=60) as client:
            fresh = client.post(
                "/v1/chat/completions",
                json={**GREEDY_CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 25},
            )
        assert fresh.status_code == 200, fresh.text
        content = fresh.json()["choices"][0]["logprobs"]["content"]
        assert [len(token["top_logprobs"]) for token in content] == [25] * 4
        after_resume = server.lines()[num_lines_stopped:]
        assert [line for line in after_resume if line["level"] == "error"] == []
    finally:
        if is_stopped:
            os.kill(engine_pid, signal.SIGCONT)


def _api_server_pids(server: ServeProcess) -> dict[int, int]:
    return {
        int(line["process"].rsplit("_", 1)[1]): int(line["pid"])
        for line in server.lines()
        if str(line.get("process", "")).startswith("api_server_")
    }


def _client_of_api_server(url: str, index: int) -> httpx.Client:
    """A kept-alive connection that API server `index` accepted."""
    for _ in range(100):
        client = httpx.Client(base_url=url, timeout=30)
        if client.get("/version").json()["api_server"] == index:
            return client
        client.close()
    raise AssertionError(f"API server {index} never accepted a connection")


def test_a_stopped_api_server_is_killed_and_restarted_by_the_supervisor(
    tmp_path: Path,
) -> None:
    """With two API servers, one stopped mid-stream: the supervisor logs it unresponsive
    after the bound, kills it and starts another; the stream on its connection ends with a
    transport error instead of hanging; the core aborts its request (KV back to 0); the
    other API server answers /health within a second throughout; both serve again."""
    server = ServeProcess(
        tmp_path / "serve.log",
        "--api-server-count",
        "2",
        "--api-server-stall-timeout",
        str(STALL_TIMEOUT_S),
    )
    try:
        victim = _api_server_pids(server)[1]
        client = _client_of_api_server(server.url, 1)
        with probed(server) as probe:
            stopped_at: list[float] = []

            def stop_api_server() -> None:
                probe.stopped_at = time.monotonic()
                os.kill(victim, signal.SIGSTOP)
                stopped_at.append(time.monotonic())

            long_chat = {**GREEDY_CHAT, "max_tokens": 400}
            try:
                with pytest.raises(httpx.TransportError) as ended:
                    _stream_text(client, long_chat, on_first=stop_api_server)
            finally:
                client.close()
            assert not isinstance(ended.value, httpx.TimeoutException), "the stream hung"
            assert time.monotonic() - stopped_at[0] < STALL_TIMEOUT_S + 5.0
            wait_until(lambda: not alive(victim), 5.0, "the stopped API server was not killed")
            wait_until(
                lambda: _api_server_pids(server).get(1, victim) != victim,
                60.0,
                "the stopped API server was not restarted",
            )
            _assert_engine_idle(server.url, api_server=0)  # the one that kept running
        events = [line for line in server.lines() if line.get("process") == "supervisor"]
        [unresponsive] = [line for line in events if line["event"] == "api_server_unresponsive"]
        assert unresponsive["index"] == 1 and unresponsive["pid"] == victim
        assert unresponsive["silent_s"] >= STALL_TIMEOUT_S
        restarted = _client_of_api_server(server.url, 1)
        try:
            response = restarted.post("/v1/chat/completions", json=GREEDY_CHAT)
        finally:
            restarted.close()
        assert response.status_code == 200
    finally:
        if alive(victim):
            os.kill(victim, signal.SIGCONT)
        exit_code = server.stop()
    assert exit_code == 0
