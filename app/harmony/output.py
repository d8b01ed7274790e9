"""One choice's harmony completion, read token by token into OpenAI's chat fields.

    analysis channel                     -> reasoning_content
    final channel (or no channel)        -> content
    commentary to=functions.NAME         -> a tool call (header, then argument pieces)
    commentary without a recipient       -> content (a preamble before tool calls)
    a recipient outside `functions.`     -> reasoning_content (no built-in tools are offered)

The stream and the non-streamed message both come from `feed`, so joined deltas equal the
message. Tokens that break the format end the parse; the rest of the output is then
returned as content text, so nothing the model wrote is lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from openai_harmony import HarmonyError, Role, StreamableParser

from app.harmony.model import HarmonyFormat
from app.tool_calls.calls import new_call_id

FUNCTION_PREFIX = "functions."
MESSAGE_END_TOKENS = ("<|end|>", "<|call|>", "<|return|>")
REPLACEMENT_CHAR = "\ufffd"


class HarmonyOutput:
    """Reads one choice's output tokens. `feed` returns the OpenAI delta objects (in
    order; consecutive pieces of one kind merged) and the finish reason to report:
    "tool_calls" when the model stopped at a call, except under a named tool_choice,
    which keeps "stop" as OpenAI does."""

    def __init__(
        self, harmony: HarmonyFormat, include_reasoning: bool = True, *, named_choice: bool = False
    ) -> None:
        self._encoding = harmony.encoding
        self._parser = StreamableParser(harmony.encoding, Role.ASSISTANT, strict=False)
        self._end_ids = frozenset(
            self._encoding.encode(t, allowed_special="all")[0] for t in MESSAGE_END_TOKENS
        )
        self._include_reasoning = include_reasoning
        self._named_choice = named_choice
        self._kind: str | None = None
        """The open message's kind: 'reasoning', 'content' or 'call'; None between them."""
        self._calls: list[dict[str, Any]] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._broken_ids: list[int] | None = None
        """Tokens after the format broke (their text is content)."""
        self._broken_sent = 0

    def feed(
        self, token_ids: Iterable[int], finish_reason: str | None
    ) -> tuple[list[dict[str, Any]], str | None]:
        deltas: list[dict[str, Any]] = []
        for token_id in token_ids:
            for kind, value in self._read(token_id):
                _append(deltas, kind, value)
        if finish_reason is not None and self._broken_ids is not None:
            _append(deltas, "content", self._broken_text(final=True))
        if finish_reason == "stop" and self._calls and not self._named_choice:
            finish_reason = "tool_calls"
        return [d for d in deltas if _has_value(d)], finish_reason

    def message(
        self, token_ids: Iterable[int], finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The non-streamed message fields and finish reason, for all of a choice's tokens."""
        _, reason = self.feed(token_ids, finish_reason or "stop")
        content = "".join(self._content)
        message: dict[str, Any] = {
            "content": (content or None) if self._calls else content,
            "reasoning_content": "".join(self._reasoning) or None,
        }
        if self._calls:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": "".join(call["arguments"])},
                }
                for call in self._calls
            ]
        return message, reason if finish_reason is not None else None

    def _read(self, token_id: int) -> list[tuple[str, Any]]:
        if self._broken_ids is not None:
            self._broken_ids.append(token_id)
            return [("content", self._broken_text(final=False))]
        try:
            self._parser.process(token_id)
        except HarmonyError:
            self._broken_ids = [token_id]
            return [("content", self._broken_text(final=False))]
        if token_id in self._end_ids:
            self._kind = None
            return []
        out: list[tuple[str, Any]] = []
        if self._kind is None:
            self._kind = self._open_message(out)
        piece = self._parser.last_content_delta
        if self._kind is not None and piece:
            out.append(self._piece(piece))
        return out

    def _open_message(self, out: list[tuple[str, Any]]) -> str | None:
        """The kind of the message whose header just ended; None while in a header. A new
        tool call's header entry goes to `out`."""
        channel, recipient = self._parser.current_channel, self._parser.current_recipient
        if channel is None and recipient is None:
            return "content" if self._parser.last_content_delta else None
        if recipient is not None and recipient.startswith(FUNCTION_PREFIX):
            call = {
                "index": len(self._calls),
                "id": new_call_id(),
                "name": recipient[len(FUNCTION_PREFIX) :],
                "arguments": [],
            }
            self._calls.append(call)
            out.append(("call", call))
            return "call"
        if recipient is not None or channel == "analysis":
            return "reasoning"
        return "content"

    def _piece(self, piece: str) -> tuple[str, Any]:
        if self._kind == "call":
            self._calls[-1]["arguments"].append(piece)
            return ("arguments", (self._calls[-1]["index"], piece))
        if self._kind == "reasoning":
            if not self._include_reasoning:
                return ("reasoning", "")
            self._reasoning.append(piece)
            return ("reasoning", piece)
        self._content.append(piece)
        return ("content", piece)

    def _broken_text(self, final: bool) -> str:
        """Text of the tokens after the break not sent yet; a character still missing
        bytes waits for its next token unless this is the end."""
        assert self._broken_ids is not None
        text = self._encoding.decode(self._broken_ids)
        end = len(text)
        if not final:
            while end > self._broken_sent and text[end - 1] == REPLACEMENT_CHAR:
                end -= 1
        piece = text[self._broken_sent : end]
        self._broken_sent = max(self._broken_sent, end)
        if piece:
            self._content.append(piece)
        return piece


def _append(deltas: list[dict[str, Any]], kind: str, value: Any) -> None:
    """Add one piece to the deltas, merged into the last delta when it has the same kind."""
    last = deltas[-1] if deltas else None
    if kind == "content" or kind == "reasoning":
        field = "content" if kind == "content" else "reasoning_content"
        if last is not None and set(last) == {field}:
            last[field] += value
        else:
            deltas.append({field: value})
    elif kind == "call":
        header = {
            "index": value["index"],
            "id": value["id"],
            "type": "function",
            "function": {"name": value["name"], "arguments": ""},
        }
        deltas.append({"tool_calls": [header]})
    else:
        index, piece = value
        entries = last.get("tool_calls") if last is not None else None
        if entries and entries[-1]["index"] == index and "id" not in entries[-1]:
            entries[-1]["function"]["arguments"] += piece
        else:
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})


def _has_value(delta: dict[str, Any]) -> bool:
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
