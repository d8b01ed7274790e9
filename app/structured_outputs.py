"""Request fields that constrain the output -> one StructuredOutputSpec, checked up front.

Accepted, as OpenAI and vLLM spell them (at most one per request):

    response_format   {"type": "text"} | {"type": "json_object"}
                      | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs {"json": schema} | {"regex": str} | {"choice": [str]} | {"grammar": str}
                      | {"json_object": true}
    guided_json, guided_regex, guided_choice, guided_grammar   (vLLM's older names)

A spec longer than app/bounded_text.py allows, or a schema given as JSON text nested deeper,
is refused before it is parsed. An invalid schema, regex or grammar, or one over a budget
(actors/core/grammar_limits.py, the compile time budget), is a 400 naming the field and the
problem, found by compiling it as the engine will, in a checker process
(app/grammar_checker.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import (
    JSON_OBJECT_SCHEMA,
    ReasoningLead,
    StructuredOutputSpec,
)
from app.bounded_text import json_text_problem, spec_size_problem
from app.errors import APIError, bad_request
from app.grammar_checker import GrammarChecker, GrammarCheckerUnavailable
from app.tool_calls.request import NO_TOOLS, ToolPlan

CHECKER_RETRY_AFTER_S = 5
_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_IGNORED_STRUCTURED_KEYS = frozenset(
    {
        "disable_fallback",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
    }
)
"""vLLM backend tuning options: they change nothing about what output is valid here."""
_KIND_NAMES = {
    "json": "JSON schema",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}


CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *_GUIDED_FIELDS)


async def constrain_params(
    params: SamplingParams,
    request: object,
    checker: GrammarChecker,
    tools: ToolPlan = NO_TOOLS,
    num_ranks: int = 1,
    reasoning: ReasoningLead = "",
) -> SamplingParams:
    """`params` with the request's checked output constraint (from its fields, or from a
    required / named tool choice, after `reasoning`: app.reasoning.parsers.constraint_lead)
    and the decoding its tool-call parser needs. `checker` compiles new specs where they can
    harm no one."""
    fields = {name: getattr(request, name, None) for name in CONSTRAINT_FIELDS}
    found = structured_output_spec(fields)
    if tools.structured_output is not None:
        if found is not None:
            raise bad_request(
                f"tool_choice {tools.mode!r} constrains the output already; it "
                f"cannot be combined with {found[1]}",
                found[1],
            )
        found = (tools.structured_output, "tool_choice")
    changes: dict[str, Any] = {}
    if found is not None:
        if num_ranks > 1:
            raise bad_request(
                f"{found[1]}: structured outputs are not available with "
                "--tensor-parallel-size or --pipeline-parallel-size > 1",
                found[1],
            )
        if reasoning:
            found = (dataclasses.replace(found[0], reasoning=reasoning), found[1])
        await check_structured_output(checker, *found)
        changes["structured_output"] = found[0]
    if tools.needs_special_tokens:
        changes["skip_special_tokens"] = False
    return params.replace(**changes) if changes else params


def structured_output_spec(fields: Mapping[str, Any]) -> tuple[StructuredOutputSpec, str] | None:
    """The request's spec and the field it came from, or None when the output is free.
    Raises a 400 APIError naming the field for malformed or conflicting fields."""
    found: list[tuple[StructuredOutputSpec, str]] = []
    fmt = fields.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append((spec, "response_format"))
    outputs = fields.get("structured_outputs")
    if outputs is not None:
        found.append(_structured_outputs(outputs))
    for name, kind in _GUIDED_FIELDS.items():
        value = fields.get(name)
        if value is not None:
            found.append((_spec(kind, value, name), name))
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise bad_request(
            f"only one output constraint may be given per request, got {names}", found[1][1]
        )
    return found[0] if found else None


async def check_structured_output(
    checker: GrammarChecker, spec: StructuredOutputSpec, param: str
) -> None:
    """400 naming `param` when the spec cannot be compiled into a grammar (or is over a
    budget); 503 when no grammar checker could look at it."""
    try:
        problem = await checker.check(spec)
    except GrammarCheckerUnavailable as exc:
        raise APIError(
            503,
            f"{param}: the server cannot check structured output specs "
            f"right now ({exc}); retry shortly",
            retry_after_s=CHECKER_RETRY_AFTER_S,
        ) from None
    if problem is not None:
        problem = " ".join(problem.split())
        raise bad_request(f"{param}: invalid {_KIND_NAMES[spec.kind]}: {problem}", param)


def _response_format(fmt: Any) -> StructuredOutputSpec | None:
    if not isinstance(fmt, Mapping):
        raise bad_request("response_format must be an object with a 'type'", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json", JSON_OBJECT_SCHEMA)
    if kind != "json_schema":
        raise bad_request(
            f"response_format type {kind!r} is not supported; use 'text', "
            "'json_object' or 'json_schema'",
            "response_format",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, Mapping) or "schema" not in spec and "json_schema" not in spec:
        raise bad_request(
            "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
            "response_format.json_schema",
        )
    schema = spec.get("schema", spec.get("json_schema"))
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(
            "response_format.json_schema.strict must be true or false",
            "response_format.json_schema.strict",
        )
    return StructuredOutputSpec(
        "json", _schema_text(schema, "response_format.json_schema.schema"), strict=bool(strict)
    )


def _structured_outputs(outputs: Any) -> tuple[StructuredOutputSpec, str]:
    param = "structured_outputs"
    if not isinstance(outputs, Mapping):
        raise bad_request("structured_outputs must be an object", param)
    given = {k: v for k, v in outputs.items() if v is not None and v is not False}
    unknown = sorted(
        set(given) - set(_STRUCTURED_KEYS) - {"json_object"} - _IGNORED_STRUCTURED_KEYS
    )
    if unknown:
        raise bad_request(
            f"structured_outputs.{unknown[0]} is not supported; use json, regex, "
            "choice, grammar or json_object",
            f"{param}.{unknown[0]}",
        )
    kinds = [k for k in given if k in _STRUCTURED_KEYS or k == "json_object"]
    if len(kinds) != 1:
        raise bad_request(
            "structured_outputs needs exactly one of json, regex, choice, "
            f"grammar or json_object, got {kinds or 'none'}",
            param,
        )
    field_param = f"{param}.{kinds[0]}"
    if kinds[0] == "json_object":
        return StructuredOutputSpec("json", JSON_OBJECT_SCHEMA), field_param
    return _spec(_STRUCTURED_KEYS[kinds[0]], given[kinds[0]], field_param), field_param


def _spec(kind: str, value: Any, param: str) -> StructuredOutputSpec:
    if kind == "json":
        return StructuredOutputSpec("json", _schema_text(value, param))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{param} must be a non-empty list of strings", param)
        return StructuredOutputSpec("choice", _sized(json.dumps(value, ensure_ascii=False), param))
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return StructuredOutputSpec(kind, _sized(value, param))  # type: ignore[arg-type]


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):  # vLLM takes a schema as JSON text too
        problem = json_text_problem(schema)
        if problem is not None:
            raise bad_request(f"{param} {problem}", param)
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(f"{param} is not valid JSON", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema object", param)
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), sort_keys=False)
    except RecursionError:  # nested as deep as the body's parse allows, and then some
        raise bad_request(f"{param} nests too deeply", param) from None
    return _sized(text, param)


def _sized(text: str, param: str) -> str:
    problem = spec_size_problem(text)
    if problem is not None:
        raise bad_request(f"{param} {problem}", param)
    return text
