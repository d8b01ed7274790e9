"""The sampler actor: turns each step's sampled tokens into per-request outcomes.

For every request in a `StepOutput` it appends the token, checks stop conditions in
vLLM's order (EOS unless ignore_eos, stop token ids, max_tokens / context length, then stop
strings on the detokenized text), builds logprob entries, pushes the new text to the
request's `RequestStream`, and sends the scheduler ONE `StepUpdate` per step.

min_tokens: EOS and stop token ids count only from the min_tokens-th output token on,
stop strings only once the output is longer than min_tokens (vLLM semantics).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from actors.base import Actor
from actors.detokenizer import IncrementalDetokenizer, NullDetokenizer, TokenDecoder
from actors.messages import (
    AbortRequests,
    EngineRequest,
    FinishRequests,
    LogprobsArrays,
    PrefixCacheHits,
    RegisterRequest,
    RequestsAdmitted,
    StepOutput,
    StepStats,
    StepUpdate,
)
from actors.output_stream import LogprobEntry, RequestStream, TopLogprob
from actors.stop_checker import StopStringChecker
from telemetry.records import RequestRecord

log = structlog.get_logger("tandem.sampler")

LOGPROB_FLOOR = -9999.0
"""OpenAI's minimum logprob; JSON has no -inf."""
_MAX_CACHED_TOKEN_TEXTS = 1 << 16


@dataclass(slots=True, eq=False)
class _RequestState:
    request: EngineRequest
    stream: RequestStream
    detokenizer: IncrementalDetokenizer | NullDetokenizer
    stop_checker: StopStringChecker | None
    eos_token_ids: frozenset[int]
    """Empty with ignore_eos."""
    stop_token_ids: frozenset[int]
    max_output_tokens: int | None
    """max_tokens, further capped by the context length when known."""
    num_output_tokens: int = 0
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies_s: list[float] | None = None
    """None unless the processor keeps records."""


