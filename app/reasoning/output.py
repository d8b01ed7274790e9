"""One choice's completion from a `<think>` model, read into OpenAI's chat fields: its
reasoning into `reasoning_content`, the rest into `content`, through the request's
tool-call reader when it has one (so hermes `<tool_call>` blocks become `tool_calls`; a
tool-call tag inside the reasoning stays reasoning).

The stream and the non-streamed message both come from the same split, so joined deltas
equal the message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actors.protocol.sampling_params import SamplingParams
from app.reasoning.parsers import THINK_PARSERS, ThinkSplitter, starts_in_reasoning
from app.schemas import ChatCompletionRequest
from app.tool_calls.output import ToolCallOutput


class ReasoningOutput:
    """Reads one choice's text. `feed` returns the OpenAI delta objects (reasoning, then
    content, then tool-call entries) and the finish reason to report (the tool-call
    reader's, when there is one)."""

    __slots__ = ("_include_reasoning", "_splitter", "_tools")

    def __init__(
        self,
        splitter: ThinkSplitter,
        tools: ToolCallOutput | None = None,
        include_reasoning: bool = True,
    ) -> None:
        self._splitter = splitter
        self._tools = tools
        self._include_reasoning = include_reasoning

    def feed(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        reasoning, content = self._split(text, final=finish_reason is not None)
        deltas: list[dict[str, Any]] = []
        if reasoning:
            deltas.append({"reasoning_content": reasoning})
        entries: list[dict[str, Any]] = []
        if self._tools is not None:
            content, entries, finish_reason = self._tools.feed(content, finish_reason)
        if content:
            deltas.append({"content": content})
        deltas += [{"tool_calls": [entry]} for entry in entries]
        return deltas, finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed message fields and finish reason, for all of a choice's text."""
        reasoning, content = self._split(text, final=True)
        fields: dict[str, Any] = {"content": content}
        if self._tools is not None:
            fields, finish_reason = self._tools.message(content, finish_reason)
        return {
            "content": fields.pop("content"),
            "reasoning_content": reasoning or None,
            **fields,
        }, finish_reason

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = self._splitter.feed(text)
        if final:
            more_reasoning, more_content = self._splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return (reasoning if self._include_reasoning else ""), content


def reasoning_output_factory(
    parser: str,
    req: ChatCompletionRequest,
    prompt: str | None,
    tools: Callable[[], ToolCallOutput] | None,
    params: SamplingParams,
) -> Callable[[], ReasoningOutput] | None:
    """Makes one choice's reader under --reasoning-parser `parser` (None when it reads no
    `<think>` blocks); `prompt` is the rendered prompt's text, `tools` the request's
    tool-call readers, `params` its final sampling parameters (an output constraint without
    a reasoning lead binds the completion from its first token: no reasoning)."""
    if parser not in THINK_PARSERS:
        return None
    spec = params.structured_output
    bound_from_start = spec is not None and not spec.reasoning
    in_reasoning = not bound_from_start and starts_in_reasoning(parser, prompt)
    include_reasoning = req.include_reasoning is not False
    return lambda: ReasoningOutput(
        ThinkSplitter(in_reasoning), None if tools is None else tools(), include_reasoning
    )
