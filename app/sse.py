"""Server-sent events for streamed chat and text completions (vLLM's wire format).

    data: {chunk}\\n\\n ... data: [DONE]\\n\\n

Per choice: a role chunk once the first output exists (chat only), content chunks, then
exactly one chunk with finish_reason. A completions choice's first chunk also carries the
echoed prompt (with its logprobs) and vLLM's `prompt_logprobs`; a chat stream's first chunk
carries `prompt_logprobs` once. With `include_usage` a last chunk has `choices: []`
and the usage; `continuous_usage_stats` puts cumulative usage on every chunk. An error
after the headers is an error event followed by [DONE]. While nothing arrives for
`keep_alive_s` seconds (queued, long prefill) an SSE comment keeps proxies from cutting the
connection.

The writer is pull-based: each read takes everything a choice accumulated since the last
one and sends it in one write, so a slow client gets bigger chunks and never holds the
engine back.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import orjson
import structlog
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from actors.frontend.admitted_group import AdmittedGroup
from actors.frontend.output_stream import StreamDelta
from app import prompt_logprobs
from app.errors import request_failed_error
from app.keep_alive import KeepAliveClock
from app.request_telemetry import RequestTelemetry
from app.responses import (
    ChoiceState,
    ResponseMeta,
    chat_logprobs,
    completion_logprobs,
    next_text_offset,
    usage,
)
from app.tool_calls.output import ToolCallOutput

if TYPE_CHECKING:
    from app.harmony.output import HarmonyOutput
from telemetry.logging import bind_request

log = structlog.get_logger("tandem.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"
KEEP_ALIVE_COMMENT = b": keep-alive\n\n"

Batch = list[tuple[int, StreamDelta]]


_UNICODE_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)
"""U+0085, U+2028, U+2029 in UTF-8, and their JSON escapes."""


def sse_event(payload: Any) -> bytes:
    """One `data:` event. JSON leaves U+0085, U+2028 and U+2029 unescaped, and clients that
    split lines the way Python's str.splitlines does (httpx's iter_lines among them) would
    end the line there and read half an event: those three go out escaped."""
    body = orjson.dumps(payload)
    if b"\xe2\x80" in body or b"\xc2\x85" in body:
        for raw, escaped in _UNICODE_LINE_BREAKS:
            body = body.replace(raw, escaped)
    return b"data: " + body + b"\n\n"


@dataclass(frozen=True, slots=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage: bool = False
    keep_alive: KeepAliveClock = field(default_factory=lambda: KeepAliveClock(10.0))
    """The server's clock for keep-alive comments (one timer for every stream)."""


class ChunkFormatter:
    """Turns one choice's delta into the chunks that represent it."""

    object_name = "chat.completion.chunk"

    def __init__(
        self,
        meta: ResponseMeta,
        prompt_lens: Sequence[int],
        choices: Sequence[ChoiceState],
        continuous_usage: bool,
    ) -> None:
        self.meta = meta
        self.prompt_lens = prompt_lens
        self.choices = choices
        self.continuous_usage = continuous_usage

    def chunks(self, choice: ChoiceState, delta: StreamDelta, first: bool) -> list[dict[str, Any]]:
        raise NotImplementedError

    def chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.meta.response_id,
            "object": self.object_name,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [] if choice is None else [choice],
        }
        if self.continuous_usage or choice is None:
            body["usage"] = usage(self.prompt_lens, self.choices)
        return body


