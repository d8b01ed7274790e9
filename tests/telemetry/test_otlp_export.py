"""The real OTLP HTTP exporter, configured only by OTEL_* variables, delivers spans to a
receiver on 127.0.0.1 that decodes them with opentelemetry-proto."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from actors.protocol.sampling_params import SamplingParams
from telemetry.records import RequestRecord
from telemetry.tracing import setup_tracing
from tests.telemetry._otlp_receiver import (
    OTLPReceiver,
    ReceivedExport,
    any_value,
    running_otlp_receiver,
)

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with running_otlp_receiver() as running:
        yield running


@pytest.fixture(autouse=True)
def otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OTEL_SDK_DISABLED",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_TRACES_SAMPLER",
    ):
        monkeypatch.delenv(name, raising=False)
    # A proxy from the environment must not intercept the loopback receiver.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "tandem-otlp-test")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tandem-test=yes")


def export_one_request_span() -> None:
    tracing = setup_tracing("tandem")
    assert tracing.enabled
    arrival = time.monotonic()
    span = tracing.start_request(
        "chat",
        "smollm2",
        arrival_time=arrival,
        headers={"traceparent": TRACEPARENT},
        params=SamplingParams(max_tokens=9, seed=5),
        stream=True,
        response_id="chatcmpl-otlp",
    )
    span.finish(
        RequestRecord(
            "r1",
            arrival,
            arrival + 0.05,
            "length",
            num_prompt_tokens=12,
            num_output_tokens=9,
            num_cached_tokens=0,
            queued_time=arrival + 0.001,
            first_scheduled_time=arrival + 0.002,
            first_token_time=arrival + 0.01,
        )
    )
    tracing.shutdown()  # flushes the batch processor: the export has happened on return


def only_span(receiver: OTLPReceiver) -> tuple[ReceivedExport, ProtoSpan]:
    spans = [
        (export, span)
        for export in receiver.exports
        for resource_spans in export.request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    assert len(spans) == 1
    return spans[0]


def test_generic_endpoint_variable_sends_to_v1_traces(
    monkeypatch: pytest.MonkeyPatch, receiver: OTLPReceiver
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
    export_one_request_span()
    export, span = only_span(receiver)
    assert export.path == "/v1/traces"
    assert export.headers["content-type"] == "application/x-protobuf"
    assert export.headers["x-tandem-test"] == "yes"
    [resource_spans] = export.request.resource_spans
    resource = {a.key: any_value(a.value) for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "tandem-otlp-test"

    assert span.name == "chat smollm2"
    assert span.kind == ProtoSpan.SpanKind.SPAN_KIND_SERVER
    assert span.trace_id.hex() == CALLER_TRACE_ID
    assert span.parent_span_id.hex() == CALLER_SPAN_ID
    attributes = {a.key: any_value(a.value) for a in span.attributes}
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "smollm2"
    assert attributes["gen_ai.request.max_tokens"] == 9
    assert attributes["gen_ai.request.seed"] == 5
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.response.id"] == "chatcmpl-otlp"
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gen_ai.usage.input_tokens"] == 12
    assert attributes["gen_ai.usage.output_tokens"] == 9
    assert [e.name for e in span.events] == ["queued", "scheduled", "first_token", "finished"]
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(
        0.05, abs=2e-6
    )


def test_traces_endpoint_variable_is_used_as_is(
    monkeypatch: pytest.MonkeyPatch, receiver: OTLPReceiver
) -> None:
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.port}/collector/traces"
    )
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    export_one_request_span()
    export, span = only_span(receiver)
    assert export.path == "/collector/traces"
    assert export.headers.get("content-encoding") == "gzip"
    assert span.parent_span_id.hex() == CALLER_SPAN_ID
