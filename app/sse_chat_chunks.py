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
        # a chat reads harmony or <think> blocks, never both (routes_chat)
        self._new_piece_output: Callable[[], HarmonyOutput | ReasoningOutput] | None = (
            harmony or reasoning
        )
        self._reads_token_ids = harmony is not None
        self._piece_outputs: dict[int, HarmonyOutput | ReasoningOutput] = {}
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
        if self._new_piece_output is not None:
            read = delta.token_ids if self._reads_token_ids else delta.text
            return out + self._piece_chunks(choice.index, delta, logprobs, read)
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

    def _piece_chunks(
        self, index: int, delta: StreamDelta, logprobs: Any, read: Any
    ) -> list[dict[str, Any]]:
        """One chunk per reasoning, content or tool-call piece, in the order the model wrote
        them (the delta's logprobs ride on the first), then the finish chunk. `read`: the
        delta's part the choice's reader takes (a harmony reader its token ids, a `<think>`
        reader its text)."""
        assert self._new_piece_output is not None
        output = _reader(self._piece_outputs, index, self._new_piece_output)
        pieces, finish_reason = output.feed(read, delta.finish_reason)
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
