"""A chat request's `tools` and `tool_choice` -> what the server does about them.

    none      tools are still shown to the template (as vLLM does); output is plain content
    auto      the template shows the tools; the model's tool-call format is parsed out
              (needs a parser: --tool-call-parser, or one derived from the chat template)
    required  output must be a JSON array of calls: enforced by a JSON-schema grammar
    named     output must be that function's arguments: enforced by its parameters' schema

`tools: []` is the same as no tools. Every refusal is a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from actors.protocol.structured_output import StructuredOutputSpec
from app.bounded_text import spec_size_problem
from app.errors import bad_request
from app.tool_calls.output import ToolCallOutput
from app.tool_calls.parsers import (
    PARSERS,
    JsonArrayParser,
    NamedFunctionParser,
    ToolCallParser,
    parser_for_template,
)
from app.tool_calls.schema import named_tool_schema, required_tools_schema

log = structlog.get_logger("tandem.server")

MAX_LISTED_NAMES = 20
"""An error that lists the request's tools names this many at most."""
MAX_SHOWN_CHARS = 80


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]
    """The tools as the chat template receives them (OpenAI's shape)."""
    mode: str
    """'none', 'auto', 'required' or 'named'."""
    parser: Callable[[], ToolCallParser] | None
    """Makes one choice's parser; None: the output is plain content."""
    structured_output: StructuredOutputSpec | None
    """The grammar that enforces 'required' and 'named'."""
    needs_special_tokens: bool = False
    forced_name: str | None = None
    """The function a named tool_choice forces."""

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return list(self.tools) if self.tools else None

    def output_factory(self) -> Callable[[], ToolCallOutput] | None:
        """Makes one choice's tool-call reader; None when the output is plain content."""
        parser = self.parser
        if parser is None:
            return None
        return lambda: ToolCallOutput(parser())


NO_TOOLS = ToolPlan((), "none", None, None)


def tool_plan(tools: Any, tool_choice: Any, parser_name: str) -> ToolPlan:
    """`parser_name`: the server's resolved --tool-call-parser ('hermes', 'llama3_json' or
    'none')."""
    checked = check_tools(tools)
    if not checked:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools: this request has none", "tool_choice")
        return NO_TOOLS
    mode, name = check_tool_choice(tool_choice, checked)
    if mode == "none":
        return ToolPlan(checked, mode, None, None)
    if mode == "auto":
        factory = PARSERS.get(parser_name)
        if factory is None:
            choice = "tool_choice 'auto'" if tool_choice else "tools without tool_choice (auto)"
            raise bad_request(
                f"{choice} needs a tool-call parser, and this model's chat template shows no "
                "tool-call format; start the server with --tool-call-parser hermes or "
                "llama3_json, or use tool_choice 'required' or a named function",
                "tool_choice",
            )
        return ToolPlan(
            checked,
            mode,
            factory,
            None,
            needs_special_tokens=bool(getattr(factory, "needs_special_tokens", False)),
        )
    if mode == "required":
        spec = _schema_spec(required_tools_schema(checked), mode)
        return ToolPlan(checked, mode, JsonArrayParser, spec)
    spec = _schema_spec(named_tool_schema(checked, name), f"{name!r}")
    return ToolPlan(checked, mode, lambda: NamedFunctionParser(name), spec, forced_name=name)


def _schema_spec(schema: dict[str, Any], choice: str) -> StructuredOutputSpec:
    """The grammar spec of a tool_choice; a 400 when the tools' parameter schemas make it
    too deep to write or too large to compile (app/bounded_text.py)."""
    try:
        text = json.dumps(schema)
    except RecursionError:
        raise bad_request(
            f"tool_choice {choice}: the tools' parameter schemas nest too deeply", "tools"
        ) from None
    problem = spec_size_problem(text)
    if problem is not None:
        raise bad_request(
            f"tool_choice {choice}: the schema its tools make {problem}", "tool_choice"
        )
    return StructuredOutputSpec("json", text)


def _shown(value: Any) -> str:
    text = repr(value[: MAX_SHOWN_CHARS + 1] if isinstance(value, str) else value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "..."


def _listed(names: list[str]) -> str:
    """The first MAX_LISTED_NAMES names (a request may carry thousands)."""
    listed = ", ".join(_shown(n)[1:-1] for n in names[:MAX_LISTED_NAMES])
    more = len(names) - MAX_LISTED_NAMES
    return listed if more <= 0 else f"{listed} and {more} more"


def resolve_parser(setting: str, chat_template: str | None) -> str:
    """--tool-call-parser, with 'auto' read from the chat template."""
    return parser_for_template(chat_template) if setting == "auto" else setting


def log_tool_call_parser(setting: str, tokenizer: Any) -> None:
    """Say at startup how tool calls are read out of the model's text under tool_choice
    'auto', and where that choice came from."""
    if tokenizer is None:
        return  # token ids in and out: no chat
    if getattr(tokenizer, "harmony", None) is not None:
        log.info("tool_call_parser", parser="harmony", source="gpt-oss chat format")
        return
    parser = resolve_parser(setting, getattr(tokenizer, "chat_template", None))
    source = "chat template" if setting == "auto" else "--tool-call-parser"
    refusal = {}
    if parser == "none" and setting == "auto":
        refusal["note"] = (
            "the chat template shows no tool-call format that a parser here reads: "
            "tool_choice 'auto' gets a 400 unless --tool-call-parser is set"
        )
    log.info("tool_call_parser", parser=parser, source=source, **refusal)


def check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """The request's function tools in OpenAI's shape; a 400 naming the bad one."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools")
    checked = []
    names: set[str] = set()
    for index, tool in enumerate(tools):
        param = f"tools.{index}"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise bad_request(f"{param}: only tools of type 'function' are supported", param)
        function = tool.get("function")
        if (
            not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise bad_request(f"{param}.function needs a non-empty 'name'", f"{param}.function")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise bad_request(
                f"{param}.function.parameters must be a JSON schema object",
                f"{param}.function.parameters",
            )
        if function["name"] in names:
            raise bad_request(f"{param}: duplicate function name {function['name']!r}", param)
        names.add(function["name"])
        checked.append({"type": "function", "function": dict(function)})
    return tuple(checked)


def check_tool_choice(choice: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str]:
    """(mode, function name of a named choice); a 400 for a choice the tools cannot meet."""
    if choice is None:
        return "auto", ""
    if choice in ("none", "auto", "required"):
        return choice, ""
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        known = [t["function"]["name"] for t in tools]
        if name not in known:
            raise bad_request(
                f"tool_choice names function {_shown(name)}, which is not in tools "
                f"({_listed(known)})",
                "tool_choice",
            )
        return "named", str(name)
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )
