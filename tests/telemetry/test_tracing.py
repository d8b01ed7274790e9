from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import telemetry.request_span as request_span_module
from actors.protocol.sampling_params import SamplingParams
from telemetry.records import RequestRecord
from telemetry.request_span import NOOP_REQUEST_SPAN
from telemetry.tracing import Tracing, TracingConfigError, extract_context, setup_tracing

CALLER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"
OTEL_VARIABLES = (
    "OTEL_SDK_DISABLED",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_TRACES_EXPORTER",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
)


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter: InMemorySpanExporter) -> Iterator[Tracing]:
    tracing = setup_tracing("tandem-test", exporter=exporter)
    yield tracing
    tracing.shutdown()


def finished_spans(tracing: Tracing, exporter: InMemorySpanExporter) -> tuple[ReadableSpan, ...]:
    assert tracing.force_flush()
    return exporter.get_finished_spans()


def streamed_record(arrival: float, request_id: str = "req-1") -> RequestRecord:
    """A request that queued 2 ms after arrival, ran 3 ms later, had its first token 40 ms
    later and finished after 7 tokens at arrival + 0.2 s."""
    return RequestRecord(
        request_id=request_id,
        arrival_time=arrival,
        finish_time=arrival + 0.2,
        finish_reason="stop",
        num_prompt_tokens=21,
        num_output_tokens=7,
        num_cached_tokens=16,
        queued_time=arrival + 0.002,
        first_scheduled_time=arrival + 0.005,
        first_token_time=arrival + 0.045,
        inter_token_latencies_s=(0.025,) * 6,
    )


def span_attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def ns_after_start(span: ReadableSpan, timestamp_ns: int | None) -> float:
    assert timestamp_ns is not None and span.start_time is not None
    return (timestamp_ns - span.start_time) / 1e9


def test_streamed_chat_span_is_a_child_of_the_caller_with_genai_attributes(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    arrival = time.monotonic()
    params = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=40, seed=1234)
    span = tracing.start_request(
        "chat",
        "smollm2",
        arrival_time=arrival,
        headers={"traceparent": TRACEPARENT},
        params=params,
        stream=True,
        response_id="chatcmpl-abc",
    )
    assert span.trace_id == CALLER_TRACE_ID
    span.finish(streamed_record(arrival))
    [server_span] = finished_spans(tracing, exporter)

    assert server_span.name == "chat smollm2" and server_span.kind is SpanKind.SERVER
    assert server_span.parent is not None and server_span.parent.is_remote
    assert format(server_span.parent.span_id, "016x") == CALLER_SPAN_ID
    assert format(server_span.context.trace_id, "032x") == CALLER_TRACE_ID
    attributes = span_attributes(server_span)
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "smollm2"
    assert attributes["gen_ai.response.model"] == "smollm2"
    assert attributes["gen_ai.request.max_tokens"] == 7
    assert attributes["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.request.top_k"] == 40
    assert attributes["gen_ai.request.seed"] == 1234
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.response.id"] == "chatcmpl-abc"
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert attributes["gen_ai.usage.input_tokens"] == 21
    assert attributes["gen_ai.usage.output_tokens"] == 7
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == 16
    assert attributes["gen_ai.response.time_to_first_chunk"] == pytest.approx(0.045, abs=1e-6)
    assert attributes["gen_ai.latency.time_in_queue"] == pytest.approx(0.003, abs=1e-6)
    assert attributes["gen_ai.latency.e2e"] == pytest.approx(0.2, abs=1e-6)


