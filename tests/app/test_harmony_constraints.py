"""The grammars that force a harmony turn to end in a tool call or a JSON answer, run
token by token on gpt-oss's real tokenizer with the engine's own grammar matcher: what
the model may write passes, what the request forbids is refused at the offending token,
and what passes reads back (app.harmony.output) as the call or answer asked for."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import llguidance
import pytest

from actors.core.grammar import GrammarMatcher, compile_matcher
from actors.protocol.structured_output import StructuredOutputSpec
from app.harmony.constraints import output_grammar
from app.harmony.model import HarmonyFormat
from app.harmony.output import HarmonyOutput
from app.harmony.vocab import ENCODINGS_BASE_ENV
from app.tokenizer import Tokenizer
from tests._gpt_oss_tokenizer import gpt_oss_tokenizer_dir

VOCAB_SIZE = 201_088
EOS_TOKEN_IDS = (200002, 199999, 200012)
"""gpt-oss's generation_config: <|return|>, <|endoftext|>, <|call|> (the engine passes
these to the grammar library, and the grammar must still name the last two itself)."""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get-time"}}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
ANALYSIS = "<|channel|>analysis<|message|>Think.\nÇa va: 2+2.<|end|><|start|>assistant"
PREAMBLE = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"


def _call(name: str, arguments: str, recipient_first: bool = False) -> str:
    header = (
        f" to=functions.{name}<|channel|>commentary"
        if recipient_first
        else f"<|channel|>commentary to=functions.{name} "
    )
    return f"{header}<|constrain|>json<|message|>{arguments}<|call|>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENCODINGS_BASE_ENV, "")
        patch.delenv(ENCODINGS_BASE_ENV)
        tokenizer = Tokenizer.from_hf_dir(gpt_oss_tokenizer_dir())
        tokenizer.harmony = HarmonyFormat.from_vocab(
            tokenizer.raw.get_vocab(with_added_tokens=False),
            os.fspath(tmp_path_factory.mktemp("harmony")),
        )
    return tokenizer


@functools.cache
def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """Once per tokenizer: serialising gpt-oss's tokenizer takes about half a second."""
    return llguidance.LLTokenizer(
        tokenizer.raw.to_str(), n_vocab=VOCAB_SIZE, eos_token=list(EOS_TOKEN_IDS)
    )


def _walk(tokenizer: Tokenizer, grammar: str, text: str) -> str | None:
    """None when the grammar takes the whole text and ends with it, else what stopped it."""
    spec = StructuredOutputSpec("grammar", grammar)
    matcher = GrammarMatcher(compile_matcher(_ll_tokenizer(tokenizer), spec))
    for token_id in tokenizer.encode(text):
        if not matcher.accept_token(token_id):
            return f"refused {tokenizer.decode([token_id])!r}"
    return None if matcher.is_terminated else "unfinished"


def _read(tokenizer: Tokenizer, text: str, named: bool = False) -> tuple[dict[str, Any], str]:
    assert tokenizer.harmony is not None
    output = HarmonyOutput(tokenizer.harmony, named_choice=named)
    message, reason = output.message(tokenizer.encode(text), "stop")
    assert reason is not None
    return message, reason


def test_required_ends_in_a_call_of_any_tool(tokenizer: Tokenizer) -> None:
    grammar = output_grammar([WEATHER, TIME], preambles=True)
    for text in (
        ANALYSIS + _call("get_weather", '{"city":"Paris"}'),
        ANALYSIS + PREAMBLE + _call("get-time", "{}"),
        ANALYSIS + _call("get_weather", '{"city":"Paris"}', recipient_first=True),
        _call("get-time", '{"zone":"UTC"}'),  # no schema: any object
    ):
        assert _walk(tokenizer, grammar, text) is None, text
    message, reason = _read(tokenizer, ANALYSIS + _call("get_weather", '{"city":"Paris"}'))
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert reason == "tool_calls" and message["reasoning_content"] == "Think.\nÇa va: 2+2."

    refused = {
        ANALYSIS + "<|channel|>final<|message|>Sunny.<|return|>": "refused 'final'",
        ANALYSIS + _call("get_news", "{}"): "refused '_news'",
        _call("get_weather", '{"town":"Paris"}'): "refused 'town'",
        _call("get_weather", '{"city": "Paris"}'): "refused ' \"'",  # one layout
        ANALYSIS: "unfinished",
    }
    for text, why in refused.items():
        assert _walk(tokenizer, grammar, text) == why, text


def test_named_choice_calls_that_function_only(tokenizer: Tokenizer) -> None:
    grammar = output_grammar([WEATHER], preambles=True)
    text = ANALYSIS + _call("get_weather", '{"city":"Oslo"}')
    assert _walk(tokenizer, grammar, text) is None
    message, reason = _read(tokenizer, text, named=True)
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert reason == "stop"  # as OpenAI reports a named choice
    assert _walk(tokenizer, grammar, _call("get-time", "{}")) == "refused '-time'"


def test_json_answer(tokenizer: Tokenizer) -> None:
    answer = '<|channel|>final<|message|>{"answer": 4}<|return|>'
    grammar = output_grammar([], ANSWER_SCHEMA)
    assert _walk(tokenizer, grammar, ANALYSIS + answer) is None
    message, reason = _read(tokenizer, ANALYSIS + answer)
    assert message["content"] == '{"answer": 4}' and reason == "stop"
    assert _walk(tokenizer, grammar, "<|channel|>final<|message|>Four.<|return|>") == (
        "refused 'Four'"
    )
    assert _walk(tokenizer, grammar, '<|channel|>final<|message|>{"answer": "4"}') == (
        "refused ' \"'"
    )
    # No tools shown: no commentary channel, no call.
    assert _walk(tokenizer, grammar, PREAMBLE + answer) == "refused 'comment'"
    # With tool_choice auto the turn may end in a call instead.
    with_tools = output_grammar([WEATHER], ANSWER_SCHEMA, preambles=True)
    for text in (ANALYSIS + answer, PREAMBLE + _call("get_weather", '{"city":"Rome"}')):
        assert _walk(tokenizer, with_tools, text) is None, text


def test_non_strict_answer_ignores_unsupported_keywords(tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such"}}}
    answer = '<|channel|>final<|message|>{"a": "x"}<|return|>'
    assert _walk(tokenizer, output_grammar([], schema, answer_strict=False), answer) is None
    with pytest.raises(ValueError, match="no-such"):
        _walk(tokenizer, output_grammar([], schema, answer_strict=True), answer)


@pytest.mark.parametrize("tools", [[], [{"type": "function", "function": {"name": "a b"}}]])
def test_grammar_needs_a_forceable_ending(tools: Sequence[dict[str, Any]]) -> None:
    with pytest.raises(ValueError):
        output_grammar(tools)
