"""Faults: a failed engine step fails only its own requests; a run of failed steps marks
the engine dead (/health 503); a failure's details never reach the client."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from tests.app._fault_injection import StepFaults, leaked_markers
from tests.app._server_fixtures import ENGINE, RunningServer

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
LONG = {"max_tokens": 400, "min_tokens": 400}


async def _read_stream(
    client: httpx.AsyncClient, body: dict[str, Any], first_event: asyncio.Event | None = None
) -> list[Any]:
    """The data events of a stream: parsed JSON objects, and '[DONE]'."""
    events: list[Any] = []
    async with client.stream("POST", CHAT, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                if first_event is not None:
                    first_event.set()
    return events


async def _wait_for(server: RunningServer, ready: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready(await asyncio.to_thread(server.snapshot)):
        assert time.monotonic() < deadline, "the engine never reached the expected state"
        await asyncio.sleep(0.02)


def _success_count(url: str, reason: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no vllm:request_success_total for {reason}")


async def _one_failed_step(
    server: RunningServer, faults: StepFaults
) -> tuple[list[Any], httpx.Response, httpx.Response]:
    """A (streamed) and B (not) run together; C waits for a free slot. The next step that
    runs both A and B fails."""
    messages = [{"role": "user", "content": "Count to a thousand."}]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        a_started = asyncio.Event()
        a = asyncio.create_task(_read_stream(client, {"messages": messages, **LONG}, a_started))
        b = asyncio.create_task(client.post(CMPL, json={"prompt": "Once upon a time", **LONG}))
        await _wait_for(server, lambda s: s.num_running == 2)
        await asyncio.wait_for(a_started.wait(), 60)
        c = asyncio.create_task(
            client.post(CMPL, json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True})
        )
        await _wait_for(server, lambda s: s.num_waiting == 1)
        faults.arm(1, match=lambda sched: len(sched.scheduled_request_ids) == 2)
        return await a, await b, await c


def test_a_failed_step_fails_only_its_requests() -> None:
    server = RunningServer(engine=ENGINE.replace(max_num_seqs=2), max_consecutive_failed_steps=5)
    faults = StepFaults(server.state.connection.inprocess_core.gpu_actor.runner)
    try:
        errors_before = _success_count(server.url, "error")
        a_events, b, c = asyncio.run(_one_failed_step(server, faults))
        assert len(faults.failed_steps) == 1
        # The stream: content, then one error event, then [DONE]; no finish_reason.
        assert a_events[-1] == "[DONE]" and "error" in a_events[-2]
        error = a_events[-2]["error"]
        assert error["code"] == 500 and "request id" in error["message"]
        chunks = a_events[:-2]
        assert chunks and all("error" not in e for e in chunks)
        assert all(ch["finish_reason"] is None for e in chunks for ch in e["choices"])
        # The non-stream request: an OpenAI-shaped 500.
        assert b.status_code == 500 and b.json()["error"]["code"] == 500
        for text in (json.dumps(a_events), b.text):
            assert leaked_markers(text) == [], text
        # The request that was not in the failed step is served normally.
        assert c.status_code == 200, c.text
        assert c.json()["choices"][0]["finish_reason"] == "length"
        assert c.json()["usage"]["completion_tokens"] == 5
        assert _success_count(server.url, "error") - errors_before == 2
        # The engine keeps serving, stays healthy, and the failed requests left nothing.
        after = httpx.post(
            server.url + CHAT,
            timeout=60,
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
                "temperature": 0,
            },
        )
        assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"]
        assert httpx.get(server.url + "/health").status_code == 200
        snap = server.wait_engine_idle()
        assert (snap.num_running, snap.num_waiting, snap.num_unfinished_admitted) == (0, 0, 0)
        assert snap.num_free_kv_blocks == snap.num_total_kv_blocks
        assert snap.num_free_rows is None or snap.num_free_rows >= snap.num_rows - 1
    finally:
        faults.restore()
        server.stop()


async def _requests_during_failures(
    server: RunningServer, faults: StepFaults
) -> list[httpx.Response | list[Any]]:
    messages = [{"role": "user", "content": "Tell me a story."}]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        tasks = [
            asyncio.create_task(_read_stream(client, {"messages": messages, **LONG})),
            *[
                asyncio.create_task(client.post(CMPL, json={"prompt": f"Story {i}:", **LONG}))
                for i in range(3)
            ],
        ]
        await _wait_for(server, lambda s: s.num_running == 1 and s.num_waiting == 3)
        faults.arm(10_000)  # every step from now on
        return list(await asyncio.gather(*tasks))


def test_repeated_step_failures_mark_the_engine_dead() -> None:
    server = RunningServer(engine=ENGINE.replace(max_num_seqs=1), max_consecutive_failed_steps=3)
    faults = StepFaults(server.state.connection.inprocess_core.gpu_actor.runner)
    try:
        results = asyncio.run(_requests_during_failures(server, faults))
        # Every request ends (none hangs), each with an error: those in the failed steps
        # by the step, the ones still waiting when the engine was declared dead by it.
        stream_events, *answers = results
        assert isinstance(stream_events, list)
        assert stream_events[-1] == "[DONE]" and stream_events[-2]["error"]["code"] == 500
        for answer in answers:
            assert isinstance(answer, httpx.Response)
            assert answer.status_code == 500 and leaked_markers(answer.text) == []
        assert len(faults.failed_steps) >= 3
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "dead"}
        refused = httpx.post(server.url + CMPL, json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        assert leaked_markers(refused.text) == []
        assert httpx.get(server.url + "/metrics").status_code == 200
        snap = server.wait_engine_idle()
        assert snap.num_free_kv_blocks == snap.num_total_kv_blocks
    finally:
        faults.restore()
        exit_code = _stop(server)
    # The process reports that it ended because its engine died.
    assert exit_code == 1


def _stop(server: RunningServer, timeout_s: float = 60.0) -> int | None:
    server.server.request_shutdown()
    deadline = time.monotonic() + timeout_s
    while server.exit_code is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.exit_code


async def _load(url: str, num_requests: int) -> list[int]:
    async def one(client: httpx.AsyncClient, index: int) -> int:
        response = await client.post(
            CMPL, json={"prompt": f"Item {index}:", "max_tokens": 1 + index % 9, "ignore_eos": True}
        )
        assert leaked_markers(response.text) == []
        return response.status_code

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return list(await asyncio.gather(*[one(client, i) for i in range(num_requests)]))


def test_step_faults_under_load_leave_nothing_behind() -> None:
    """Failed steps that were also told to free the rows of requests finished earlier:
    those rows must still be freed (nothing else names those requests again)."""
    server = RunningServer(engine=ENGINE.replace(max_num_seqs=8), max_consecutive_failed_steps=50)
    faults = StepFaults(server.state.connection.inprocess_core.gpu_actor.runner)
    try:
        faults.arm(4, match=lambda sched: bool(sched.finished_request_ids))
        statuses = asyncio.run(_load(server.url, 48))
        assert len(faults.failed_steps) == 4
        assert set(statuses) == {200, 500} and statuses.count(500) >= 4
        # The next request runs a step, which frees the rows of the requests before it.
        ok = httpx.post(server.url + CMPL, json={"prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200
        snap = server.wait_engine_idle()
        assert (snap.num_running, snap.num_waiting, snap.num_unfinished_admitted) == (0, 0, 0)
        assert snap.num_free_kv_blocks == snap.num_total_kv_blocks
        assert snap.num_free_rows is None or snap.num_free_rows >= snap.num_rows - 1
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        faults.restore()
        server.stop()