def test_phase_events_sit_at_their_real_times(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    arrival = time.monotonic() - 1.0  # the request arrived a second ago
    span = tracing.start_request("chat", "smollm2", arrival_time=arrival)
    span.finish(streamed_record(arrival))
    [server_span] = finished_spans(tracing, exporter)
    events = [(e.name, ns_after_start(server_span, e.timestamp)) for e in server_span.events]
    assert [name for name, _ in events] == ["queued", "scheduled", "first_token", "finished"]
    assert [offset for _, offset in events] == pytest.approx([0.002, 0.005, 0.045, 0.2], abs=2e-6)
    assert ns_after_start(server_span, server_span.end_time) == pytest.approx(0.2, abs=2e-6)
    # The span starts at the arrival, not at the moment start_request ran.
    assert server_span.start_time is not None
    assert time.time_ns() - server_span.start_time == pytest.approx(1e9, rel=0.05)


def test_request_details_can_come_after_the_span_started(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    arrival = time.monotonic()
    span = tracing.start_request("text_completion", arrival_time=arrival)
    span.set_request(
        "smollm2", SamplingParams(max_tokens=5, n=2), stream=False, response_id="cmpl-1"
    )
    span.finish(
        [
            streamed_record(arrival, "a"),
            RequestRecord("b", arrival, arrival + 0.3, "length", 21, 5),
        ],
        input_tokens=21,
    )
    [server_span] = finished_spans(tracing, exporter)
    attributes = span_attributes(server_span)
    assert server_span.name == "text_completion smollm2"
    assert attributes["gen_ai.request.choice.count"] == 2
    assert attributes["gen_ai.request.stream"] is False
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("stop", "length")
    assert attributes["gen_ai.usage.input_tokens"] == 21  # the shared prompt, counted once
    assert attributes["gen_ai.usage.output_tokens"] == 12
    assert ns_after_start(server_span, server_span.end_time) == pytest.approx(0.3, abs=2e-6)
    assert "gen_ai.request.top_k" not in attributes  # top-k off (-1) is not reported


def test_refused_request_sets_error_status_and_type(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span = tracing.start_request("chat", "smollm2", arrival_time=time.monotonic())
    span.fail("429", "too many requests queued")
    span.finish(streamed_record(time.monotonic()))  # already ended: ignored
    [server_span] = finished_spans(tracing, exporter)
    assert server_span.status.status_code is StatusCode.ERROR
    assert server_span.status.description == "too many requests queued"
    assert span_attributes(server_span)["error.type"] == "429"
    assert not any(e.name == "finished" for e in server_span.events)


def test_exception_is_recorded_on_failure(tracing: Tracing, exporter: InMemorySpanExporter) -> None:
    span = tracing.start_request("chat", "smollm2", arrival_time=time.monotonic())
    span.fail("ValueError", exception=ValueError("bad template"))
    [server_span] = finished_spans(tracing, exporter)
    [event] = server_span.events
    assert event.name == "exception"
    assert (event.attributes or {})["exception.message"] == "bad template"
    assert span_attributes(server_span)["error.type"] == "ValueError"


def test_client_disconnect_ends_the_span_without_an_error(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    arrival = time.monotonic()
    span = tracing.start_request("chat", "smollm2", arrival_time=arrival)
    span.disconnect(end_time=arrival + 0.5)
    span.fail("500")  # already ended: ignored
    [server_span] = finished_spans(tracing, exporter)
    assert server_span.status.status_code is StatusCode.UNSET
    assert [e.name for e in server_span.events] == ["client_disconnected"]
    assert ns_after_start(server_span, server_span.end_time) == pytest.approx(0.5, abs=2e-6)


def test_engine_error_finish_marks_the_span_failed(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    arrival = time.monotonic()
    span = tracing.start_request("chat", "smollm2", arrival_time=arrival)
    span.finish(
        RequestRecord("r", arrival, arrival + 0.01, "error", 5, 0, queued_time=arrival + 0.001)
    )
    [server_span] = finished_spans(tracing, exporter)
    assert server_span.status.status_code is StatusCode.ERROR
    assert span_attributes(server_span)["error.type"] == "engine_error"
    assert [e.name for e in server_span.events] == ["queued", "finished"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"traceparent": "00-not-a-trace-01"},
        {"traceparent": f"00-{'0' * 32}-{CALLER_SPAN_ID}-01"},
    ],
)
def test_missing_or_malformed_traceparent_starts_a_new_trace(
    tracing: Tracing, exporter: InMemorySpanExporter, headers: dict[str, str]
) -> None:
    span = tracing.start_request("chat", "m", arrival_time=time.monotonic(), headers=headers)
    span.fail("499")
    [server_span] = finished_spans(tracing, exporter)
    assert server_span.parent is None


def test_header_names_are_matched_in_any_case_and_tracestate_is_kept() -> None:
    from opentelemetry.trace import get_current_span

    context = extract_context({"Traceparent": TRACEPARENT, "TraceState": "vendor=abc"})
    span_context = get_current_span(context).get_span_context()
    assert format(span_context.trace_id, "032x") == CALLER_TRACE_ID
    assert span_context.trace_state.get("vendor") == "abc"


@pytest.mark.parametrize(
    ("env_service_name", "expected"), [(None, "tandem-test"), ("from-env", "from-env")]
)
def test_service_name_comes_from_code_unless_the_environment_sets_it(
    monkeypatch: pytest.MonkeyPatch,
    exporter: InMemorySpanExporter,
    env_service_name: str | None,
    expected: str,
) -> None:
    if env_service_name is not None:
        monkeypatch.setenv("OTEL_SERVICE_NAME", env_service_name)
    tracing = setup_tracing("tandem-test", exporter=exporter)
    tracing.start_request("chat", "m", arrival_time=time.monotonic()).fail("500")
    [span] = finished_spans(tracing, exporter)
    assert span.resource.attributes["service.name"] == expected
    tracing.shutdown()


def test_sampler_variable_is_honoured(
    monkeypatch: pytest.MonkeyPatch, exporter: InMemorySpanExporter
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tracing = setup_tracing("t", exporter=exporter)
    span = tracing.start_request("chat", "m", arrival_time=time.monotonic())
    assert not span.is_recording
    span.fail("500")
    assert finished_spans(tracing, exporter) == ()
    tracing.shutdown()


# ---- off --------------------------------------------------------------------------------


def test_sdk_disabled_variable_turns_everything_off(
    monkeypatch: pytest.MonkeyPatch, exporter: InMemorySpanExporter
) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    tracing = setup_tracing("t", exporter=exporter)
    assert not tracing.enabled
    arrival = time.monotonic()
    span = tracing.start_request(
        "chat", "m", arrival_time=arrival, headers={"traceparent": TRACEPARENT}
    )
    assert span is NOOP_REQUEST_SPAN and span.trace_id is None
    span.set_request("m", SamplingParams(), stream=True, response_id="x")
    span.finish(streamed_record(arrival))
    span.fail("500")
    span.disconnect()
    assert tracing.force_flush() and exporter.get_finished_spans() == ()


@pytest.mark.parametrize(
    "variables",
    [{}, {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}],
)
def test_no_endpoint_or_exporter_none_means_off(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert not setup_tracing("t").enabled


def test_unsupported_protocol_or_exporter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(TracingConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        setup_tracing("t")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(TracingConfigError, match="zipkin"):
        setup_tracing("t")


def test_disabled_helpers_build_no_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(*args: object) -> None:
        raise AssertionError("attributes built while tracing is off")

    monkeypatch.setattr(request_span_module, "request_attributes", must_not_run)
    monkeypatch.setattr("telemetry.tracing.request_attributes", must_not_run)
    monkeypatch.setattr("telemetry.tracing.extract_context", must_not_run)
    tracing = Tracing(None)
    arrival = time.monotonic()
    span = tracing.start_request(
        "chat",
        "m",
        arrival_time=arrival,
        headers={"traceparent": TRACEPARENT},
        params=SamplingParams(),
    )
    span.set_request("m", SamplingParams(), stream=True)
    span.finish(streamed_record(arrival))


def per_request_overhead_s(tracing: Tracing, num_requests: int) -> float:
    """Seconds per request that the tracing calls of one request add to a loop that
    already builds the request's params and record (which the metrics need anyway)."""
    params = SamplingParams(max_tokens=16)
    headers = {"traceparent": TRACEPARENT}
    arrival = time.monotonic()
    record = streamed_record(arrival)

    def bare() -> float:
        started = time.perf_counter()
        for _ in range(num_requests):
            pass
        return time.perf_counter() - started

    def traced() -> float:
        started = time.perf_counter()
        for _ in range(num_requests):
            span = tracing.start_request(
                "chat",
                "m",
                arrival_time=arrival,
                headers=headers,
                params=params,
                stream=True,
                response_id="x",
            )
            trace_id = span.trace_id
            span.finish(record)
        assert trace_id is None
        return time.perf_counter() - started

    return min(traced() - bare() for _ in range(5)) / num_requests


def test_disabled_tracing_costs_next_to_nothing_per_request() -> None:
    overhead_s = per_request_overhead_s(Tracing(None), num_requests=20_000)
    print(f"disabled tracing: {overhead_s * 1e9:.0f} ns per request")
    assert overhead_s < 20e-6