class OutputProcessor:
    """The sampler actor's state and logic, as a plain class.

    `scheduler_sink` receives the `StepUpdate` of every processed step. Requests are
    tracked from `add_request` until they finish; a token that arrives for an untracked
    request (finished or aborted while a later step was already in flight) is ignored.
    With `tokenizer=None` outputs are token ids only (empty text), and a request with stop
    strings finishes at once with an error. With `on_request_finished`, every finished
    request's `RequestRecord` goes to it and rides on the request's final delta.
    """

    def __init__(self, tokenizer: TokenDecoder | None, scheduler_sink: Callable[[StepUpdate], None],
                 *, max_model_len: int | None = None,
                 on_request_finished: Callable[[RequestRecord], None] | None = None) -> None:
        self._tokenizer = tokenizer
        self._scheduler_sink = scheduler_sink
        self._max_model_len = max_model_len
        self._on_request_finished = on_request_finished
        self._requests: dict[str, _RequestState] = {}
        self._token_texts = _TokenTextCache(tokenizer) if tokenizer is not None else None

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(self, request: EngineRequest, stream: RequestStream) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already being processed")
        params = request.sampling_params
        max_output_tokens = params.max_tokens
        if self._max_model_len is not None:
            room = self._max_model_len - len(request.prompt_token_ids)
            max_output_tokens = room if max_output_tokens is None else min(max_output_tokens, room)
        stop_checker = (StopStringChecker(params.stop, params.include_stop_str_in_output)
                        if params.stop else None)
        detokenizer = (NullDetokenizer() if self._tokenizer is None else
                       IncrementalDetokenizer(self._tokenizer, request.prompt_token_ids,
                                              params.skip_special_tokens))
        self._requests[request.request_id] = _RequestState(
            request=request, stream=stream, detokenizer=detokenizer, stop_checker=stop_checker,
            eos_token_ids=frozenset() if params.ignore_eos else frozenset(request.eos_token_ids),
            stop_token_ids=frozenset(params.stop_token_ids),
            max_output_tokens=max_output_tokens,
            inter_token_latencies_s=None if self._on_request_finished is None else [])
        if self._tokenizer is None and params.stop:
            self.finish(request.request_id, "error", "stop strings need a tokenizer; this model "
                        "serves token ids only")

    def set_num_cached_tokens(self, request_id: str, num_cached_tokens: int) -> None:
        state = self._requests.get(request_id)
        if state is not None:
            state.stream.set_num_cached_tokens(num_cached_tokens)

    def set_admitted(self, message: RequestsAdmitted) -> None:
        """The scheduler's part of each request's timeline, at its first admission."""
        for admitted in message.requests:
            state = self._requests.get(admitted.request_id)
            if state is not None:
                state.stream.set_num_cached_tokens(admitted.num_cached_tokens)
                state.queued_time = admitted.queued_time
                state.first_scheduled_time = admitted.first_scheduled_time

    def abort(self, request_id: str) -> bool:
        """Finish a request with reason 'abort' (the scheduler already knows). Returns
        whether it was still being processed."""
        return self._finish_early(request_id, "abort", None, time.monotonic())

    def finish(self, request_id: str, reason: str, error: str | None = None) -> bool:
        """Finish a request the scheduler ended on its own; returns whether it was tracked."""
        return self._finish_early(request_id, reason, error, time.monotonic())

    def abort_all(self) -> list[str]:
        now = time.monotonic()
        return [rid for rid in list(self._requests) if self._finish_early(rid, "abort", None, now)]

    def fail_all(self, message: str) -> list[str]:
        """Finish every request with reason 'error' (the engine cannot go on)."""
        now = time.monotonic()
        return [rid for rid in list(self._requests) if self._finish_early(rid, "error", message, now)]

    def process_step(self, out: StepOutput) -> StepUpdate:
        """Apply one step's results; send the StepUpdate to the scheduler and return it."""
        now = time.monotonic()
        finished: dict[str, str] = {}
        if out.error is not None:
            self._fail(out.failed_request_ids, out.error, now, finished)
        request_ids, token_ids = out.request_ids, _sampled_token_list(out)
        if len(token_ids) != len(request_ids):
            self._fail(request_ids, f"step {out.step_id} returned {len(token_ids)} tokens for "
                       f"{len(request_ids)} requests", now, finished)
            request_ids = ()
        alive_ids: list[str] = []
        alive_tokens: list[int] = []
        for row, request_id in enumerate(request_ids):
            state = self._requests.get(request_id)
            if state is None:
                continue
            reason = self._process_token(state, row, token_ids[row], out.logprobs, now)
            if reason is None:
                alive_ids.append(request_id)
                alive_tokens.append(token_ids[row])
            else:
                finished[request_id] = reason
        update = StepUpdate(out.step_id, tuple(alive_ids), tuple(alive_tokens), finished)
        self._scheduler_sink(update)
        return update

    def _process_token(self, state: _RequestState, row: int, token_id: int,
                       logprobs: LogprobsArrays | None, now: float) -> str | None:
        request_id = state.request.request_id
        if state.stream.cancelled:
            self._finish_early(request_id, "abort", None, now)
            return "abort"
        try:
            entries = self._logprob_entries(state, row, token_id, logprobs)
            reason, stop_reason, text = self._append_token(state, token_id)
        except Exception as exc:  # one bad request must not stop the engine
            log.error("output_processing_failed", request_id=request_id, exc_info=exc)
            self._finish_early(request_id, "error", f"{type(exc).__name__}: {exc}", now)
            return "error"
        state.stream.push((token_id,), text, entries, finish_reason=reason,
                          stop_reason=stop_reason, now=now)
        gaps = state.inter_token_latencies_s
        if gaps is not None:
            if state.last_token_time is not None:
                gaps.append(now - state.last_token_time)
            state.last_token_time = now
        if reason is not None:
            del self._requests[request_id]
            self._record(state, reason, now)
        return reason

    def _append_token(self, state: _RequestState,
                      token_id: int) -> tuple[str | None, str | int | None, str]:
        """Returns (finish reason, stop reason, text to stream) for one new token."""
        state.num_output_tokens += 1
        num_output = state.num_output_tokens
        params = state.request.sampling_params
        reason: str | None = None
        stop_reason: str | int | None = None
        if num_output >= params.min_tokens:
            if token_id in state.eos_token_ids:
                reason = "stop"
            elif token_id in state.stop_token_ids:
                reason, stop_reason = "stop", token_id
        if reason is None and state.max_output_tokens is not None \
                and num_output >= state.max_output_tokens:
            reason = "length"
        stopped_by_token = reason == "stop"
        text = ("" if stopped_by_token and not params.include_stop_str_in_output
                else state.detokenizer.push((token_id,)))
        pieces = [text]
        checker = state.stop_checker
        check_stop_strings = num_output > params.min_tokens
        if checker is not None:
            pieces[0], stop_string = checker.append(text, check_stop_strings)
            if stop_string is not None:
                return "stop", stop_string, pieces[0]
        if reason is not None:
            tail = state.detokenizer.flush()
            if checker is not None:
                tail, stop_string = checker.append(tail, check_stop_strings)
                if stop_string is not None:
                    reason, stop_reason = "stop", stop_string
                tail += checker.flush()
            pieces.append(tail)
        return reason, stop_reason, "".join(pieces)

    def _logprob_entries(self, state: _RequestState, row: int, token_id: int,
                         logprobs: LogprobsArrays | None) -> tuple[LogprobEntry, ...] | None:
        num_top = state.request.sampling_params.logprobs
        if num_top is None:
            return None
        if logprobs is None:
            return ()
        ids = logprobs.token_ids[row, :num_top + 1].tolist()
        values = floor_logprobs(logprobs.logprobs[row, :num_top + 1]).tolist()
        token, token_bytes = self._token_text(token_id)
        top = tuple(TopLogprob(top_id, *self._token_text(top_id), value)
                    for top_id, value in zip(ids[1:], values[1:]))
        return (LogprobEntry(token_id, token, token_bytes, values[0],
                             int(logprobs.sampled_rank[row]), top),)

    def _token_text(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        if self._token_texts is None:  # no tokenizer: logprob entries carry ids only
            return "", ()
        return self._token_texts.get(token_id)

    def _fail(self, request_ids: tuple[str, ...], message: str, now: float,
              finished: dict[str, str]) -> None:
        for request_id in request_ids:
            if self._finish_early(request_id, "error", message, now):
                finished[request_id] = "error"

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
                request_id=request.request_id, arrival_time=request.arrival_time,
                finish_time=now, finish_reason=reason,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=state.num_output_tokens,
                num_cached_tokens=stream.num_cached_tokens, queued_time=state.queued_time,
                first_scheduled_time=state.first_scheduled_time,
                first_token_time=stream.first_token_time,
                inter_token_latencies_s=tuple(state.inter_token_latencies_s or ()))
            stream.record = record
            self._on_request_finished(record)
        except Exception as exc:  # telemetry must never stop the engine
            log.error("request_record_failed", request_id=request.request_id, exc_info=exc)


