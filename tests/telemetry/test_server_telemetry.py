"""Telemetry of a real `tandem serve` end to end, in process: the SERVER span of a streamed
chat request (in-memory exporter) and /metrics after a known set of requests (a served
process's JSON logs and OTLP export: test_served_process_telemetry.py)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from telemetry.tracing import setup_tracing
from tests.app._server_fixtures import ENGINE, RunningServer
from tests.telemetry._telemetry_helpers import (
    CALLER_SPAN_ID,
    CALLER_TRACE_ID,
    MESSAGES,
    TRACEPARENT,
    stream_chat,
)

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# ---- helpers -----------------------------------------------------------------------------


def scrape(url: str) -> Samples:
    response = httpx.get(url + "/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def metric(samples: Samples, name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels` (model_name is always there)."""
    wanted = set(labels.items())
    found = [
        value
        for (sample_name, sample_labels), value in samples.items()
        if sample_name == name and wanted <= sample_labels
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def scrape_until(url: str, done: Callable[[Samples], bool], timeout_s: float = 20.0) -> Samples:
    """Scrape until `done` holds (blocks are freed a step after a request ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


# ---- the SERVER span ---------------------------------------------------------------------


@pytest.fixture
def traced_server() -> Iterator[tuple[RunningServer, InMemorySpanExporter]]:
    server = RunningServer()
    exporter = InMemorySpanExporter()
    server.state.tracing = setup_tracing("tandem-test", exporter=exporter)
    yield server, exporter
    server.stop()


def server_spans(
    server: RunningServer, exporter: InMemorySpanExporter, timeout_s: float = 10.0
) -> list[ReadableSpan]:
    """The SERVER spans ended so far, once there is one (a stream's span ends just after
    its last bytes went out, so the client may be faster)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.state.tracing.force_flush()
        spans = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
        if spans or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def event_seconds_after_start(span: ReadableSpan) -> dict[str, float]:
    assert span.start_time is not None
    return {e.name: (e.timestamp - span.start_time) / 1e9 for e in span.events}


def test_streamed_chat_has_one_server_span_under_the_caller_with_genai_attributes(
    traced_server: tuple[RunningServer, InMemorySpanExporter],
) -> None:
    server, exporter = traced_server
    chunks = stream_chat(
        server.url,
        {
            "messages": MESSAGES,
            "max_tokens": 9,
            "ignore_eos": True,
            "temperature": 0.8,
            "top_p": 0.9,
            "top_k": 20,
            "seed": 11,
        },
        headers={"traceparent": TRACEPARENT, "X-Request-Id": "span-test-1"},
    )
    usage = chunks[-1]["usage"]
    [span] = server_spans(server, exporter)

    assert span.parent is not None and span.parent.is_remote
    assert format(span.parent.span_id, "016x") == CALLER_SPAN_ID
    assert format(span.context.trace_id, "032x") == CALLER_TRACE_ID
    assert span.name == f"chat {chunks[0]['model']}"
    assert span.status.status_code is StatusCode.UNSET
    attributes = dict(span.attributes or {})
    expected = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": chunks[0]["model"],
        "gen_ai.request.max_tokens": 9,
        "gen_ai.request.temperature": 0.8,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 20,
        "gen_ai.request.seed": 11,
        "gen_ai.request.stream": True,
        "gen_ai.response.id": chunks[0]["id"],
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.usage.cache_read.input_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }
    assert {key: attributes.get(key) for key in expected} == expected
    assert usage["completion_tokens"] == 9

    events = event_seconds_after_start(span)
    assert list(events) == ["queued", "scheduled", "first_token", "finished"]
    times = list(events.values())
    assert times == sorted(times) and times[0] >= 0
    assert span.end_time is not None and span.start_time is not None
    assert events["finished"] == pytest.approx((span.end_time - span.start_time) / 1e9)
    assert attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(
        events["first_token"], abs=1e-6
    )
    assert attributes["gen_ai.latency.time_in_queue"] == pytest.approx(
        events["scheduled"] - events["queued"], abs=1e-6
    )
    assert attributes["gen_ai.latency.e2e"] == pytest.approx(events["finished"], abs=1e-6)


def test_refused_request_span_has_error_status_and_type(
    traced_server: tuple[RunningServer, InMemorySpanExporter],
) -> None:
    server, exporter = traced_server
    response = httpx.post(
        server.url + "/v1/completions",
        timeout=30,
        headers={"traceparent": TRACEPARENT},
        json={"prompt": "Hello", "max_tokens": 100_000},
    )
    assert response.status_code == 400  # more than the context holds
    [span] = server_spans(server, exporter)
    assert span.name == f"text_completion {server.state.model_names[0]}"
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes or {})["error.type"] == "400"
    assert format(span.context.trace_id, "032x") == CALLER_TRACE_ID


