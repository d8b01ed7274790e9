"""Bounds on text a request carries that the server parses a second time: a JSON schema
given as a string, tool-call arguments given as JSON text. The body's own parse bounds
neither: a string can hold a document nested thousands of levels deep (the parser recurses
once per level) or megabytes of schema for the grammar compiler. So such text is measured
before it is parsed, and a structured-output spec before it is compiled.

    problem = json_text_problem(text)   # None, or why it is refused ("nests too deeply: ...")
"""

from __future__ import annotations

import re
from itertools import accumulate

MAX_JSON_TEXT_CHARS = 1 << 20
"""Longest JSON text parsed a second time, and longest structured-output spec (a schema,
regex, grammar or choice list, as compiled): a mebibyte of schema is far more than any
real one, and what the grammar compiler is given stays small."""
MAX_JSON_TEXT_DEPTH = 512
"""Most nested arrays and objects in JSON text parsed a second time: well below the
parser's recursion limit wherever it runs, and below the grammar compiler's depth budget
(actors/core/grammar_limits.py)."""

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_text_problem(
    text: str, max_chars: int = MAX_JSON_TEXT_CHARS, max_depth: int = MAX_JSON_TEXT_DEPTH
) -> str | None:
    """Why `text` is not parsed (too long, nested too deeply), or None. Costs a few
    regular-expression passes over the text, never a parse."""
    if len(text) > max_chars:
        return f"is {len(text)} characters long; at most {max_chars} are allowed"
    if _nests_deeper(text, max_depth):
        return f"nests too deeply: at most {max_depth} levels of arrays and objects are allowed"
    return None


def spec_size_problem(text: str) -> str | None:
    """Why a structured-output spec is too large to compile, or None."""
    if len(text) > MAX_JSON_TEXT_CHARS:
        return f"is {len(text)} characters long; at most {MAX_JSON_TEXT_CHARS} are allowed"
    return None


def _nests_deeper(text: str, max_depth: int) -> bool:
    if text.count("[") + text.count("{") <= max_depth:
        return False  # too few brackets to nest deeper, wherever they are
    # Brackets inside strings are text. An unterminated string leaves its quote and
    # brackets behind, which may count a few levels too many for text that is invalid.
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > max_depth
