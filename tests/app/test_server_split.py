"""The front end / engine core split, in process: stop strings are found in the front end
and aborted in the core, a model served without a tokenizer refuses text with a 400, and
the step loop's outputs carry the core's load to /metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.protocol.config import EngineConfig
from tests.app._server_fixtures import RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = RunningServer()
    yield running
    running.stop()


def _gauges(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_stop_string_aborts_the_request_in_the_core(
    server: RunningServer, http: httpx.Client
) -> None:
    """The core would otherwise run 1500 more tokens (many seconds on this CPU): right after
    the response, nothing runs and every KV block is free."""
    response = http.post(
        "/v1/completions",
        json={
            "prompt": "The quick brown fox",
            "max_tokens": 1500,
            "min_tokens": 1,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": 7,
            "stop": ["e", "a", "o", " "],
        },
    )
    body = response.json()
    assert response.status_code == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 100
    deadline = time.monotonic() + 2.0
    while True:
        metrics = _gauges(http.get("/metrics").text)
        if metrics["vllm:num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, "the core kept running a finished request"
        time.sleep(0.05)
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    snapshot = server.snapshot()
    assert snapshot.num_free_kv_blocks == snapshot.num_total_kv_blocks


def test_engine_stats_come_over_the_protocol(server: RunningServer, http: httpx.Client) -> None:
    http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
    metrics = _gauges(http.get("/metrics").text)
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0
    assert metrics["vllm:prefix_cache_queries_total"] > 0
    assert metrics["tandem:engine_step_duration_seconds_count"] > 0
    version = http.get("/version").json()
    assert version["runner"] in ("v1", "v2") and version["api_server"] == 0


@pytest.fixture(scope="module")
def tokenizerless() -> Iterator[RunningServer]:
    from actors.core.engine_startup import load_engine

    engine = EngineConfig(
        model="dummy:smollm2-135m",
        device="cpu",
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        num_kv_blocks=16,
    )
    running = RunningServer(engine=engine, preloaded=load_engine(engine))
    yield running
    running.stop()


def test_a_model_without_a_tokenizer_refuses_text_with_a_400(tokenizerless: RunningServer) -> None:
    with httpx.Client(base_url=tokenizerless.url, timeout=60) as client:
        chat = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.status_code == 400
        error = chat.json()["error"]
        assert error["param"] == "messages" and "without a tokenizer" in error["message"]
        assert "--tokenizer" in error["message"]
        text = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert text.status_code == 400 and text.json()["error"]["param"] == "prompt"
        ids = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert ids.status_code == 200 and ids.json()["usage"]["completion_tokens"] == 2
