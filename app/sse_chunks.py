"""The chunk envelope every streamed choice goes out in, shared by the chat and text
completion formatters (app/sse_chat_chunks.py, app/sse_completion_chunks.py).

Per choice: a role chunk once the first output exists (chat only), content chunks, then
exactly one chunk with finish_reason. With `include_usage` a last chunk has `choices: []`
and the usage; `continuous_usage_stats` puts cumulative usage on every chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.frontend.output_stream import StreamDelta
from app.responses import ChoiceState, ResponseMeta, usage


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
