"""What the telemetry tests of a real `tandem serve` share: the caller's trace context, a
chat message, and a streamed chat request."""

from __future__ import annotations

import json
from typing import Any

import httpx

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


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
