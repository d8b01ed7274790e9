"""One choice's output through its tool-call parser: the OpenAI delta pieces for a stream,
or the whole message for a non-streamed response.

Per call the stream carries, as OpenAI sends it: one entry with index, id, type, function
name and empty arguments, then entries with argument fragments; the choice ends with
finish_reason "tool_calls" when the model called a tool on its own (auto, required) and
stopped by itself. A named tool choice keeps "stop", as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from app.tool_calls.parsers import NamedFunctionParser, ToolCallParser


class ToolCallOutput:
    __slots__ = ("_parser", "_num_calls")

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._num_calls = 0

    def feed(
        self, text: str, finish_reason: str | None
    ) -> tuple[str, list[dict[str, Any]], str | None]:
        """(content text, tool_calls delta entries, finish reason) for the next piece."""
        content, deltas = self._parser.feed(text)
        if finish_reason is not None:
            more_content, more_deltas = self._parser.finish()
            content, deltas = content + more_content, deltas + more_deltas
        self._num_calls += sum(1 for d in deltas if d.id is not None)
        return content, [d.as_openai() for d in deltas], self._finish_reason(finish_reason)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed message fields (content, tool_calls) and finish reason."""
        content, _, reason = self.feed(text, finish_reason or "stop")
        calls = self._parser.calls
        if not calls:
            return {"content": content}, finish_reason
        message: dict[str, Any] = {
            "content": content or None,
            "tool_calls": [c.as_openai() for c in calls],
        }
        return message, reason if finish_reason is not None else None

    def _finish_reason(self, finish_reason: str | None) -> str | None:
        if (
            finish_reason == "stop"
            and self._num_calls
            and not isinstance(self._parser, NamedFunctionParser)
        ):
            return "tool_calls"
        return finish_reason
