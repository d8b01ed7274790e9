"""The SERVER span of one request, with OpenTelemetry's GenAI attributes.

Created by `Tracing.start_request`; ended once: by `finish(records)` when the engine is done
with the request, by `fail(error_type, ...)` when it is refused or breaks, or by
`disconnect()` when the client left before the engine's records arrived. Every later call
is ignored. The phases become span events at their real times (from the records):
`queued`, `scheduled` (prefill start), `first_token`, `finished`. A request that
verified speculative drafts carries `tandem.spec_decode.num_draft_tokens`,
`.num_accepted_tokens` and `.acceptance_rate`.

Attribute names follow the GenAI semantic conventions (gen_ai.request.*, gen_ai.response.*,
gen_ai.usage.*), plus vLLM's gen_ai.latency.* names for the phase durations, so trace
queries written for vLLM keep working.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from telemetry.records import RequestRecord

PROVIDER_NAME = "tandem"
ENGINE_ERROR_TYPE = "engine_error"
"""error.type of a request the engine finished with reason 'error'."""


def request_attributes(
    operation: str, model: str | None, params: Any, stream: bool | None, response_id: str | None
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER_NAME,
    }
    if model is not None:
        attributes["gen_ai.request.model"] = model
        attributes["gen_ai.response.model"] = model
    if stream is not None:
        attributes["gen_ai.request.stream"] = stream
    if response_id is not None:
        attributes["gen_ai.response.id"] = response_id
    if params is not None:
        attributes.update(_sampling_attributes(params))
    return attributes


def _sampling_attributes(params: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.request.temperature": float(params.temperature),
        "gen_ai.request.top_p": float(params.top_p),
    }
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = params.max_tokens
    if params.top_k > 0:  # -1 and 0 mean top-k is off
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    if params.n != 1:
        attributes["gen_ai.request.choice.count"] = params.n
    if params.frequency_penalty:
        attributes["gen_ai.request.frequency_penalty"] = float(params.frequency_penalty)
    if params.presence_penalty:
        attributes["gen_ai.request.presence_penalty"] = float(params.presence_penalty)
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = list(params.stop)
    return attributes


class RequestSpan:
    __slots__ = ("_arrival_time", "_offset_ns", "_operation", "_span")

    def __init__(self, span: Any, operation: str, arrival_time: float, offset_ns: int) -> None:
        self._span = span
        self._operation = operation
        self._arrival_time = arrival_time
        self._offset_ns = offset_ns

    @staticmethod
    def clock_offset_ns() -> int:
        """Epoch minus monotonic clock, in ns: converts the engine's monotonic times."""
        return time.time_ns() - time.monotonic_ns()

    @staticmethod
    def to_epoch_ns(monotonic_s: float, offset_ns: int) -> int:
        return int(monotonic_s * 1e9) + offset_ns

    @property
    def trace_id(self) -> str | None:
        """The trace id as 32 hex digits (for log lines); None when tracing is off."""
        if self._span is None:
            return None
        return format(self._span.get_span_context().trace_id, "032x")

    @property
    def is_recording(self) -> bool:
        return self._span is not None and self._span.is_recording()

    def set_request(
        self,
        model: str,
        params: Any = None,
        *,
        stream: bool | None = None,
        response_id: str | None = None,
    ) -> None:
        """Fill in what was not known when the span started (after the body is parsed)."""
        if self._span is None:
            return
        self._span.update_name(f"{self._operation} {model}")
        self._span.set_attributes(
            request_attributes(self._operation, model, params, stream, response_id)
        )

    def finish(
        self,
        records: RequestRecord | Sequence[RequestRecord],
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_input_tokens: int | None = None,
    ) -> None:
        """End the span at the last record's finish time, with usage, finish reasons, the
        phase events and latencies. `records` holds one entry per choice (n > 1). The token
        counts default to sums over the records; pass the response's usage when several
        choices share one prompt (usage counts that prompt once)."""
        if self._span is None:
            return
        records = (records,) if isinstance(records, RequestRecord) else tuple(records)
        if not records:
            raise ValueError("finish needs at least one RequestRecord")
        span, self._span = self._span, None
        span.set_attributes(
            self._usage_attributes(records, input_tokens, output_tokens, cached_input_tokens)
        )
        timeline = _Timeline.of(records)
        for name, when in (
            ("queued", timeline.queued),
            ("scheduled", timeline.scheduled),
            ("first_token", timeline.first_token),
        ):
            if when is not None:
                span.add_event(name, timestamp=self.to_epoch_ns(when, self._offset_ns))
        reasons = [r.finish_reason for r in records]
        span.add_event(
            "finished",
            {"gen_ai.response.finish_reasons": reasons},
            timestamp=self.to_epoch_ns(timeline.finished, self._offset_ns),
        )
        span.set_attributes(timeline.latency_attributes(self._arrival_time))
        if "error" in reasons:
            _set_error(span, ENGINE_ERROR_TYPE, "the engine failed the request")
        span.end(end_time=self.to_epoch_ns(timeline.finished, self._offset_ns))

    def fail(
        self,
        error_type: str,
        message: str | None = None,
        *,
        exception: BaseException | None = None,
        end_time: float | None = None,
    ) -> None:
        """End the span as failed: status ERROR, `error.type` (low cardinality: an HTTP
        status like '429', or an exception class name), the message as status description.
        `end_time` (monotonic) defaults to now."""
        if self._span is None:
            return
        span, self._span = self._span, None
        if exception is not None:
            span.record_exception(exception)
        _set_error(span, error_type, message)
        end_ns = time.time_ns() if end_time is None else self.to_epoch_ns(end_time, self._offset_ns)
        span.end(end_time=end_ns)

    def disconnect(self, end_time: float | None = None) -> None:
        """End the span because the client went away, with a `client_disconnected` event.
        Not a server error, so the status stays unset. `end_time` (monotonic) defaults to
        now. Prefer `finish(records)` (finish reason 'abort') when the records exist."""
        if self._span is None:
            return
        span, self._span = self._span, None
        end_ns = time.time_ns() if end_time is None else self.to_epoch_ns(end_time, self._offset_ns)
        span.add_event("client_disconnected", timestamp=end_ns)
        span.end(end_time=end_ns)

    def _usage_attributes(
        self,
        records: tuple[RequestRecord, ...],
        input_tokens: int | None,
        output_tokens: int | None,
        cached_input_tokens: int | None,
    ) -> dict[str, Any]:
        if input_tokens is None:
            input_tokens = sum(r.num_prompt_tokens for r in records)
        if output_tokens is None:
            output_tokens = sum(r.num_output_tokens for r in records)
        if cached_input_tokens is None:
            cached_input_tokens = sum(r.num_cached_tokens for r in records)
        attributes: dict[str, Any] = {
            "gen_ai.response.finish_reasons": [r.finish_reason for r in records],
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.usage.cache_read.input_tokens": cached_input_tokens,
        }
        num_drafts = sum(r.num_draft_tokens for r in records)
        if num_drafts:  # speculative decoding verified drafts for this request
            num_accepted = sum(r.num_accepted_tokens for r in records)
            attributes.update(
                {
                    "tandem.spec_decode.num_draft_tokens": num_drafts,
                    "tandem.spec_decode.num_accepted_tokens": num_accepted,
                    "tandem.spec_decode.acceptance_rate": num_accepted / num_drafts,
                }
            )
        return attributes


