"""OpenTelemetry traces, configured by the standard OTEL_* environment variables.

    tracing = setup_tracing("tandem")            # once, at startup
    span = tracing.start_request("chat", model, arrival_time=t0, headers=request.headers,
                                 params=params, stream=True, response_id=response_id)
    ...
    span.finish(records)          # or span.fail("429", "queue full"), span.disconnect()
    tracing.shutdown()            # flushes what is queued

Tracing is on when OTEL_SDK_DISABLED is not true and an endpoint is set
(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT), or when an exporter is
passed in. Spans go out in batches (BatchSpanProcessor, tuned by OTEL_BSP_*) over OTLP
HTTP/protobuf unless OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL says grpc; the exporter itself
reads OTEL_EXPORTER_OTLP_* headers, timeout, compression and certificates, the provider
reads OTEL_TRACES_SAMPLER[_ARG] and the OTEL_*_LIMIT variables, and OTEL_SERVICE_NAME /
OTEL_RESOURCE_ATTRIBUTES override the service name given in code. OTEL_TRACES_EXPORTER may
be otlp (default), console or none.

When tracing is off, `start_request` returns a shared do-nothing span: no span object, no
attribute dict and no header parsing happen per request. Nothing here runs per token or
per step; one SERVER span per request carries events for its phases.

The provider is private to the returned `Tracing` (not installed as the global one), so
several servers in one process (tests) keep their spans apart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.propagators.textmap import Getter

from telemetry.request_span import NOOP_REQUEST_SPAN, RequestSpan, request_attributes

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_TRUE_VALUES = frozenset({"true", "1", "yes", "on"})
PROCESS_NAME_ENV = "TANDEM_PROCESS_NAME"
"""Set by `tandem serve` in each process it starts ('api_server_N'); spans carry it."""
_TRACER_NAME = "tandem"
_propagator: TraceContextTextMapPropagator | None = None


class TracingConfigError(ValueError):
    """The OTEL_* variables ask for something this server cannot do; the message says what."""


class Tracing:
    """Holds the tracer provider (None when tracing is off) and starts request spans."""

    __slots__ = ("_provider", "_tracer")

    def __init__(self, provider: TracerProvider | None) -> None:
        self._provider = provider
        self._tracer = None if provider is None else provider.get_tracer(_TRACER_NAME)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start_request(
        self,
        operation: str,
        model: str | None = None,
        *,
        arrival_time: float,
        headers: Mapping[str, str] | None = None,
        params: Any = None,
        stream: bool | None = None,
        response_id: str | None = None,
    ) -> RequestSpan:
        """Open the SERVER span of one HTTP request, named `{operation} {model}`, starting
        at `arrival_time` (time.monotonic()) and parented on the caller's `traceparent`
        header (`headers=None`: on the current context instead). `operation` is 'chat' or
        'text_completion'; `params` (SamplingParams), `stream` and `response_id` become
        gen_ai.request.* / gen_ai.response.id attributes and may instead be given later with
        `RequestSpan.set_request`."""
        if self._tracer is None:
            return NOOP_REQUEST_SPAN
        from opentelemetry.trace import SpanKind

        name = operation if model is None else f"{operation} {model}"
        parent = extract_context(headers) if headers is not None else None
        offset_ns = RequestSpan.clock_offset_ns()
        span = self._tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=request_attributes(operation, model, params, stream, response_id),
            start_time=RequestSpan.to_epoch_ns(arrival_time, offset_ns),
        )
        return RequestSpan(span, operation, arrival_time, offset_ns)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export every ended span now; False if the exporter did not finish in time."""
        return True if self._provider is None else self._provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Flush queued spans and stop the exporter. Later spans are dropped."""
        if self._provider is not None:
            self._provider.shutdown()


def setup_tracing(service_name: str = "tandem", exporter: SpanExporter | None = None) -> Tracing:
    """A `Tracing` configured from the OTEL_* variables (see the module doc). `exporter`
    replaces the one the variables would pick (tests pass an InMemorySpanExporter);
    OTEL_SDK_DISABLED=true still turns everything off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE_VALUES:
        return Tracing(None)
    exporters = [exporter] if exporter is not None else _exporters_from_env()
    if not exporters:
        return Tracing(None)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=_resource(service_name))
    for span_exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
    return Tracing(provider)


def extract_context(headers: Mapping[str, str]) -> Context:
    """The caller's trace context from W3C `traceparent` / `tracestate` headers (any
    letter case); an empty context (a new trace) when they are missing or malformed."""
    global _propagator
    if _propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _propagator = TraceContextTextMapPropagator()
    return _propagator.extract(headers, getter=_HEADER_GETTER)


class _CaseInsensitiveGetter(Getter[Mapping[str, str]]):
    """Reads a header from Starlette's Headers (already case-insensitive) or a plain dict."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            value = next((v for k, v in carrier.items() if k.lower() == key), None)
        return None if value is None else [value]

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier.keys())


_HEADER_GETTER = _CaseInsensitiveGetter()


def _exporters_from_env() -> list[SpanExporter]:
    names = [
        name.strip().lower()
        for name in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
        if name.strip()
    ]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "none":
            return []
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            otlp = _otlp_exporter_from_env()
            if otlp is not None:
                exporters.append(otlp)
        else:
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER={name!r} is not supported; use otlp, console or none"
            )
    return exporters


def _otlp_exporter_from_env() -> SpanExporter | None:
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    ):
        return None
    protocol_var = (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
        if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        else "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    protocol = os.environ.get(protocol_var, "").strip().lower() or "http/protobuf"
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError:
            raise TracingConfigError(
                f"{protocol_var}=grpc needs the opentelemetry-exporter-otlp-proto-grpc "
                f"package; install it or set {protocol_var}=http/protobuf"
            ) from None
        grpc_exporter: SpanExporter = GrpcSpanExporter()
        return grpc_exporter
    raise TracingConfigError(
        f"{protocol_var}={protocol!r} is not supported; use http/protobuf or grpc"
    )


def _resource(service_name: str) -> Any:
    from opentelemetry.sdk.resources import Resource

    from_env = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    # Every process of a server exports its own spans: name the process in each.
    process = Resource(
        {
            "process.pid": os.getpid(),
            "tandem.process": os.environ.get(PROCESS_NAME_ENV, "api_server_0"),
        }
    )
    configured = str(from_env.attributes.get("service.name", ""))
    if configured and not configured.startswith("unknown_service"):
        return from_env.merge(process)
    return from_env.merge(Resource({"service.name": service_name})).merge(process)