class ChatChunkFormatter(ChunkFormatter):
    def __init__(
        self,
        meta: ResponseMeta,
        prompt_lens: Sequence[int],
        choices: Sequence[ChoiceState],
        continuous_usage: bool,
        *,
        role: str = "assistant",
        echo_prefix: str = "",
        tool_calls: Callable[[], ToolCallOutput] | None = None,
        harmony: Callable[[], HarmonyOutput] | None = None,
    ) -> None:
        """`tool_calls`: makes each choice's tool-call reader when the request has tools;
        `harmony`: each choice's reader of a harmony (gpt-oss) completion, whose chunks
        carry `reasoning_content`, `content` and `tool_calls` deltas."""
        super().__init__(meta, prompt_lens, choices, continuous_usage)
        self.role = role
        self.echo_prefix = echo_prefix
        self._new_tool_output = tool_calls
        self._tool_outputs: dict[int, ToolCallOutput] = {}
        self._new_harmony_output = harmony
        self._harmony_outputs: dict[int, HarmonyOutput] = {}
        self._sent_prompt_logprobs = False

    def chunks(self, choice: ChoiceState, delta: StreamDelta, first: bool) -> list[dict[str, Any]]:
        out = []
        if first:
            out.append(self._choice(choice.index, {"role": self.role, "content": ""}))
            if delta.prompt_logprobs is not None and not self._sent_prompt_logprobs:
                # Once per response, beside the choices, as a chat response has them.
                self._sent_prompt_logprobs = True
                out[0]["prompt_logprobs"] = prompt_logprobs.vllm_prompt_logprobs(
                    delta.prompt_logprobs
                )
            if self.echo_prefix:
                out.append(self._choice(choice.index, {"content": self.echo_prefix}))
        logprobs = chat_logprobs(delta.logprobs) if delta.logprobs else None
        if self._new_harmony_output is not None:
            return out + self._harmony_chunks(choice.index, delta, logprobs)
        if self._new_tool_output is not None:
            return out + self._tool_chunks(choice.index, delta, logprobs)
        if delta.finished:
            content = {"content": delta.text} if delta.text else {}
            out.append(
                self._choice(
                    choice.index, content, logprobs, delta.finish_reason, delta.stop_reason
                )
            )
        elif delta.text or logprobs:
            out.append(self._choice(choice.index, {"content": delta.text}, logprobs))
        return out

    def _tool_chunks(self, index: int, delta: StreamDelta, logprobs: Any) -> list[dict[str, Any]]:
        """Content, then one chunk per tool-call entry (header, argument fragments), then
        the finish chunk: each call's pieces arrive in order, as from OpenAI."""
        assert self._new_tool_output is not None
        output = self._tool_outputs.setdefault(index, self._new_tool_output())
        content, entries, finish_reason = output.feed(delta.text, delta.finish_reason)
        out = []
        if content or logprobs:
            out.append(self._choice(index, {"content": content}, logprobs))
        out += [self._choice(index, {"tool_calls": [entry]}) for entry in entries]
        if delta.finished:
            out.append(self._choice(index, {}, None, finish_reason, delta.stop_reason))
        return out

    def _harmony_chunks(
        self, index: int, delta: StreamDelta, logprobs: Any
    ) -> list[dict[str, Any]]:
        """One chunk per reasoning, content or tool-call piece, in the order the model wrote
        them (the delta's logprobs ride on the first), then the finish chunk."""
        assert self._new_harmony_output is not None
        output = self._harmony_outputs.setdefault(index, self._new_harmony_output())
        pieces, finish_reason = output.feed(delta.token_ids, delta.finish_reason)
        if logprobs and not pieces:
            pieces = [{"content": ""}]
        out = [
            self._choice(index, piece, logprobs if i == 0 else None)
            for i, piece in enumerate(pieces)
        ]
        if delta.finished:
            out.append(self._choice(index, {}, None, finish_reason, delta.stop_reason))
        return out

    def _choice(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: Any = None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
    ) -> dict[str, Any]:
        return self.chunk(
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        )


class CompletionChunkFormatter(ChunkFormatter):
    object_name = "text_completion"

    def __init__(
        self,
        meta: ResponseMeta,
        prompt_lens: Sequence[int],
        choices: Sequence[ChoiceState],
        continuous_usage: bool,
        *,
        echo_texts: Sequence[str] | None = None,
        echo_first_tokens: Sequence[str] | None = None,
    ) -> None:
        """`echo_texts[i]`: prompt i's text, sent before its choices' first output (echo);
        `echo_first_tokens[i]`: prompt i's first token when echo comes with logprobs."""
        super().__init__(meta, prompt_lens, choices, continuous_usage)
        self.echo_texts = echo_texts
        self.echo_first_tokens = echo_first_tokens

    def chunks(self, choice: ChoiceState, delta: StreamDelta, first: bool) -> list[dict[str, Any]]:
        prefix = self.echo_texts[choice.prompt_index] if first and self.echo_texts else ""
        text = prefix + delta.text
        logprobs = self._logprobs(choice, delta, len(prefix))
        choice.text_offset = next_text_offset(logprobs, choice.text_offset + len(text))
        # A step's tokens get a chunk even when they decode to no text yet (a character
        # split over tokens, a model served without a tokenizer), so clients see the pace.
        if not (text or delta.token_ids or delta.logprobs or delta.finished):
            return []
        body = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if delta.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs.vllm_prompt_logprobs(delta.prompt_logprobs)
        return [self.chunk(body)]

    def _logprobs(
        self, choice: ChoiceState, delta: StreamDelta, prefix_len: int
    ) -> dict[str, Any] | None:
        """The prompt's tokens (echo with logprobs, on the first chunk) then the delta's."""
        if delta.prompt_logprobs is not None and self.echo_first_tokens is not None:
            return prompt_logprobs.echo_completion_logprobs(
                delta.prompt_logprobs, self.echo_first_tokens[choice.prompt_index], delta.logprobs
            )
        return completion_logprobs(delta.logprobs, choice.text_offset + prefix_len)


