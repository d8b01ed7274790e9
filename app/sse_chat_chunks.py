"""The chat completion chunks of a streamed choice: the role chunk, then content, tool-call,
or reasoning, content and tool-call deltas (harmony, --reasoning-parser), then the finish
chunk. A chat stream's first chunk carries `prompt_logprobs` once. Separate from text
completions because tool calls and reasoning shape the chat deltas and nothing else."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from actors.frontend.output_stream import StreamDelta
from app import prompt_logprobs
from app.responses import ChoiceState, ResponseMeta, chat_logprobs, with_reasoning_alias
from app.sse_chunks import ChunkFormatter
from app.tool_calls.output import ToolCallOutput

if TYPE_CHECKING:
    from app.harmony.output import HarmonyOutput
    from app.reasoning.output import ReasoningOutput

Reader = TypeVar("Reader")


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
        reasoning: Callable[[], ReasoningOutput] | None = None,
    ) -> None:
        """`tool_calls`: makes each choice's tool-call reader when the request has tools;
        `harmony`: each choice's reader of a harmony (gpt-oss) completion, whose chunks
        carry `reasoning_content`, `content` and `tool_calls` deltas; `reasoning`: the
        same for a `<think>` model's completion (it reads the tool calls itself)."""
        super().__init__(meta, prompt_lens, choices, continuous_usage)
        self.role = role
        self.echo_prefix = echo_prefix
        self._new_tool_output = tool_calls
        self._tool_outputs: dict[int, ToolCallOutput] = {}
        self._new_harmony_output = harmony
        self._harmony_outputs: dict[int, HarmonyOutput] = {}
        self._new_reasoning_output = reasoning
        self._reasoning_outputs: dict[int, ReasoningOutput] = {}
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
        if self._new_reasoning_output is not None:
            return out + self._reasoning_chunks(choice.index, delta, logprobs)
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
        output = _reader(self._tool_outputs, index, self._new_tool_output)
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
        assert self._new_harmony_output is not None
        output = _reader(self._harmony_outputs, index, self._new_harmony_output)
        pieces, finish_reason = output.feed(delta.token_ids, delta.finish_reason)
        return self._piece_chunks(index, delta, logprobs, pieces, finish_reason)

    def _reasoning_chunks(
        self, index: int, delta: StreamDelta, logprobs: Any
    ) -> list[dict[str, Any]]:
        assert self._new_reasoning_output is not None
        output = _reader(self._reasoning_outputs, index, self._new_reasoning_output)
        pieces, finish_reason = output.feed(delta.text, delta.finish_reason)
        return self._piece_chunks(index, delta, logprobs, pieces, finish_reason)

    def _piece_chunks(
        self,
        index: int,
        delta: StreamDelta,
        logprobs: Any,
        pieces: list[dict[str, Any]],
        finish_reason: str | None,
    ) -> list[dict[str, Any]]:
        """One chunk per reasoning, content or tool-call piece, in the order the model wrote
        them (the delta's logprobs ride on the first), then the finish chunk."""
        if logprobs and not pieces:
            pieces = [{"content": ""}]
        out = [
            self._choice(index, with_reasoning_alias(piece), logprobs if i == 0 else None)
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


def _reader(readers: dict[int, Reader], index: int, new: Callable[[], Reader]) -> Reader:
    """Choice `index`'s reader, made on its first delta (setdefault would make one per
    delta and drop it)."""
    reader = readers.get(index)
    if reader is None:
        reader = readers[index] = new()
    return reader
