"""The `<think>` splitter of --reasoning-parser qwen3 / deepseek_r1 (app/reasoning/): whole
texts, the same texts cut at every place and in random pieces (the tags split across
them), and one choice's reader on top of it, with and without a hermes tool-call reader."""

from __future__ import annotations

import random

import pytest

from app.reasoning.output import ReasoningOutput
from app.reasoning.parsers import (
    ThinkSplitter,
    constraint_lead,
    prompt_leaves_think_open,
    starts_in_reasoning,
)
from app.tool_calls.output import ToolCallOutput
from app.tool_calls.parsers import HermesParser

OPENS_AS_CONTENT = [
    ("<think>\nPlan.</think>\n\nAnswer.", "\nPlan.", "\n\nAnswer."),
    ("Answer only.", "", "Answer only."),
    ("<think></think>Answer.", "", "Answer."),
    ("<think>\n\n</think>\n\nAnswer.", "\n\n", "\n\nAnswer."),
    ("A <think>b</think> c", "", "A <think>b</think> c"),
    (" <think>x</think>y", "", " <think>x</think>y"),
    ("<think>a</think>b</think>c", "a", "b</think>c"),
    ("<think>a<think>b</think>c", "a<think>b", "c"),
    ("<think>Never ends </thi", "Never ends </thi", ""),
    ("<thin", "", "<thin"),
    ("<think>", "", ""),
    ("", "", ""),
]
"""(completion, reasoning, content) where the prompt leaves no think block open (qwen3)."""
OPENS_IN_REASONING = [
    ("Plan.</think>Answer.", "Plan.", "Answer."),
    ("<think>Plan.</think>\nAnswer.", "Plan.", "\nAnswer."),
    ("No end at all", "No end at all", ""),
    ("</think>Answer.", "", "Answer."),
    ("Plan.</think>", "Plan.", ""),
    ("x<<</think>y", "x<<", "y"),
    ("<</think>>", "<", ">"),
    ("Plan <tool_call>{}</tool_call></think>ok", "Plan <tool_call>{}</tool_call>", "ok"),
    ("<thin", "<thin", ""),
    ("Ends in </think", "Ends in </think", ""),
    ("", "", ""),
]
"""(completion, reasoning, content) for deepseek_r1, or a prompt that opened the block."""
CASES = [(False, *case) for case in OPENS_AS_CONTENT] + [
    (True, *case) for case in OPENS_IN_REASONING
]


def _fed(in_reasoning: bool, pieces: list[str]) -> tuple[str, str]:
    """The joined (reasoning, content) of a stream of pieces; reasoning never follows
    content."""
    splitter = ThinkSplitter(in_reasoning)
    reasoning, content = "", ""
    for piece in [*pieces, None]:
        more_reasoning, more_content = splitter.finish() if piece is None else splitter.feed(piece)
        assert not (content and more_reasoning), "reasoning after content"
        reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning, content


@pytest.mark.parametrize(("in_reasoning", "text", "reasoning", "content"), CASES)
def test_whole_text(in_reasoning: bool, text: str, reasoning: str, content: str) -> None:
    assert _fed(in_reasoning, [text]) == (reasoning, content)


@pytest.mark.parametrize(("in_reasoning", "text", "reasoning", "content"), CASES)
def test_cut_anywhere(in_reasoning: bool, text: str, reasoning: str, content: str) -> None:
    expected = (reasoning, content)
    assert _fed(in_reasoning, list(text)) == expected
    for cut in range(len(text) + 1):
        assert _fed(in_reasoning, [text[:cut], text[cut:]]) == expected, cut
    rng = random.Random(20240611)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _fed(in_reasoning, pieces) == expected, pieces


def test_what_may_be_a_tag_waits() -> None:
    splitter = ThinkSplitter(in_reasoning=False)
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>Plan") == ("Plan", "")
    assert splitter.feed(" more </th") == (" more ", "")
    assert splitter.feed("inking") == ("</thinking", "")
    assert splitter.feed("</think>\n") == ("", "\n")
    assert splitter.feed("<think>") == ("", "<think>")
    assert splitter.finish() == ("", "")
    content = ThinkSplitter(in_reasoning=False)
    assert content.feed("<tx") == ("", "<tx")


@pytest.mark.parametrize(
    ("prompt", "is_open"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
        ("<think>old</think> turn <think>", True),
        ("<think>a</think> b", False),
        ("", False),
        (None, False),
    ],
)
def test_prompt_leaves_think_open(prompt: str | None, is_open: bool) -> None:
    assert prompt_leaves_think_open(prompt) is is_open


def test_where_a_completion_starts() -> None:
    opened, closed = "assistant\n<think>\n", "assistant\n"
    assert starts_in_reasoning("deepseek_r1", closed)
    assert starts_in_reasoning("qwen3", opened)
    assert not starts_in_reasoning("qwen3", closed)


def test_what_a_constraint_lets_come_first() -> None:
    opened, closed = "assistant\n<think>\n", "assistant\n"
    assert constraint_lead("qwen3", closed, True) == "may_think"
    assert constraint_lead("qwen3", opened, True) == "thinking"
    assert constraint_lead("deepseek_r1", closed, True) == "thinking"
    assert constraint_lead("qwen3", opened, False) == ""  # no think tokens to name
    assert constraint_lead("none", opened, True) == ""


CALL_TEXT = (
    "<think>Maybe <tool_call>{}</tool_call>? No: call it.</think>\n\n"
    'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)


def _streamed(output: ReasoningOutput, text: str) -> tuple[dict[str, str], str | None]:
    """Fed char by char: the joined fields, and the finish reason."""
    joined = {"reasoning_content": "", "content": "", "arguments": ""}
    reason = None
    for i, char in enumerate(text):
        deltas, reason = output.feed(char, "stop" if i == len(text) - 1 else None)
        for delta in deltas:
            joined["reasoning_content"] += delta.get("reasoning_content", "")
            joined["content"] += delta.get("content", "")
            for entry in delta.get("tool_calls", []):
                joined["arguments"] += entry["function"]["arguments"]
    return joined, reason


def test_reasoning_then_tool_call() -> None:
    message, reason = ReasoningOutput(ThinkSplitter(False), ToolCallOutput(HermesParser())).message(
        CALL_TEXT, "stop"
    )
    assert message["reasoning_content"] == "Maybe <tool_call>{}</tool_call>? No: call it."
    assert message["content"] == "\n\nChecking." and reason == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert list(message)[:2] == ["content", "reasoning_content"]

    joined, reason = _streamed(
        ReasoningOutput(ThinkSplitter(False), ToolCallOutput(HermesParser())), CALL_TEXT
    )
    assert joined == {
        "reasoning_content": message["reasoning_content"],
        "content": message["content"],
        "arguments": '{"city": "Paris"}',
    }
    assert reason == "tool_calls"


def test_without_tools_or_reasoning() -> None:
    text = "<think>Plan.</think>Answer."
    message, reason = ReasoningOutput(ThinkSplitter(False), None, False).message(text, "length")
    assert message == {"content": "Answer.", "reasoning_content": None} and reason == "length"
    joined, _ = _streamed(ReasoningOutput(ThinkSplitter(False), None, False), text)
    assert joined == {"reasoning_content": "", "content": "Answer.", "arguments": ""}
    only_reasoning, _ = ReasoningOutput(ThinkSplitter(True)).message("Plan.", "length")
    assert only_reasoning == {"content": "", "reasoning_content": "Plan."}
