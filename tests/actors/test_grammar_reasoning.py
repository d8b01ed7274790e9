"""Output constraints after reasoning (actors/core/grammar_reasoning.py): on a byte-level
tokenizer with `<think>` and `</think>` as added tokens (as Qwen3's are), the reasoning is
free, the constraint binds what follows `</think>`, and without a reasoning lead it binds
from the first token."""

from __future__ import annotations

import functools

import pytest
from tokenizers import AddedToken, Tokenizer

from actors.core.grammar import GrammarCompiler
from actors.protocol.structured_output import ReasoningLead, StructuredOutputSpec
from tests.actors._tokenizer_fixtures import tiny_tokenizer

SCHEMA = '{"type": "object", "properties": {"t": {"type": "integer"}}, "required": ["t"]}'


@functools.cache
def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_str(tiny_tokenizer().to_str())
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    return tokenizer


@functools.cache
def _compiler() -> GrammarCompiler:
    tokenizer = _tokenizer()
    return GrammarCompiler(tokenizer.to_str(), tokenizer.get_vocab_size(), [0])


def _accepts(spec: StructuredOutputSpec, text: str) -> tuple[bool, bool]:
    """(every token of `text` accepted, the matcher accepting at the end)."""
    matcher = _compiler().matcher(spec)
    ids = _tokenizer().encode(text, add_special_tokens=False).ids
    return all(matcher.accept_token(i) for i in ids), matcher.is_accepting


def _json(reasoning: ReasoningLead) -> StructuredOutputSpec:
    return StructuredOutputSpec("json", SCHEMA, reasoning=reasoning)


def test_the_think_tags_are_tokens_of_their_own() -> None:
    ids = _tokenizer().encode("<think>a</think>", add_special_tokens=False).ids
    assert len(ids) == 3


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ('<think>\nIt wants {"t": 1}. </think>\n\n{"t": 21}', (True, True)),
        ('{"t": 21}', (True, True)),  # no thinking at all
        ("<think>hmm</think>\n\nhello", (False, False)),  # the answer is bound
        ('<think>hmm</think>\n\n\n{"t": 21}', (False, False)),  # at most two blanks
        ("<think>still thinking", (True, False)),
        ('hmm</think>{"t": 21}', (False, False)),  # reasoning must open with <think>
    ],
)
def test_may_think(text: str, accepted: tuple[bool, bool]) -> None:
    assert _accepts(_json("may_think"), text) == accepted


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ('The prompt opened it. {"no": 1}</think>\n{"t": 2}', (True, True)),
        ('<think>hmm</think>{"t": 2}', (True, True)),
        ('{"t": 2}', (True, False)),  # still reasoning: the answer comes after </think>
        ("hmm</think>\nhello", (False, False)),
    ],
)
def test_thinking(text: str, accepted: tuple[bool, bool]) -> None:
    assert _accepts(_json("thinking"), text) == accepted


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputSpec("regex", "[0-9]+", reasoning="may_think"),
        StructuredOutputSpec("choice", '["12", "no"]', reasoning="may_think"),
        StructuredOutputSpec("grammar", 'start: "1" "2"', reasoning="may_think"),
        StructuredOutputSpec("grammar", 'root ::= "12"', reasoning="may_think"),
    ],
    ids=["regex", "choice", "lark", "gbnf"],
)
def test_every_kind_of_constraint_follows_the_reasoning(spec: StructuredOutputSpec) -> None:
    assert _accepts(spec, "<think>a b</think>\n12") == (True, True)
    assert _accepts(spec, "<think>a b</think>\nab")[0] is False


def test_without_a_lead_the_constraint_binds_from_the_first_token() -> None:
    assert _accepts(_json(""), '{"t": 3}') == (True, True)
    assert _accepts(_json(""), '<think>hmm</think>{"t": 3}')[0] is False
