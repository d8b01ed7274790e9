"""What telemetry needs to know about one finished engine request.

A `RequestRecord` is built once, when a request finishes, by whoever holds its timeline,
and handed to `EngineMetrics.observe_request_finished` and `RequestSpan.finish`. Every time
is `time.monotonic()` in seconds, so intervals are exact within the process.

Phases follow vLLM's definitions:

    arrival -> queued -> first_scheduled -> first_token -> finished
    |-- e2e ---------------------------------------------------|
    |-- time to first token ----------------> |
               |- queue -|- prefill ---------|-- decode ------|
                         |-- inference -----------------------|
"""

from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length", "abort", "error")
"""The finish reasons the engine produces (vllm:request_success_total's label values)."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    arrival_time: float
    """When the request reached the server (before tokenization), time.monotonic()."""
    finish_time: float
    """When the request finished (its last token, or the abort/error)."""
    finish_reason: str
    """'stop', 'length', 'abort' or 'error'."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    queued_time: float | None = None
    """When the scheduler queued the request; None if it never got there."""
    first_scheduled_time: float | None = None
    """When the request was first scheduled (prefill start); None if it never ran."""
    first_token_time: float | None = None
    """When its first output token arrived; None if it produced none."""
    inter_token_latencies_s: tuple[float, ...] = ()
    """Gaps between successive output chunks after the first (vLLM bench's ITL). One entry
    per chunk, not per token, when several tokens arrive together."""
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified for the request."""
    num_accepted_tokens: int = 0
    """Of those, the accepted ones."""

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0 or self.num_output_tokens < 0 or self.num_cached_tokens < 0:
            raise ValueError(
                f"request {self.request_id!r}: token counts must be >= 0, got "
                f"prompt={self.num_prompt_tokens} output={self.num_output_tokens} "
                f"cached={self.num_cached_tokens}"
            )
        if self.finish_time < self.arrival_time:
            raise ValueError(
                f"request {self.request_id!r}: finish_time {self.finish_time} is "
                f"before arrival_time {self.arrival_time}"
            )

    @property
    def e2e_latency_s(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def time_to_first_token_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time_s(self) -> float | None:
        """Waiting in the scheduler's queue: queued -> first scheduled."""
        if self.queued_time is None or self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.queued_time

    @property
    def prefill_time_s(self) -> float | None:
        """First scheduled -> first token."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time_s(self) -> float | None:
        """First token -> finish."""
        if self.first_token_time is None:
            return None
        return self.finish_time - self.first_token_time

    @property
    def inference_time_s(self) -> float | None:
        """First scheduled -> finish (prefill plus decode)."""
        if self.first_scheduled_time is None:
            return None
        return self.finish_time - self.first_scheduled_time

    @property
    def time_per_output_token_s(self) -> float | None:
        """Decode time over the tokens after the first; None below two output tokens."""
        decode_time_s = self.decode_time_s
        if decode_time_s is None or self.num_output_tokens < 2:
            return None
        return decode_time_s / (self.num_output_tokens - 1)
