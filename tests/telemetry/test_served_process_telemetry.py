"""Telemetry of a served `tandem serve` process end to end: the JSON log lines of a
streamed chat request on stderr, and its SERVER span exported over OTLP to a receiver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._embedded_model import embedded_gguf_path
from tests.telemetry._otlp_receiver import OTLPReceiver, any_value, running_otlp_receiver
from tests.telemetry._telemetry_helpers import (
    CALLER_SPAN_ID,
    CALLER_TRACE_ID,
    MESSAGES,
    TRACEPARENT,
    stream_chat,
)

pytestmark = pytest.mark.slow


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
