"""The JSON schemas that make `tool_choice` "required" and named choices hold: the engine
applies them as grammars, so the output parses into calls of the given tools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return dict(parameters) if parameters else dict(ANY_OBJECT)


def required_tools_schema(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """At least one call, each `{"name": <one tool's name>, "parameters": <its arguments>}`
    (the shape app/tool_calls/parsers.JsonArrayParser reads)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }


def named_tool_schema(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The named function's parameters: the output is its arguments object."""
    tool = next(t for t in tools if t["function"]["name"] == name)
    return _parameters(tool)