class _NoopRequestSpan(RequestSpan):
    """What `start_request` returns while tracing is off: every call does nothing."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(None, "", 0.0, 0)

    def set_request(
        self,
        model: str,
        params: Any = None,
        *,
        stream: bool | None = None,
        response_id: str | None = None,
    ) -> None:
        return None

    def finish(
        self,
        records: RequestRecord | Sequence[RequestRecord],
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_input_tokens: int | None = None,
    ) -> None:
        return None

    def fail(
        self,
        error_type: str,
        message: str | None = None,
        *,
        exception: BaseException | None = None,
        end_time: float | None = None,
    ) -> None:
        return None

    def disconnect(self, end_time: float | None = None) -> None:
        return None


NOOP_REQUEST_SPAN: RequestSpan = _NoopRequestSpan()


class _Timeline:
    """The request's phases across its choices: earliest start of each, latest finish."""

    __slots__ = ("finished", "first_token", "queued", "scheduled")

    def __init__(
        self,
        queued: float | None,
        scheduled: float | None,
        first_token: float | None,
        finished: float,
    ) -> None:
        self.queued, self.scheduled = queued, scheduled
        self.first_token, self.finished = first_token, finished

    @classmethod
    def of(cls, records: tuple[RequestRecord, ...]) -> _Timeline:
        return cls(
            _earliest(r.queued_time for r in records),
            _earliest(r.first_scheduled_time for r in records),
            _earliest(r.first_token_time for r in records),
            max(r.finish_time for r in records),
        )

    def latency_attributes(self, arrival_time: float) -> dict[str, float]:
        attributes = {"gen_ai.latency.e2e": self.finished - arrival_time}
        if self.queued is not None and self.scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = self.scheduled - self.queued
        if self.first_token is not None:
            ttft_s = self.first_token - arrival_time
            attributes["gen_ai.response.time_to_first_chunk"] = ttft_s
            attributes["gen_ai.latency.time_to_first_token"] = ttft_s
            attributes["gen_ai.latency.time_in_model_decode"] = self.finished - self.first_token
            if self.scheduled is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = (
                    self.first_token - self.scheduled
                )
        return attributes


def _earliest(times: Any) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def _set_error(span: Any, error_type: str, message: str | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message))