class SamplerActor(Actor):
    """Wraps an OutputProcessor behind a mailbox. Messages: `RegisterRequest`,
    `StepOutput`, `AbortRequests`, `RequestsAdmitted`, `PrefixCacheHits`, `FinishRequests`.
    On shutdown, requests still open finish with 'abort'. Each step's `StepStats` goes to
    every one of `step_observers` (metrics, the stats log) once its outputs are pushed."""

    name = "sampler"

    def __init__(self, processor: OutputProcessor,
                 step_observers: Sequence[Callable[[StepStats], None]] = ()) -> None:
        super().__init__()
        self.processor = processor
        self._step_observers = tuple(step_observers)

    async def handle(self, message: Any) -> Any:
        if isinstance(message, StepOutput):
            update = self.processor.process_step(message)
            for observe in self._step_observers:
                observe(message.stats)
            return update
        if isinstance(message, RequestsAdmitted):
            self.processor.set_admitted(message)
        elif isinstance(message, RegisterRequest):
            self.processor.add_request(message.request, message.stream)
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.processor.abort(request_id)
        elif isinstance(message, PrefixCacheHits):
            for request_id, num_cached in message.num_cached_tokens:
                self.processor.set_num_cached_tokens(request_id, num_cached)
        elif isinstance(message, FinishRequests):
            for request_id, reason in message.reasons:
                self.processor.finish(request_id, reason, message.error)
        else:
            raise TypeError(f"sampler got an unexpected message {type(message).__name__}")
        return None

    async def on_stop(self) -> None:
        aborted = self.processor.abort_all()
        if aborted:
            log.warning("sampler_stopped_with_open_requests", num_requests=len(aborted))


def floor_logprobs(logprobs: np.ndarray) -> np.ndarray:
    """NaN and -inf become LOGPROB_FLOOR, +inf becomes 0, everything >= LOGPROB_FLOOR."""
    finite = np.nan_to_num(logprobs.astype(np.float64), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR,
                           posinf=0.0)
    return np.maximum(finite, LOGPROB_FLOOR)


def _sampled_token_list(out: StepOutput) -> list[int]:
    token_ids: list[int] = np.asarray(out.sampled_token_ids).reshape(-1).tolist()
    return token_ids


class _TokenTextCache:
    """Token id -> (token string, UTF-8 bytes) for logprobs. A token holding part of a
    multi-byte character renders its stray bytes as \\xNN escapes; `bytes` stays exact."""

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self._tokenizer = tokenizer
        self._token_bytes: Callable[[int], bytes] | None = getattr(tokenizer, "token_bytes", None)
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def get(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        cached = self._cache.get(token_id)
        if cached is None:
            if len(self._cache) >= _MAX_CACHED_TOKEN_TEXTS:
                self._cache.clear()
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        if self._token_bytes is not None:
            raw = bytes(self._token_bytes(token_id))
            return raw.decode("utf-8", errors="backslashreplace"), tuple(raw)
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text, tuple(text.encode("utf-8"))
