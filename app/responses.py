"""Non-streaming response bodies (chat.completion, text_completion), usage and logprobs in
the OpenAI shapes, shared with the SSE writer."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.frontend.output_stream import LogprobEntry, StreamDelta
from app.tool_calls.output import ToolCallOutput

if TYPE_CHECKING:
    from app.harmony.output import HarmonyOutput
    from app.reasoning.output import ReasoningOutput
from telemetry.records import RequestRecord

LOGPROB_FLOOR = -9999.0


def floor_logprob(value: float) -> float:
    """OpenAI's minimum; NaN and -inf (which JSON cannot carry) become the floor too."""
    if math.isnan(value) or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(value, 0.0)


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every chunk or response of one API request repeats."""

    response_id: str
    created: int
    """Unix seconds."""
    model: str


@dataclass(slots=True)
class ChoiceState:
    """One choice's output so far (for a non-stream response, all of it)."""

    index: int
    prompt_index: int = 0
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    retryable: bool = False
    """Its error came from the server's state, not the request (StreamDelta.retryable)."""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    text_offset: int = 0
    """The text_offset of the next token in a completions stream's logprobs."""
    record: RequestRecord | None = None
    """The engine's record of this choice, from its final delta (for the span)."""
    prompt_logprobs: tuple[LogprobEntry | None, ...] | None = None

    def add(self, delta: StreamDelta) -> None:
        self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.num_output_tokens = delta.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.error, self.retryable = delta.error, delta.retryable
            self.record = delta.record

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def usage(
    num_prompt_tokens_per_prompt: Sequence[int], choices: Sequence[ChoiceState]
) -> dict[str, Any]:
    """Each prompt counts once however many samples it has; outputs sum over choices. Cached
    tokens: the best prefix-cache hit among each prompt's samples."""
    num_prompt_tokens = sum(num_prompt_tokens_per_prompt)
    num_completion_tokens = sum(c.num_output_tokens for c in choices)
    cached_per_prompt: dict[int, int] = {}
    for choice in choices:
        cached_per_prompt[choice.prompt_index] = max(
            cached_per_prompt.get(choice.prompt_index, 0), choice.num_cached_tokens
        )
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(cached_per_prompt.values())},
    }


def chat_logprobs(entries: Sequence[LogprobEntry] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {
        "content": [
            {
                "token": e.token,
                "logprob": floor_logprob(e.logprob),
                "bytes": list(e.bytes),
                "top_logprobs": [
                    {"token": t.token, "logprob": floor_logprob(t.logprob), "bytes": list(t.bytes)}
                    for t in e.top_logprobs
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    entries: Sequence[LogprobEntry] | None, text_offset: int
) -> dict[str, Any] | None:
    """Legacy completions format; `text_offset` is where the first token's text starts.
    Each top_logprobs map includes the sampled token, as vLLM's does."""
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [floor_logprob(e.logprob) for e in entries],
        "top_logprobs": [
            {
                **{t.token: floor_logprob(t.logprob) for t in e.top_logprobs},
                e.token: floor_logprob(e.logprob),
            }
            for e in entries
        ],
        "text_offset": offsets,
    }


def next_text_offset(logprobs: dict[str, Any] | None, default: int) -> int:
    """Where the token after a legacy logprobs body starts (`default` when it has none), so
    that streamed offsets continue as one response's do."""
    if not logprobs or not logprobs["tokens"]:
        return default
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def with_reasoning_alias(fields: dict[str, Any]) -> dict[str, Any]:
    """A chat message or delta whose `reasoning_content` is also sent as `reasoning`: vLLM
    names the field `reasoning` since 0.17 (OpenAI's guidance for gpt-oss), while DeepSeek's
    `reasoning_content` is what most clients still read, so both carry the same text."""
    if "reasoning_content" not in fields:
        return fields
    return {**fields, "reasoning": fields["reasoning_content"]}


def chat_response(
    meta: ResponseMeta,
    choices: Sequence[ChoiceState],
    num_prompt_tokens: int,
    *,
    role: str = "assistant",
    echo_prefix: str = "",
    prompt_token_ids: Sequence[int] | None = None,
    tool_calls: Callable[[], ToolCallOutput] | None = None,
    harmony: Callable[[], HarmonyOutput] | None = None,
    reasoning: Callable[[], ReasoningOutput] | None = None,
) -> dict[str, Any]:
    """`tool_calls`: makes each choice's tool-call reader when the request has tools;
    `harmony`: each choice's reader of a harmony (gpt-oss) completion, which fills
    `reasoning_content` and `tool_calls` too; `reasoning`: the same for a `<think>`
    model's completion (it reads the tool calls itself)."""
    body_choices = []
    for choice in choices:
        message: dict[str, Any] = {"content": echo_prefix + choice.text}
        finish_reason = choice.finish_reason
        if harmony is not None:
            message, finish_reason = harmony().message(choice.token_ids, choice.finish_reason)
        elif reasoning is not None:
            message, finish_reason = reasoning().message(choice.text, choice.finish_reason)
        elif tool_calls is not None:
            message, finish_reason = tool_calls().message(choice.text, choice.finish_reason)
        body_choice: dict[str, Any] = {
            "index": choice.index,
            "message": {"role": role, **with_reasoning_alias(message)},
            "logprobs": chat_logprobs(choice.logprobs),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if prompt_token_ids is not None:
            body_choice["token_ids"] = choice.token_ids
        body_choices.append(body_choice)
    body: dict[str, Any] = {
        "id": meta.response_id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": body_choices,
        "system_fingerprint": None,
        "usage": usage([num_prompt_tokens], choices),
    }
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body


def completion_response(
    meta: ResponseMeta,
    choices: Sequence[ChoiceState],
    prompt_lens: Sequence[int],
    *,
    echo_texts: Sequence[str] | None = None,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """`echo_texts[i]` is prompt i's text when the request asked for echo."""
    body_choices = []
    for choice in choices:
        prefix = echo_texts[choice.prompt_index] if echo_texts is not None else ""
        body_choice: dict[str, Any] = {
            "index": choice.index,
            "text": prefix + choice.text,
            "logprobs": completion_logprobs(choice.logprobs, len(prefix)),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if prompt_token_ids is not None:
            body_choice["prompt_token_ids"] = list(prompt_token_ids[choice.prompt_index])
            body_choice["token_ids"] = choice.token_ids
        body_choices.append(body_choice)
    return {
        "id": meta.response_id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": body_choices,
        "system_fingerprint": None,
        "usage": usage(prompt_lens, choices),
    }
