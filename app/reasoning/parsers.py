"""Where a `<think>...</think>` model's reasoning ends and its answer begins, read from
its text as it streams.

    qwen3        the completion is reasoning when it opens with `<think>`, or when the
                 prompt leaves a think block open (Qwen3 Thinking-2507 templates end it
                 with `<think>\\n`); otherwise (e.g. `enable_thinking: false`, whose
                 template closes an empty think block) it is all content
    deepseek_r1  the completion starts in reasoning, with or without a leading `<think>`

A leading `<think>` is dropped. In reasoning, the first `</think>` ends it and all that
follows is content, as written (the newlines after `</think>` stay, as in vLLM); with no
`</think>` the whole completion is reasoning.

An output constraint (response_format, a forced tool choice) binds what follows the
reasoning (`constraint_lead`: the grammar lets the model think first), where the
tokenizer has `<think>` and `</think>` as tokens of their own; otherwise the constraint
binds from the first token and the completion starts as content.

    splitter = ThinkSplitter(starts_in_reasoning("qwen3", prompt_text))
    reasoning, content = splitter.feed(text_piece)   # as the output streams
    reasoning, content = splitter.finish()           # at the end: what was held back
"""

from __future__ import annotations

from actors.protocol.structured_output import ReasoningLead
from app.tool_calls.parsers import safe_end

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_PARSERS = ("qwen3", "deepseek_r1")
HARMONY_PARSER = "openai_gptoss"
"""vLLM's name for gpt-oss's parser: tandem reads harmony models so anyway."""
REASONING_PARSERS = ("none", *THINK_PARSERS, HARMONY_PARSER)


def prompt_leaves_think_open(prompt: str | None) -> bool:
    """Whether the prompt's last `<think>` has no `</think>` after it."""
    if not prompt:
        return False
    start = prompt.rfind(THINK_OPEN)
    return start >= 0 and prompt.find(THINK_CLOSE, start) < 0


def starts_in_reasoning(parser: str, prompt: str | None) -> bool:
    """Whether a completion that does not open with `<think>` is reasoning from its start."""
    return parser == "deepseek_r1" or prompt_leaves_think_open(prompt)


def constraint_lead(parser: str, prompt: str | None, has_think_tokens: bool) -> ReasoningLead:
    """What an output constraint lets come before the text it binds: reasoning under a
    think parser, when `has_think_tokens` (the tokenizer has `<think>` and `</think>` as
    tokens of their own, which the grammar names); else nothing."""
    if parser not in THINK_PARSERS or not has_think_tokens:
        return ""
    return "thinking" if starts_in_reasoning(parser, prompt) else "may_think"


class ThinkSplitter:
    """One completion's text, fed piece by piece, split into (reasoning, content): what
    each call returns is the text not returned before, reasoning first (nothing after
    content is reasoning). Trailing text that may be the start of `<think>` (at the
    beginning) or `</think>` waits for the next piece, or for `finish`."""

    __slots__ = ("_held", "_in_reasoning", "_phase")

    def __init__(self, in_reasoning: bool) -> None:
        self._in_reasoning = in_reasoning
        """Where the completion is when it does not open with `<think>`."""
        self._phase = "start"
        """'start' (undecided), 'reasoning' or 'content'."""
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._held + text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._split(self._held, final=True)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        self._held = ""
        if self._phase == "start":
            if text.startswith(THINK_OPEN):
                text, self._phase = text[len(THINK_OPEN) :], "reasoning"
            elif THINK_OPEN.startswith(text) and not final:
                self._held = text
                return "", ""
            else:
                self._phase = "reasoning" if self._in_reasoning else "content"
        if self._phase == "content":
            return "", text
        end = text.find(THINK_CLOSE)
        if end >= 0:
            self._phase = "content"
            return text[:end], text[end + len(THINK_CLOSE) :]
        safe = len(text) if final else safe_end(text, THINK_CLOSE)
        self._held = text[safe:]
        return text[:safe], ""
