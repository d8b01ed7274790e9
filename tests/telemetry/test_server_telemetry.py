"""Telemetry of a real `tandem serve` end to end: the SERVER span of a streamed chat request
(in-memory exporter, and OTLP from a served process), /metrics after a known set of
requests, and the JSON log lines of a served request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from telemetry.tracing import setup_tracing
from tests._embedded_model import embedded_gguf_path
from tests.app._server_fixtures import ENGINE, RunningServer
from tests.telemetry._otlp_receiver import OTLPReceiver, any_value, running_otlp_receiver

pytestmark = pytest.mark.slow

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# ---- helpers -----------------------------------------------------------------------------


def stream_chat(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed chat completion (usage chunk included)."""
    chunks = []
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        timeout=120,
        headers=headers,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


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


# ---- a served process: JSON logs and OTLP export -------------------------------------------


@pytest.fixture
def otlp_receiver() -> Iterator[OTLPReceiver]:
    with running_otlp_receiver() as receiver:
        yield receiver


def start_serve(log_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    embedded_gguf_path()  # skips the test where the embedded model is not installed
    with log_path.open("wb") as log_file:
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
                "512",
                "--max-num-seqs",
                "4",
                "--num-kv-blocks",
                "64",
                "--log-format",
                "json",
                "--log-level",
                "debug",
                "--access-log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log_file,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        url = next(
            (
                line["url"]
                for line in json_lines(log_path)
                if line.get("event") == "server_listening"
            ),
            None,
        )
        if url is not None and _healthy(url):
            return proc, url
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"tandem serve did not start:\n{log_path.read_text()[-3000:]}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def json_lines(log_path: Path) -> list[dict[str, Any]]:
    """Every complete stderr line, parsed as JSON (fails on any line that is not)."""
    text = log_path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def test_served_request_logs_json_lines_and_exports_its_span(
    tmp_path: Path, otlp_receiver: OTLPReceiver
) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(
        PYTHONUNBUFFERED="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_receiver.port}",
        OTEL_SERVICE_NAME="tandem-e2e",
    )
    log_path = tmp_path / "serve.log"
    proc, url = start_serve(log_path, env)
    try:
        chunks = stream_chat(
            url,
            {"messages": MESSAGES, "max_tokens": 24, "ignore_eos": True, "temperature": 0},
            headers={"traceparent": TRACEPARENT, "X-Request-Id": "log-test-1"},
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    usage = chunks[-1]["usage"]
    lines = json_lines(log_path)
    assert all({"event", "level", "timestamp", "logger"} <= line.keys() for line in lines)

    [finished] = [line for line in lines if line["event"] == "request_finished"]
    assert finished["request_id"] == "log-test-1" and finished["trace_id"] == CALLER_TRACE_ID
    assert finished["completion_tokens"] == usage["completion_tokens"] == 24
    assert finished["prompt_tokens"] == usage["prompt_tokens"]
    # Per step at DEBUG only, tagged with the actor; nothing at INFO repeats per token.
    steps = [line for line in lines if line["event"] == "engine_step"]
    assert len(steps) >= 24 and {(s["level"], s["actor"]) for s in steps} == {("debug", "sampler")}
    # engine_throughput is periodic (one per interval of wall time, however slow the machine).
    info_events = Counter(
        line["event"]
        for line in lines
        if line["level"] != "debug" and line["event"] != "engine_throughput"
    )
    assert max(info_events.values()) < 5, info_events
    assert any(line["logger"] == "hypercorn.access" for line in lines)
    # Two processes, each line named: the front end and the engine core.
    assert {line["process"] for line in lines if "process" in line} == {
        "api_server_0",
        "engine_core",
    }
    assert finished["process"] == "api_server_0"
    [started] = [line for line in lines if line["event"] == "engine_started"]
    assert started["process"] == "engine_core" and started["pid"] != proc.pid
    assert started["device"] == "cpu" and started["runner"] in ("v1", "v2")
    assert started["runner_reason"] and started["config"]["max_model_len"] == 512
    assert (started["kv_cache_blocks"], started["kv_cache_tokens"]) == (64, 64 * 16)
    assert started["kv_cache_bytes"] > 0

    spans = [
        span
        for export in otlp_receiver.exports
        for resource_spans in export.request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    [span] = spans
    assert span.trace_id.hex() == CALLER_TRACE_ID and span.parent_span_id.hex() == CALLER_SPAN_ID
    attributes = {a.key: any_value(a.value) for a in span.attributes}
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
