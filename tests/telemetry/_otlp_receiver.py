"""A tiny OTLP/HTTP trace receiver on 127.0.0.1 for the telemetry tests: it parses every
protobuf export it is sent."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class ReceivedExport:
    path: str
    headers: dict[str, str]
    request: ExportTraceServiceRequest


@dataclass
class OTLPReceiver:
    port: int
    exports: list[ReceivedExport] = field(default_factory=list)


def _handler_for(receiver: OTLPReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            receiver.exports.append(
                ReceivedExport(self.path, {k.lower(): v for k, v in self.headers.items()}, request)
            )
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def running_otlp_receiver() -> Iterator[OTLPReceiver]:
    receiver = OTLPReceiver(port=0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(receiver))
    receiver.port = server.server_address[1]
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.02},
        name="otlp-receiver",
        daemon=True,
    )
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def any_value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    assert kind is not None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    return getattr(value, kind)
