"""The sampler actor (the front end's output processing): turns each engine step's tokens
into per-request text.

For every request in an `EngineCoreOutputs` it detokenizes the new tokens, builds logprob
entries, looks for stop strings in the text and pushes the result to the request's
`RequestStream`. The engine core has already decided the token-level finishes (EOS, stop
token ids, min_tokens, max_tokens, context length); a stop string is the one finish decided
here, and the request is then aborted in the core (`on_stopped`).

min_tokens: stop strings count only once the output is longer than min_tokens (vLLM).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import assert_never

import structlog

from actors.frontend.detokenizer import IncrementalDetokenizer, NullDetokenizer, TokenDecoder
from actors.frontend.logprob_text import LogprobEntryBuilder
from actors.frontend.output_stream import LogprobEntry, RequestStream
from actors.frontend.stop_checker import StopStringChecker
from actors.protocol.mailbox import Actor
from actors.protocol.messages import (
    AbortRequests,
    AdmittedRequest,
    EngineCoreOutputs,
    EngineRequest,
    FailRequests,
    LogprobsArrays,
    PromptLogprobs,
    RegisterRequest,
    RequestFinish,
    SchedulerStats,
    StepStats,
    ToSampler,
)
from telemetry.records import RequestRecord

log = structlog.get_logger("tandem.sampler")


@dataclass(slots=True, eq=False)
class _RequestState:
    request: EngineRequest
    stream: RequestStream
    detokenizer: IncrementalDetokenizer | NullDetokenizer
    stop_checker: StopStringChecker | None
    num_output_tokens: int = 0
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies_s: list[float] | None = None
    """None unless the processor keeps records."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class OutputProcessor:
    """The sampler actor's state and logic, as a plain class.

    Requests are tracked from `add_request` until they finish; tokens that arrive for an
    untracked request (finished here, or aborted while a step was in flight) are ignored.
    With `tokenizer=None` outputs are token ids only (empty text). With
    `on_request_finished`, every finished request's `RequestRecord` goes to it and rides on
    the request's final delta.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder | None,
        *,
        on_request_finished: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._on_request_finished = on_request_finished
        self._requests: dict[str, _RequestState] = {}
        self._logprobs = LogprobEntryBuilder(tokenizer)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(self, request: EngineRequest, stream: RequestStream) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already being processed")
        params = request.sampling_params
        stop_checker = (
            StopStringChecker(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None
        )
        detokenizer = (
            NullDetokenizer()
            if self._tokenizer is None
            else IncrementalDetokenizer(
                self._tokenizer,
                # A prompt of embeddings has placeholder ids: its text starts afresh.
                () if request.prompt_embeds is not None else request.prompt_token_ids,
                params.skip_special_tokens,
            )
        )
        self._requests[request.request_id] = _RequestState(
            request=request,
            stream=stream,
            detokenizer=detokenizer,
            stop_checker=stop_checker,
            inter_token_latencies_s=None if self._on_request_finished is None else [],
        )

    def set_admitted(self, admitted: Sequence[AdmittedRequest]) -> None:
        """The core's part of each request's timeline, at its first admission."""
        for entry in admitted:
            state = self._requests.get(entry.request_id)
            if state is not None:
                state.stream.set_num_cached_tokens(entry.num_cached_tokens)
                state.queued_time = entry.queued_time
                state.first_scheduled_time = entry.first_scheduled_time

    def abort(self, request_id: str) -> bool:
        """Finish a request with reason 'abort'; returns whether it was still tracked."""
        return self._finish_early(request_id, "abort", None, time.monotonic())

    def finish(self, request_id: str, reason: str, error: str | None = None) -> bool:
        """Finish a request outside the token path; returns whether it was tracked."""
        return self._finish_early(request_id, reason, error, time.monotonic())

    def abort_all(self) -> list[str]:
        now = time.monotonic()
        return [rid for rid in list(self._requests) if self._finish_early(rid, "abort", None, now)]

    def fail_all(self, message: str) -> list[str]:
        """Finish every request with reason 'error' (the engine cannot go on)."""
        now = time.monotonic()
        return [
            rid for rid in list(self._requests) if self._finish_early(rid, "error", message, now)
        ]

    def process_outputs(self, outputs: EngineCoreOutputs) -> list[str]:
        """Apply one step's outputs. Returns the requests this processor ended on its own
        (stop string, reader gone, failed processing) that the core still runs."""
        now = time.monotonic()
        if outputs.admitted:
            self.set_admitted(outputs.admitted)
        if outputs.prompt_logprobs is not None:
            self._add_prompt_logprobs(outputs.prompt_logprobs)
        finished = {f.request_id: f for f in outputs.finished}
        to_abort: list[str] = []
        if outputs.request_ids:
            tokens: list[int] = outputs.new_token_ids.tolist()  # type: ignore[union-attr]
            counts = None if outputs.num_new_tokens is None else outputs.num_new_tokens.tolist()
            if outputs.num_draft_tokens is not None and counts is not None:
                self._count_drafts(outputs.request_ids, outputs.num_draft_tokens.tolist(), counts)
            start = 0
            for index, request_id in enumerate(outputs.request_ids):
                end = start + (1 if counts is None else counts[index])
                state = self._requests.get(request_id)
                if state is not None:
                    finish = finished.pop(request_id, None)
                    if (
                        self._process_tokens(
                            state, tokens, start, end, finish, outputs.logprobs, now
                        )
                        and finish is None
                    ):
                        to_abort.append(request_id)
                start = end
        for request_id, finish in finished.items():
            self._finish_early(request_id, finish.reason, finish.error, now)
        return to_abort

    def _count_drafts(
        self, request_ids: tuple[str, ...], num_drafts: list[int], counts: list[int]
    ) -> None:
        """A speculative step's drafts per request; a request's accepted drafts are its
        new tokens but one (a stop inside the run counts the tokens up to it)."""
        for request_id, drafts, count in zip(request_ids, num_drafts, counts):
            state = self._requests.get(request_id)
            if state is not None:
                state.num_draft_tokens += drafts
                state.num_accepted_tokens += min(count - 1, drafts)

    def _process_tokens(
        self,
        state: _RequestState,
        tokens: list[int],
        start: int,
        end: int,
        finish: RequestFinish | None,
        logprobs: LogprobsArrays | None,
        now: float,
    ) -> bool:
        """Push one request's new tokens; True once the request has ended."""
        request_id = state.request.request_id
        if state.stream.cancelled:
            return self._finish_early(request_id, "abort", None, now)
        pieces: list[str] = []
        entries: list[LogprobEntry] | None = (
            None if state.request.sampling_params.logprobs is None else []
        )
        reason: str | None = None
        stop_reason: str | int | None = None
        position = start
        try:
            for position in range(start, end):
                token_id = tokens[position]
                core_finish = finish if position == end - 1 else None
                if entries is not None:
                    num_top = state.request.sampling_params.logprobs or 0
                    entries.extend(self._logprobs.sampled(logprobs, position, token_id, num_top))
                reason, stop_reason, text = self._append_token(state, token_id, core_finish)
                pieces.append(text)
                if reason is not None:
                    break
        except Exception as exc:  # one bad request must not stop the front end
            log.error("output_processing_failed", request_id=request_id, exc_info=exc)
            return self._finish_early(
                request_id,
                "error",
                "processing the output failed "
                f"({type(exc).__name__}); the server log has the details",
                now,
            )
        error = finish.error if reason == "error" and finish is not None else None
        state.stream.push(
            tokens[start : position + 1],
            "".join(pieces),
            entries,
            finish_reason=reason,
            stop_reason=stop_reason,
            error=error,
            now=now,
        )
        self._note_token_time(state, now)
        if reason is not None:
            del self._requests[request_id]
            self._record(state, reason, now)
        return reason is not None

    def _append_token(
        self, state: _RequestState, token_id: int, finish: RequestFinish | None
    ) -> tuple[str | None, str | int | None, str]:
        """Returns (finish reason, stop reason, text to stream) for one new token."""
        state.num_output_tokens += 1
        params = state.request.sampling_params
        reason = finish.reason if finish is not None else None
        stop_reason: str | int | None = finish.stop_token_id if finish is not None else None
        # A grammar that completes stops on a token that belongs to the output.
        stopped_by_token = reason == "stop" and (
            stop_reason is not None or token_id in state.request.eos_token_ids
        )
        text = (
            ""
            if stopped_by_token and not params.include_stop_str_in_output
            else state.detokenizer.push((token_id,))
        )
        checker = state.stop_checker
        check_stop_strings = state.num_output_tokens > params.min_tokens
        if checker is not None:
            text, stop_string = checker.append(text, check_stop_strings)
            if stop_string is not None:
                return "stop", stop_string, text
        if reason is None:
            return None, None, text
        tail = state.detokenizer.flush()
        if checker is not None:
            tail, stop_string = checker.append(tail, check_stop_strings)
            if stop_string is not None:
                reason, stop_reason = "stop", stop_string
            tail += checker.flush()
        return reason, stop_reason, text + tail

    def _note_token_time(self, state: _RequestState, now: float) -> None:
        gaps = state.inter_token_latencies_s
        if gaps is not None:
            if state.last_token_time is not None:
                gaps.append(now - state.last_token_time)
            state.last_token_time = now

    def _add_prompt_logprobs(self, prompt: PromptLogprobs) -> None:
        """Each row scores the prompt token at its position (before any output token)."""
        row = 0
        for request_id, start, count in zip(
            prompt.request_ids, prompt.start_positions.tolist(), prompt.num_rows.tolist()
        ):
            state = self._requests.get(request_id)
            if state is not None:
                num_top = state.request.sampling_params.prompt_logprobs or 0
                entries = self._logprobs.prompt(prompt.logprobs, row, count, num_top)
                state.stream.set_prompt_logprobs(start, entries)
            row += count

    def _finish_early(self, request_id: str, reason: str, error: str | None, now: float) -> bool:
        """Finish a tracked request outside the token path (abort, error), releasing any
        text still held back."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        held = state.stop_checker.flush() if state.stop_checker is not None else ""
        try:
            held += state.detokenizer.flush()
        except Exception as exc:  # the request is over either way
            log.warning("detokenizer_flush_failed", request_id=request_id, exc_info=exc)
        no_logprobs = None if state.request.sampling_params.logprobs is None else ()
        state.stream.push((), held, no_logprobs, finish_reason=reason, error=error, now=now)
        self._record(state, reason, now)
        return True

    def _record(self, state: _RequestState, reason: str, now: float) -> None:
        """Build the finished request's RequestRecord, put it on its stream (the final
        delta carries it) and hand it to `on_request_finished`."""
        if self._on_request_finished is None:
            return
        request, stream = state.request, state.stream
        try:
            record = RequestRecord(
                request_id=request.request_id,
                arrival_time=request.arrival_time,
                finish_time=now,
                finish_reason=reason,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=state.num_output_tokens,
                num_cached_tokens=stream.num_cached_tokens,
                queued_time=state.queued_time,
                first_scheduled_time=state.first_scheduled_time,
                first_token_time=stream.first_token_time,
                inter_token_latencies_s=tuple(state.inter_token_latencies_s or ()),
                num_draft_tokens=state.num_draft_tokens,
                num_accepted_tokens=state.num_accepted_tokens,
            )
            stream.record = record
            self._on_request_finished(record)
        except Exception as exc:  # telemetry must never stop the front end
            log.error("request_record_failed", request_id=request.request_id, exc_info=exc)


class SamplerActor(Actor[ToSampler]):
    """Wraps an OutputProcessor behind a mailbox (its messages: ToSampler). Requests the
    processor ends on its own go to `on_stopped` (which aborts them in the engine core).
    Each step's `StepStats` goes to every one of `step_observers` (metrics, the stats log)
    once its outputs are pushed. On shutdown, requests still open finish with 'abort'."""

    name = "sampler"

    def __init__(
        self,
        processor: OutputProcessor,
        on_stopped: Callable[[list[str]], None],
        step_observers: Sequence[Callable[[StepStats], None]] = (),
        on_scheduler_stats: Callable[[SchedulerStats], None] | None = None,
    ) -> None:
        super().__init__()
        self.processor = processor
        self._on_stopped = on_stopped
        self._step_observers = tuple(step_observers)
        self._on_scheduler_stats = on_scheduler_stats

    async def handle(self, message: ToSampler) -> object:
        match message:
            case EngineCoreOutputs():
                self._process(message)
            case RegisterRequest():
                self.processor.add_request(message.request, message.stream)
            case AbortRequests():
                for request_id in message.request_ids:
                    self.processor.abort(request_id)
            case FailRequests():
                self.processor.fail_all(message.message)
            case _:
                assert_never(message)
        return None

    def _process(self, outputs: EngineCoreOutputs) -> None:
        stopped = self.processor.process_outputs(outputs)
        if stopped:
            self._on_stopped(stopped)
        if outputs.step_stats is not None:
            for observe in self._step_observers:
                observe(outputs.step_stats)
        if outputs.scheduler_stats is not None and self._on_scheduler_stats is not None:
            self._on_scheduler_stats(outputs.scheduler_stats)

    async def on_stop(self) -> None:
        aborted = self.processor.abort_all()
        if aborted:
            log.warning("sampler_stopped_with_open_requests", num_requests=len(aborted))
