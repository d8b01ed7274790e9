"""The text completion chunks of a streamed choice. A choice's first chunk also carries the
echoed prompt (with its logprobs), vLLM's `prompt_logprobs` and, with `return_token_ids`,
`prompt_token_ids`; then every chunk carries its own `token_ids`. A step's tokens get a
chunk even before they decode to text. Separate from chat because echo and text offsets are
completions' own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.frontend.output_stream import StreamDelta
from app import prompt_logprobs
from app.responses import ChoiceState, ResponseMeta, completion_logprobs, next_text_offset
from app.sse_chunks import ChunkFormatter


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
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """`echo_texts[i]`: prompt i's text, sent before its choices' first output (echo);
        `echo_first_tokens[i]`: prompt i's first token when echo comes with logprobs;
        `prompt_token_ids[i]`: prompt i's ids (return_token_ids), None to send no ids."""
        super().__init__(meta, prompt_lens, choices, continuous_usage)
        self.echo_texts = echo_texts
        self.echo_first_tokens = echo_first_tokens
        self.prompt_token_ids = prompt_token_ids

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
        if self.prompt_token_ids is not None:
            # the exact ids, so a client can send the conversation back as tokens
            if first:
                body["prompt_token_ids"] = list(self.prompt_token_ids[choice.prompt_index])
            body["token_ids"] = list(delta.token_ids)
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
