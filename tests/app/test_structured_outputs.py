"""Request fields -> one StructuredOutputSpec, with a 400 naming the field otherwise."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from actors.protocol.messages import GrammarCheckerStart
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import JSON_OBJECT_SCHEMA, StructuredOutputSpec
from app.errors import APIError
from app.grammar_checker import GrammarChecker
from app.structured_outputs import constrain_params, structured_output_spec
from app.tool_calls.request import tool_plan

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("fields", "spec", "param"),
    [
        ({"response_format": {"type": "text"}}, None, None),
        (
            {"response_format": {"type": "json_object"}},
            StructuredOutputSpec("json", JSON_OBJECT_SCHEMA),
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputSpec("json", json.dumps(SCHEMA, separators=(",", ":"))),
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            StructuredOutputSpec("json", json.dumps(SCHEMA, separators=(",", ":")), strict=False),
            "response_format",
        ),
        (
            {"structured_outputs": {"regex": "[0-9]+"}},
            StructuredOutputSpec("regex", "[0-9]+"),
            "structured_outputs.regex",
        ),
        (
            {"structured_outputs": {"choice": ["é", "b"], "disable_fallback": True}},
            StructuredOutputSpec("choice", '["é", "b"]'),
            "structured_outputs.choice",
        ),
        (
            {"structured_outputs": {"json_object": True}},
            StructuredOutputSpec("json", JSON_OBJECT_SCHEMA),
            "structured_outputs.json_object",
        ),
        (
            {"guided_json": json.dumps(SCHEMA)},
            StructuredOutputSpec("json", json.dumps(SCHEMA, separators=(",", ":"))),
            "guided_json",
        ),
        (
            {"guided_grammar": 'root ::= "x"'},
            StructuredOutputSpec("grammar", 'root ::= "x"'),
            "guided_grammar",
        ),
    ],
)
def test_every_spelling_gives_one_spec(fields: dict[str, Any], spec: Any, param: Any) -> None:
    assert structured_output_spec(fields) == (None if spec is None else (spec, param))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_malformed_fields_are_refused_naming_them(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as refused:
        structured_output_spec(fields)
    assert refused.value.status == 400 and refused.value.param == param


class _Request:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _constrain(request: _Request, **kwargs: Any) -> SamplingParams:
    async def constrain() -> SamplingParams:
        # No tokenizer: the checker process validates specs without compiling them.
        checker = GrammarChecker(lambda: GrammarCheckerStart(None, 1024, ()), timeout_s=60)
        try:
            return await constrain_params(SamplingParams(), request, checker, **kwargs)
        finally:
            await checker.aclose()

    return anyio.run(constrain)


def test_tool_choice_brings_its_schema_and_parser_decoding() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    named = _constrain(
        _Request(), tools=tool_plan(tools, {"type": "function", "function": {"name": "f"}}, "none")
    )
    assert json.loads(named.structured_output.text) == SCHEMA
    auto = _constrain(_Request(), tools=tool_plan(tools, "auto", "hermes"))
    assert auto.structured_output is None and auto.skip_special_tokens is False
    with pytest.raises(APIError) as refused:
        _constrain(_Request(guided_regex="a"), tools=tool_plan(tools, "required", "none"))
    assert refused.value.param == "guided_regex"


def test_invalid_specs_are_found_before_the_engine() -> None:
    for fields, message in (
        ({"guided_json": {"type": "integer", "minimum": "x"}}, "JSON schema"),
        ({"guided_grammar": "start: missing_rule"}, "grammar"),
    ):
        with pytest.raises(APIError, match=message):
            _constrain(_Request(**fields))
    ok = _constrain(_Request(guided_regex="[a-z]{3}"))
    assert ok.structured_output == StructuredOutputSpec("regex", "[a-z]{3}")


def test_constraints_are_refused_under_tensor_parallelism_and_free_requests_are_not() -> None:
    with pytest.raises(APIError, match="tensor-parallel") as refused:
        _constrain(_Request(guided_regex="[a-z]{3}"), num_ranks=2)
    assert refused.value.param == "guided_regex"
    assert _constrain(_Request(), num_ranks=2).structured_output is None