# ---- /metrics ------------------------------------------------------------------------------


@pytest.fixture
def one_seat_server() -> Iterator[RunningServer]:
    # One request runs and none may wait, so a second concurrent request is refused (429).
    server = RunningServer(engine=ENGINE.replace(max_num_seqs=1), max_queued_requests=0)
    yield server
    server.stop()


def send_known_requests(url: str) -> list[dict[str, Any]]:
    """Chat (streamed and not) and completion requests, one at a time; their usages and
    finish reasons as the client saw them."""
    outcomes = []
    for content in ("Name a colour.", "Name a fruit.", "Name a city."):
        chunks = stream_chat(
            url,
            {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0},
        )
        reason = next(
            c["choices"][0]["finish_reason"]
            for c in chunks
            if c["choices"] and c["choices"][0]["finish_reason"]
        )
        outcomes.append({"usage": chunks[-1]["usage"], "finish_reason": reason})
    bodies = [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 24, "stop": [" "]}),
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 5}),
        # The same prompt again: its full blocks come from the prefix cache.
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}),
    ]
    for path, body in bodies:
        response = httpx.post(url + path, json=body, timeout=120)
        assert response.status_code == 200, response.text
        data = response.json()
        outcomes.append(
            {"usage": data["usage"], "finish_reason": data["choices"][0]["finish_reason"]}
        )
    return outcomes


def test_metrics_count_exactly_what_was_served(one_seat_server: RunningServer) -> None:
    server = one_seat_server
    outcomes = send_known_requests(server.url)
    server.wait_engine_idle()
    samples = scrape_until(server.url, lambda s: metric(s, "vllm:kv_cache_usage_perc") == 0)

    usages = [o["usage"] for o in outcomes]
    num_requests = len(outcomes)
    num_output = [u["completion_tokens"] for u in usages]
    reasons = Counter(o["finish_reason"] for o in outcomes)
    assert reasons["length"] >= 3 and usages[-1]["prompt_tokens_details"]["cached_tokens"] > 0
    for reason in ("stop", "length", "abort", "error"):
        assert (
            metric(samples, "vllm:request_success_total", finished_reason=reason) == reasons[reason]
        )
    prompt_total = sum(u["prompt_tokens"] for u in usages)
    assert metric(samples, "vllm:prompt_tokens_total") == prompt_total
    assert metric(samples, "vllm:generation_tokens_total") == sum(num_output)
    assert metric(samples, "vllm:prefix_cache_queries_total") == prompt_total
    assert metric(samples, "vllm:prefix_cache_hits_total") == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages
    )
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert metric(samples, f"vllm:{name}_count") == num_requests, name
    assert metric(samples, "vllm:request_time_per_output_token_seconds_count") == sum(
        n >= 2 for n in num_output
    )
    # One token per request per step, so one gap per output token after the first.
    assert metric(samples, "vllm:inter_token_latency_seconds_count") == sum(num_output) - len(
        num_output
    )
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert metric(samples, gauge) == 0, gauge

    info = server.state.engine_info
    assert metric(samples, "tandem:runner_info", runner=info.runner, reason=info.runner_reason) == 1
    steps = server.state.connection.inprocess_engine.recent_step_stats()
    num_steps = sum(s.num_tokens > 0 for s in steps)
    assert num_steps >= max(num_output)
    for name in (
        "engine_step_duration_seconds",
        "gpu_idle_between_steps_seconds",
        "scheduler_cpu_time_per_step_seconds",
    ):
        assert metric(samples, f"tandem:{name}_count") == num_steps, name
    assert metric(samples, "tandem:scheduler_cpu_time_per_step_seconds_sum") > 0


def test_refusals_disconnects_and_aborts_are_counted(one_seat_server: RunningServer) -> None:
    server = one_seat_server
    long_body = {"messages": MESSAGES, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=long_body, timeout=120
    ) as response:
        lines = response.iter_lines()  # kept: dropping the iterator would close the connection
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break  # the request holds the only seat now
        refused = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=30,
            json={"messages": MESSAGES, "max_tokens": 2},
        )
        assert refused.status_code == 429
    # Leaving the block closed the connection mid-stream.
    server.wait_engine_idle()
    samples = scrape_until(
        server.url,
        lambda s: (
            metric(s, "vllm:kv_cache_usage_perc") == 0
            and metric(s, "tandem:client_disconnects_total") == 1
        ),
    )
    assert metric(samples, "tandem:rejected_requests_total", reason="overloaded") == 1
    assert metric(samples, "tandem:client_disconnects_total") == 1
    assert metric(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(samples, "vllm:e2e_request_latency_seconds_count") == 1
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert metric(samples, gauge) == 0, gauge
