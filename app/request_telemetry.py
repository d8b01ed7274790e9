"""The telemetry of one generation request (a chat or text completion): its SERVER span and
the server's per-request metrics, ended exactly once however the request ends.

    call = RequestTelemetry.start(state.tracing, state.metrics, "chat", request.headers)
    call.set_request(model, params, stream=True, response_id="chatcmpl-...")
    ...
    call.end(choices, prompt_lens)                    # the engine's records have arrived
    call.end(choices, prompt_lens, disconnected=True) # the client went away
    call.refused(api_error, state.phase)              # answered with an HTTP error
    call.failed(exc)                                  # a bug

With tracing off the span is a shared do-nothing object, so a request costs the clock read
and a few calls that return at once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from app.errors import APIError
from app.responses import ChoiceState, usage
from telemetry.metrics import EngineMetrics
from telemetry.records import RequestRecord
from telemetry.request_span import ENGINE_ERROR_TYPE, RequestSpan
from telemetry.tracing import Tracing

log = structlog.get_logger("tandem.server")

_REJECTION_BY_PHASE = {"loading": "loading", "draining": "draining", "stalled": "engine_stalled"}


def rejection_reason(status: int, server_phase: str) -> str | None:
    """The `tandem:rejected_requests` label for a request refused before the engine saw it:
    429 when admission is full, 503 while loading, draining, while the engine is stalled or
    after it stopped.
    None for statuses that are the request's own fault (400, 404, ...)."""
    if status == 429:
        return "overloaded"
    if status == 503:
        return _REJECTION_BY_PHASE.get(server_phase, "engine_stopped")
    return None


class RequestTelemetry:
    __slots__ = ("_ended", "_metrics", "_params", "arrival_time", "span")

    def __init__(self, span: RequestSpan, metrics: EngineMetrics, arrival_time: float) -> None:
        self.span = span
        self._metrics = metrics
        self.arrival_time = arrival_time
        """time.monotonic() when the request arrived; the engine requests carry it too."""
        self._ended = False
        self._params: Any = None

    @classmethod
    def start(
        cls, tracing: Tracing, metrics: EngineMetrics, operation: str, headers: Mapping[str, str]
    ) -> RequestTelemetry:
        """Stamp the arrival and open the span ('chat' or 'text_completion'), parented on
        the caller's `traceparent` header."""
        arrival_time = time.monotonic()
        span = tracing.start_request(operation, arrival_time=arrival_time, headers=headers)
        return cls(span, metrics, arrival_time)

    @property
    def trace_id(self) -> str | None:
        return self.span.trace_id

    def set_request(
        self,
        model: str,
        params: Any = None,
        *,
        stream: bool | None = None,
        response_id: str | None = None,
    ) -> None:
        self.span.set_request(model, params, stream=stream, response_id=response_id)
        if params is not None:
            self._params = params

    def end(
        self,
        choices: Sequence[ChoiceState],
        prompt_lens: Sequence[int],
        *,
        disconnected: bool = False,
    ) -> None:
        """The request is over; logs one `request_finished` line. With every choice's
        engine record the span ends with usage (as the response counts it) and the phase
        events; a client that left first ends it as disconnected; otherwise the engine
        ended a choice without a record (it stopped), which is an engine error."""
        if self._ended:
            return
        self._ended = True
        if disconnected:
            self._metrics.record_disconnect()
        records = [c.record for c in choices if c.record is not None]
        totals = usage(prompt_lens, choices)
        if self._params is not None:
            self._metrics.request_shape.observe_api_request(
                self._params.n, self._params.max_tokens, [c.num_output_tokens for c in choices]
            )
        self._log_finished(choices, records, totals, disconnected)
        if records and len(records) == len(choices):
            self.span.finish(
                records,
                input_tokens=totals["prompt_tokens"],
                output_tokens=totals["completion_tokens"],
                cached_input_tokens=totals["prompt_tokens_details"]["cached_tokens"],
            )
        elif disconnected:
            self.span.disconnect()
        else:
            self.span.fail(ENGINE_ERROR_TYPE, "the engine ended the request without its record")

    def _log_finished(
        self,
        choices: Sequence[ChoiceState],
        records: Sequence[RequestRecord],
        totals: dict[str, Any],
        disconnected: bool,
    ) -> None:
        first_token_times = [r.first_token_time for r in records if r.first_token_time is not None]
        ttft_s = min(first_token_times) - self.arrival_time if first_token_times else None
        log.info(
            "request_finished",
            finish_reasons=[c.finish_reason for c in choices],
            prompt_tokens=totals["prompt_tokens"],
            completion_tokens=totals["completion_tokens"],
            cached_tokens=totals["prompt_tokens_details"]["cached_tokens"],
            ttft_s=None if ttft_s is None else round(ttft_s, 6),
            e2e_s=round(time.monotonic() - self.arrival_time, 6),
            disconnected=disconnected,
        )

    def refused(self, error: APIError, server_phase: str) -> None:
        """Answered with an HTTP error: the span fails with the status as `error.type`;
        an admission refusal (429, 503) is counted by reason."""
        if self._ended:
            return
        self._ended = True
        self.span.fail(str(error.status), error.message)
        reason = rejection_reason(error.status, server_phase)
        if reason is not None:
            self._metrics.record_rejection(reason)

    def failed(self, exc: BaseException) -> None:
        """An unexpected exception: the span fails with the exception's class name."""
        if self._ended:
            return
        self._ended = True
        self.span.fail(type(exc).__name__, exception=exc)
