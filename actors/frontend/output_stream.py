"""What one client reads: a pull-based, coalescing output buffer per request.

The sampler actor pushes each step's outcome without ever waiting; the reader awaits
`get()`, which returns everything accumulated since its previous read as one `StreamDelta`.
A slow reader therefore receives bigger chunks instead of slowing the engine, and the
buffer never holds more than the request's own output (at most max_tokens tokens).

    stream = engine.add_request(request)
    async for delta in stream:          # ends after the delta with finish_reason set
        send(delta.text)

`get()` returns None once the final delta has been read (or after `aclose()`), rather than
raising StopAsyncIteration, so it is safe to call from inside an async generator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from telemetry.records import RequestRecord


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token: str
    bytes: tuple[int, ...]
    """The token's UTF-8 bytes (a byte-level token may hold part of a character)."""
    logprob: float


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One output token's logprobs, in the OpenAI shape (token, logprob, bytes, top_logprobs)."""

    token_id: int
    token: str
    bytes: tuple[int, ...]
    logprob: float
    """Floored at -9999.0; never NaN or infinite."""
    rank: int
    """1-based rank of the sampled token among all tokens."""
    top_logprobs: tuple[TopLogprob, ...]


@dataclass(frozen=True, slots=True)
class StreamDelta:
    request_id: str
    token_ids: tuple[int, ...]
    """Output tokens since the previous read (including a final EOS or stop token)."""
    text: str
    """Text since the previous read."""
    logprobs: tuple[LogprobEntry, ...] | None
    """One entry per token in `token_ids`; None when the request asked for no logprobs."""
    finish_reason: str | None
    """'stop', 'length', 'abort' or 'error' on the final delta, otherwise None."""
    stop_reason: str | int | None
    """The stop string or stop token id that finished the request (None for EOS, length)."""
    error: str | None
    """Why the request failed, when finish_reason is 'error'."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache (0 until known)."""
    num_output_tokens: int
    """Output tokens so far, including this delta."""
    first_token_time: float | None
    """time.monotonic() when the first output token arrived."""
    finish_time: float | None
    """time.monotonic() when the request finished."""
    record: RequestRecord | None = None
    """On the final delta, the request's timeline for metrics and traces (when the
    engine keeps records)."""
    prompt_logprobs: tuple[LogprobEntry | None, ...] | None = None
    """Once, on the first delta read after the prompt's prefill ended (the one with the
    first output token, or the final one), for a request that asked for them: one entry
    per prompt token, None for the first (nothing precedes it)."""
    retryable: bool = False
    """With an error: it came from the server's state (its engine core stopped answering),
    not from the request, so the same request may succeed later (HTTP 503, not 500)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_empty(self) -> bool:
        """Nothing new (a poked reader's delta)."""
        return not (self.token_ids or self.text or self.logprobs or self.finished)


class RequestStream:
    """One request's output buffer. The engine side calls `push` (never blocks); exactly one
    reader calls `get` or iterates with `async for`. Event-loop only (not thread-safe)."""

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.record: RequestRecord | None = None
        """Set by the engine when the request finishes; the final delta carries it."""
        self._token_ids: list[int] = []
        self._text_parts: list[str] = []
        self._logprobs: list[LogprobEntry] | None = None
        self._num_output_tokens = 0
        self._finish_reason: str | None = None
        self._stop_reason: str | int | None = None
        self._error: str | None = None
        self._retryable = False
        self._final_read = False
        self._cancelled = False
        self._poked = False
        self._wakeup: anyio.Event | None = None
        self._done: anyio.Event | None = None
        self._on_first_token: Callable[[str], None] | None = None
        self._on_finished: Callable[[str], None] | None = None
        self._prompt_logprobs: list[LogprobEntry | None] | None = None
        self._prompt_logprobs_read = False

    def observe(
        self, on_first_token: Callable[[str], None], on_finished: Callable[[str], None]
    ) -> None:
        """Call `on_first_token(request_id)` when the first output token arrives and
        `on_finished(request_id)` when the final outcome does (now, for what already
        happened), whether or not the reader has taken them: the engine's work for the
        request is what they report, not the client's progress."""
        self._on_first_token, self._on_finished = on_first_token, on_finished
        if self.first_token_time is not None:
            on_first_token(self.request_id)
        if self.finished:
            on_finished(self.request_id)

    # ---- engine side ------------------------------------------------------------------

    def push(
        self,
        token_ids: Sequence[int] = (),
        text: str = "",
        logprobs: Sequence[LogprobEntry] | None = None,
        *,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        error: str | None = None,
        retryable: bool = False,
        now: float | None = None,
    ) -> None:
        """Append one step's outcome; with `finish_reason` it is the request's last push.
        `now` (time.monotonic()) lets a caller stamp a whole step with one clock read."""
        if self._cancelled or self._finish_reason is not None:
            return
        if token_ids or finish_reason is not None:
            now = time.monotonic() if now is None else now
        if token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
                if self._on_first_token is not None:
                    self._on_first_token(self.request_id)
            self._token_ids.extend(token_ids)
            self._num_output_tokens += len(token_ids)
        if text:
            self._text_parts.append(text)
        if logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(logprobs)
        if finish_reason is not None:
            self._finish_reason, self._stop_reason, self._error = finish_reason, stop_reason, error
            self._retryable = retryable
            self.finish_time = now
            self._signal_done()
            if self._on_finished is not None:
                self._on_finished(self.request_id)
        self._wake()

    def set_prompt_logprobs(self, start_position: int, entries: Sequence[LogprobEntry]) -> None:
        """The logprobs of prompt positions start_position, start_position + 1, ... (a
        request recomputed after preemption sends some again: the same values)."""
        if self._prompt_logprobs is None:
            self._prompt_logprobs = [None] * self.num_prompt_tokens
        self._prompt_logprobs[start_position : start_position + len(entries)] = entries

    def set_num_cached_tokens(self, num_cached_tokens: int) -> None:
        self.num_cached_tokens = num_cached_tokens

    @property
    def finished(self) -> bool:
        """The engine has pushed the final outcome (the reader may not have read it yet)."""
        return self._finish_reason is not None

    @property
    def cancelled(self) -> bool:
        """The reader went away (`aclose()`); the engine should abort the request."""
        return self._cancelled

    # ---- reader side ------------------------------------------------------------------

    async def get(self) -> StreamDelta | None:
        """Wait until something is pending; return all of it as one delta. Returns None
        after the final delta has been returned, or once the stream is closed."""
        while not self._has_pending():
            if self._final_read or self._cancelled:
                return None
            if self._poked:  # nothing new: an empty delta
                self._poked = False
                return self._take()
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
        self._poked = False
        return self._take()

    def poke(self) -> None:
        """Make a waiting reader return an empty delta (no tokens, no text, not final):
        the server's keep-alive clock pokes quiet streams so that they send a comment."""
        self._poked = True
        self._wake()

    async def wait_finished(self) -> StreamDelta | None:
        """Wait for the final outcome without waking on every step, then return the whole
        output as one delta. For callers that want complete outputs (offline generation):
        one reader per request woken every step costs CPU the engine's threads then lack."""
        if not self.finished and not self._cancelled:
            if self._done is None:
                self._done = anyio.Event()
            await self._done.wait()
        return await self.get()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        delta = await self.get()
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def aclose(self) -> None:
        """The reader is done (e.g. the client disconnected): drop what is buffered, take no
        more, and let the engine see `cancelled`."""
        self._cancelled = True
        self._token_ids.clear()
        self._text_parts.clear()
        self._logprobs = None
        self._signal_done()
        self._wake()

    # ---- internals --------------------------------------------------------------------

    def _has_pending(self) -> bool:
        if self._cancelled or self._final_read:
            return False
        return bool(
            self._token_ids or self._text_parts or self._logprobs or self._finish_reason is not None
        )

    def _take(self) -> StreamDelta:
        logprobs = None if self._logprobs is None else tuple(self._logprobs)
        delta = StreamDelta(
            request_id=self.request_id,
            token_ids=tuple(self._token_ids),
            text="".join(self._text_parts),
            logprobs=logprobs,
            finish_reason=self._finish_reason,
            stop_reason=self._stop_reason,
            error=self._error,
            retryable=self._retryable,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self._num_output_tokens,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            record=self.record if self._finish_reason is not None else None,
            prompt_logprobs=self._take_prompt_logprobs(),
        )
        self._token_ids.clear()
        self._text_parts.clear()
        if self._logprobs is not None:
            self._logprobs = []
        self._final_read = self._finish_reason is not None
        return delta

    def _take_prompt_logprobs(self) -> tuple[LogprobEntry | None, ...] | None:
        """The whole prompt's logprobs, once: an output token (or the end) means its
        prefill is over, and each step sets a request's prompt logprobs before its tokens."""
        if (
            self._prompt_logprobs is None
            or self._prompt_logprobs_read
            or (self.first_token_time is None and self._finish_reason is None)
        ):
            return None
        self._prompt_logprobs_read = True
        return tuple(self._prompt_logprobs)

    def _signal_done(self) -> None:
        if self._done is not None:
            self._done.set()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None