class EventStreamResponse(Response):
    """Streams one admitted request as SSE. The client going away (http.disconnect) cancels
    the writer, and `group.close()` aborts whatever still runs in the engine. `telemetry`,
    when given, is ended once the stream is (finished, failed or disconnected)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        group: AdmittedGroup,
        formatter: ChunkFormatter,
        options: StreamOptions,
        request_id: str,
        headers: dict[str, str] | None = None,
        telemetry: RequestTelemetry | None = None,
    ) -> None:
        # Like StreamingResponse: no body attribute, so no Content-Length header.
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})
        self.group = group
        self.formatter = formatter
        self.options = options
        self.request_id = request_id
        self.telemetry = telemetry
        self._started = [False] * len(group.streams)
        self._failure: str | None = None
        """Why a choice failed, in the engine's words (the stream's error event says it)."""
        self._failure_retryable = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        telemetry = self.telemetry
        completed = False
        with bind_request(self.request_id, None if telemetry is None else telemetry.trace_id):
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status_code,
                        "headers": self.raw_headers,
                    }
                )
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
                    await self._write_events(send)
                    completed = True
                    tg.cancel_scope.cancel()
                # Outside the watcher: once the body is complete the server reports a
                # disconnect, which is no reason to log one.
                if completed:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                log.info("client_disconnected", request_id=self.request_id)
            finally:
                self.group.close()
                if telemetry is not None:
                    telemetry.end(
                        self.formatter.choices,
                        self.formatter.prompt_lens,
                        disconnected=not completed,
                    )

    async def _write_events(self, send: Send) -> None:
        async def send_bytes(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            failed = await pull_batches(
                self.group,
                self.options.keep_alive,
                lambda batch: self._on_batch(batch, send_bytes),
                lambda: send_bytes(KEEP_ALIVE_COMMENT),
            )
        except Exception as exc:
            log.exception("stream_failed", request_id=self.request_id)
            if self.telemetry is not None:
                self.telemetry.failed(exc)
            failed = True
        if failed:
            # The headers are gone: the event's body alone says whether a retry may succeed.
            error = request_failed_error(self.request_id, self._failure, self._failure_retryable)
            await send_bytes(sse_event(error.body()) + DONE_EVENT)
            return
        tail = sse_event(self.formatter.chunk(None)) if self.options.include_usage else b""
        await send_bytes(tail + DONE_EVENT)

    async def _on_batch(self, batch: Batch, send_bytes: Callable[[bytes], Awaitable[None]]) -> bool:
        """Send a batch; True when a choice failed (the stream then ends with an error)."""
        out = bytearray()
        for index, delta in batch:
            choice = self.formatter.choices[index]
            _count(choice, delta)
            if delta.finish_reason == "error":
                log.error("request_failed", request_id=self.request_id, error=delta.error)
                self._failure, self._failure_retryable = delta.error, delta.retryable
                if out:
                    await send_bytes(bytes(out))
                return True
            first = not self._started[index]
            self._started[index] = True
            for chunk in self.formatter.chunks(choice, delta, first):
                out += sse_event(chunk)
        if out:
            await send_bytes(bytes(out))
        return False


def _count(choice: ChoiceState, delta: StreamDelta) -> None:
    choice.num_output_tokens = delta.num_output_tokens
    choice.num_cached_tokens = max(choice.num_cached_tokens, delta.num_cached_tokens)
    if delta.finished:
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        choice.record = delta.record


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            log.info("client_disconnected")
            scope.cancel()
            return


async def pull_batches(
    group: AdmittedGroup,
    keep_alive: KeepAliveClock,
    on_batch: Callable[[Batch], Awaitable[bool]],
    on_quiet: Callable[[], Awaitable[None]],
) -> bool:
    """Feed `on_batch` with everything the group's streams accumulated, until every stream
    ended or `on_batch` returns True (then True is returned). `on_quiet` runs whenever
    nothing arrived for the clock's interval."""
    if len(group.streams) == 1:
        return await _pull_single(group, keep_alive, on_batch, on_quiet)
    keep_alive_s = keep_alive.interval_s
    send_stream, receive_stream = anyio.create_memory_object_stream[tuple[int, StreamDelta]](0)

    async def read_choice(index: int, sender: Any) -> None:
        async with sender:
            while (delta := await group.get(index)) is not None:
                await sender.send((index, delta))

    async with anyio.create_task_group() as tg:
        async with send_stream:
            for index in range(len(group.streams)):
                tg.start_soon(read_choice, index, send_stream.clone())
        failed = await _drain_merged(receive_stream, keep_alive_s, on_batch, on_quiet)
        tg.cancel_scope.cancel()
    return failed


async def _pull_single(
    group: AdmittedGroup,
    keep_alive: KeepAliveClock,
    on_batch: Callable[[Batch], Awaitable[bool]],
    on_quiet: Callable[[], Awaitable[None]],
) -> bool:
    stream = group.streams[0]
    with keep_alive.watching(stream):
        while (delta := await group.get(0)) is not None:
            if delta.is_empty:  # poked by the clock: quiet for its interval
                await on_quiet()
                continue
            keep_alive.sent(stream)
            if await on_batch([(0, delta)]):
                return True
    return False


async def _drain_merged(
    receive_stream: Any,
    keep_alive_s: float,
    on_batch: Callable[[Batch], Awaitable[bool]],
    on_quiet: Callable[[], Awaitable[None]],
) -> bool:
    async with receive_stream:
        while True:
            first = None
            with anyio.move_on_after(_interval(keep_alive_s)) as waited:
                try:
                    first = await receive_stream.receive()
                except anyio.EndOfStream:
                    return False
            if waited.cancelled_caught:
                await on_quiet()
                continue
            batch = [first]
            while True:
                try:
                    batch.append(receive_stream.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            if await on_batch(batch):
                return True


def _interval(keep_alive_s: float) -> float:
    return keep_alive_s if keep_alive_s > 0 else math.inf
