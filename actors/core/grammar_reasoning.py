"""Free reasoning before a constrained answer: a `<think>` model under a reasoning parser
thinks first, and the request's grammar binds only what follows `</think>` (as vLLM's
structured outputs do with a reasoning parser).

The grammar is one Lark grammar over the whole completion, with the request's own grammar
embedded as a sub-grammar:

    may_think   start: (<think> REASONING </think> SEP)? answer
    thinking    start: <think>? REASONING </think> SEP answer

`<think>` and `</think>` are the tokenizer's special tokens (Qwen3, DeepSeek-R1: one
token each), and special tokens are never text, so the reasoning ends exactly at the
`</think>` token; SEP is the blank line such models write after it (at most two spaces or
newlines).
"""

from __future__ import annotations

import json

from actors.protocol.structured_output import ReasoningLead

ANSWER_GRAMMAR_NAME = "answer"
_STARTS = {
    "may_think": "start: (<think> REASONING </think> SEP)? answer",
    "thinking": "start: <think>? REASONING </think> SEP answer",
}
_RULES = "REASONING: /(?s:.*)/\nSEP: /[ \\n]{0,2}/\nanswer: @" + ANSWER_GRAMMAR_NAME + "\n"


def after_reasoning(definition: str, reasoning: ReasoningLead) -> str:
    """The llguidance grammar that lets `reasoning` come before `definition` (what
    llguidance's builders return: Lark text, or JSON whose first grammar is the start)."""
    if reasoning not in _STARTS:
        raise ValueError(f"unknown reasoning lead {reasoning!r}")
    grammars = _grammars(definition)
    grammars[0] = {**grammars[0], "name": ANSWER_GRAMMAR_NAME}
    wrapper = {"lark_grammar": _STARTS[reasoning] + "\n" + _RULES}
    return json.dumps({"grammars": [wrapper, *grammars]})


def _grammars(definition: str) -> list[dict[str, object]]:
    try:
        parsed = json.loads(definition)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("grammars"), list):
        return list(parsed["grammars"])
    return [{"lark_grammar": definition}]
