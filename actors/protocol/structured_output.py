"""What a request asks its output to match: a JSON schema, a regex, a choice of strings or a
grammar. Plain strings only, so the spec travels inside SamplingParams to the engine core
unchanged (msgspec and pickle alike) and serves as its own grammar-cache key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StructuredOutputKind = Literal["json", "regex", "choice", "grammar"]
ReasoningLead = Literal["", "may_think", "thinking"]
"""What may come before the constrained text (a `<think>` model under a reasoning parser):
"" nothing, the constraint binds from the first token; "may_think" an optional
`<think>...</think>` block; "thinking" reasoning up to `</think>` (the prompt opened the
block; a leading `<think>` is allowed). Free text either way, then at most two spaces or
newlines, then the constrained text."""
JSON_OBJECT_SCHEMA = '{"type":"object"}'
"""`response_format: json_object`: any JSON object."""


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    kind: StructuredOutputKind
    text: str
    """json: the schema as JSON text; regex: the pattern (Rust regex syntax); choice: a JSON
    array of the allowed strings; grammar: Lark or GBNF (llama.cpp) text."""
    strict: bool = True
    """json only: refuse schema keywords the grammar cannot enforce (False ignores them,
    as OpenAI's non-strict json_schema does)."""
    reasoning: ReasoningLead = ""
