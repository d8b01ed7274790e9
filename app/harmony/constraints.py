"""Output constraints for a harmony completion: one Lark grammar over the whole turn.

A harmony turn is markup and text together, so a forced tool call or a JSON answer cannot
be a plain JSON-schema grammar (it would forbid the channel markup). The grammar walks the
turn instead, with harmony's special tokens as tokens (`<|channel|>`, ...) and the JSON
parts as embedded schemas (`%json`):

    start       (analysis | preamble)* ending
    analysis    <|channel|>analysis<|message|>TEXT<|end|><|start|>assistant
    preamble    <|channel|>commentary<|message|>TEXT<|end|><|start|>assistant
                                                          (only when tools are shown)
    ending      a call of one allowed function:
                    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
                    ARGUMENTS<|call|>
                (or ` to=functions.NAME<|channel|>commentary`, the header's other order)
                and/or, when a JSON answer is asked for:
                    <|channel|>final<|message|>JSON<|return|>

The reasoning stays free; what the client asked for is what ends the turn. `<|call|>` and
`<|return|>` end the grammar, and are stop tokens, so the request ends there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_\-]+")
"""Function names a grammar can force: OpenAI's own rule (harmony's recipient is the name
after `functions.`, up to a space or a special token)."""
TOOL_ARGUMENTS_LAYOUT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
"""Tool-call arguments on one line, compact, as harmony's own examples write them."""
ANSWER_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""A JSON answer on one line with OpenAI's separators, as for every other model
(actors.core.grammar's layout of JSON specs)."""
_FREE_TEXT = "TEXT: /(?s:.*)/"
"""Reasoning and preambles: any text (special tokens are never text, so it ends at
`<|end|>`)."""
_MESSAGE_END = "<|end|> <|start|> " + json.dumps("assistant")


def output_grammar(
    call_tools: Sequence[Mapping[str, Any]],
    answer_schema: Any | None = None,
    *,
    answer_strict: bool = True,
    preambles: bool = False,
) -> str:
    """The Lark grammar of a turn that ends in a call of one of `call_tools` (checked
    function tools in OpenAI's shape, names matching FUNCTION_NAME) or, when
    `answer_schema` (a decoded JSON schema) is given, in a final answer matching it.
    `preambles`: commentary messages may come before the ending (when tools are shown)."""
    if not call_tools and answer_schema is None:
        raise ValueError("a harmony grammar needs a tool to call or an answer schema")
    rules = [
        "start: (analysis" + (" | preamble" if preambles else "") + ")* ending",
        f"analysis: <|channel|> {json.dumps('analysis')} <|message|> TEXT {_MESSAGE_END}",
    ]
    if preambles:
        rules.append(
            f"preamble: <|channel|> {json.dumps('commentary')} <|message|> TEXT {_MESSAGE_END}"
        )
    endings = []
    for index, tool in enumerate(call_tools):
        endings.append(f"call_{index}")
        rules.append(f"call_{index}: {_call(tool['function'])}")
    if answer_schema is not None:
        endings.append("answer")
        schema = _with_layout(answer_schema, ANSWER_LAYOUT, strict=answer_strict)
        rules.append(
            f"answer: <|channel|> {json.dumps('final')} <|message|> %json {schema} <|return|>"
        )
    rules += ["ending: " + " | ".join(endings), _FREE_TEXT]
    return "\n".join(rules) + "\n"


def _call(function: Mapping[str, Any]) -> str:
    name = function["name"]
    if not FUNCTION_NAME.fullmatch(name):
        raise ValueError(f"function name {name!r} cannot be forced")
    recipient = f"to=functions.{name}"
    header = (
        f"(<|channel|> {json.dumps('commentary ' + recipient)}"
        f" | {json.dumps(' ' + recipient)} <|channel|> {json.dumps('commentary')})"
    )
    parameters = function.get("parameters") or {"type": "object"}
    arguments = _with_layout(parameters, TOOL_ARGUMENTS_LAYOUT, strict=True)
    return (
        f'{header} " "? <|constrain|> {json.dumps("json")} <|message|> %json {arguments} <|call|>'
    )


def _with_layout(schema: Any, layout: Mapping[str, Any], *, strict: bool) -> str:
    """The schema as one line of JSON text with its layout options (`x-guidance`, which
    the grammar library reads in an embedded schema); not strict: unsupported keywords
    are ignored."""
    options = {**layout, "lenient": not strict}
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    given = schema.get("x-guidance")
    merged = {**(given if isinstance(given, Mapping) else {}), **options}
    return json.dumps({**schema, "x-guidance": merged}, ensure_ascii=False, separators=(",", ":"))
