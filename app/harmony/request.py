"""A chat request served in harmony: its prompt, its tools, its output constraint and how
its output is read.

    tool_choice  auto / none      tools shown (none: hidden), the model decides
                 required / named  tools shown; a grammar (app.harmony.constraints) makes
                                   the turn end in a call of one of them / of that one
    response_format, structured_outputs.json, guided_json (JSON schemas only)
                                   the final answer must match; with tool_choice auto the
                                   turn may end in a tool call instead

What harmony cannot honour is refused with a 400 naming the field, never ignored:
continuing a final message, a prompt without the assistant's turn, and regex, choice or
grammar constraints (they would have to bind the channel markup too).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutputSpec
from app.errors import bad_request
from app.grammar_checker import GrammarChecker
from app.harmony.constraints import FUNCTION_NAME, output_grammar
from app.harmony.model import HarmonyFormat
from app.harmony.output import HarmonyOutput
from app.harmony.render import HarmonyRequestError, render_prompt
from app.schemas import ChatCompletionRequest
from app.structured_outputs import (
    CONSTRAINT_FIELDS,
    check_structured_output,
    structured_output_spec,
)
from app.tokenizer import Tokenizer
from app.tool_calls.request import ToolPlan, check_tool_choice, check_tools

MODEL_NAME = "this model (gpt-oss, harmony format)"


def harmony_format(tokenizer: Tokenizer | None) -> HarmonyFormat | None:
    """The served model's harmony format, None when it is not gpt-oss."""
    return None if tokenizer is None else tokenizer.harmony


def harmony_tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """The tools shown to the model (all of them unless tool_choice is 'none') and the
    choice's mode; the grammar of 'required' and named choices comes with the params."""
    tools = check_tools(req.tools)
    if not tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools: this request has none", "tool_choice")
        return ToolPlan((), "none", None, None)
    mode, name = check_tool_choice(req.tool_choice, tools)
    if mode in ("required", "named"):
        _check_forceable_names(tools if mode == "required" else (), name)
    return ToolPlan(tools if mode != "none" else (), mode, None, None, forced_name=name or None)


def harmony_prompt_ids(
    harmony: HarmonyFormat, req: ChatCompletionRequest, tools: ToolPlan
) -> list[int]:
    """The prompt's token ids. Raises a 400 APIError for what harmony cannot render."""
    _refuse_unsupported(req)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    effort = req.reasoning_effort
    if effort is None and req.chat_template_kwargs:
        effort = req.chat_template_kwargs.get("reasoning_effort")
    try:
        return render_prompt(harmony.encoding, messages, tools.tools, effort)
    except HarmonyRequestError as exc:
        raise bad_request(str(exc), exc.param) from None


async def harmony_params(
    harmony: HarmonyFormat,
    params: SamplingParams,
    req: ChatCompletionRequest,
    tools: ToolPlan,
    checker: GrammarChecker,
    num_ranks: int = 1,
) -> SamplingParams:
    """`params` that end the turn at harmony's stop tokens, with the grammar of a forced
    tool choice or a JSON answer (checked by `checker` as the engine will compile it)."""
    stops = tuple(dict.fromkeys((*params.stop_token_ids, *harmony.stop_token_ids)))
    params = params.replace(stop_token_ids=stops)
    constraint = await _constraint(req, tools, checker)
    if constraint is None:
        return params
    if num_ranks > 1:
        raise bad_request(
            f"{constraint[1]}: structured outputs are not available with "
            "--tensor-parallel-size or --pipeline-parallel-size > 1",
            constraint[1],
        )
    return params.replace(structured_output=constraint[0])


def harmony_output_factory(
    harmony: HarmonyFormat, req: ChatCompletionRequest, tools: ToolPlan
) -> Callable[[], HarmonyOutput]:
    """Makes one choice's output reader."""
    include_reasoning = req.include_reasoning is not False
    named = tools.mode == "named"
    return lambda: HarmonyOutput(harmony, include_reasoning, named_choice=named)


async def _constraint(
    req: ChatCompletionRequest, tools: ToolPlan, checker: GrammarChecker
) -> tuple[StructuredOutputSpec, str] | None:
    """The grammar spec and the field it answers, or None when the output is free."""
    found = structured_output_spec({name: getattr(req, name, None) for name in CONSTRAINT_FIELDS})
    forced = tools.mode in ("required", "named")
    if found is not None:
        if forced:
            raise bad_request(
                f"tool_choice {tools.mode!r} constrains the output already; it "
                f"cannot be combined with {found[1]}",
                found[1],
            )
        if found[0].kind != "json":
            raise bad_request(
                f"{found[1]}: {MODEL_NAME} takes JSON-schema output constraints only "
                "(response_format, structured_outputs.json or guided_json)",
                found[1],
            )
        await check_structured_output(checker, *found)
    elif not forced:
        return None
    call_tools = [
        tool
        for tool in tools.tools
        if tools.mode in ("required", "auto") or tool["function"]["name"] == tools.forced_name
    ]
    await _check_tool_schemas(tools, call_tools, checker)
    answer = found[0] if found is not None else None
    grammar = output_grammar(
        call_tools,
        None if answer is None else json.loads(answer.text),
        answer_strict=True if answer is None else answer.strict,
        preambles=bool(tools.tools),
    )
    spec = StructuredOutputSpec("grammar", grammar)
    param = found[1] if found is not None else "tool_choice"
    await check_structured_output(checker, spec, param)
    return spec, param


async def _check_tool_schemas(
    tools: ToolPlan, call_tools: list[dict[str, Any]], checker: GrammarChecker
) -> None:
    """Each callable tool's parameters, checked as a JSON schema of their own so that a bad
    one is named (the grammar embeds them)."""
    positions = {tool["function"]["name"]: index for index, tool in enumerate(tools.tools)}
    for tool in call_tools:
        parameters = tool["function"].get("parameters")
        if parameters:
            param = f"tools.{positions[tool['function']['name']]}.function.parameters"
            spec = StructuredOutputSpec("json", json.dumps(parameters, ensure_ascii=False))
            await check_structured_output(checker, spec, param)


def _check_forceable_names(tools: tuple[dict[str, Any], ...], name: str) -> None:
    names = [name] if name else [t["function"]["name"] for t in tools]
    for forced in names:
        if not FUNCTION_NAME.fullmatch(forced):
            raise bad_request(
                f"tool_choice: function name {forced!r} cannot be forced for {MODEL_NAME}; "
                "names of letters, digits, '_' and '-' can",
                "tool_choice",
            )


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    if req.continue_final_message:
        raise bad_request(
            f"continue_final_message is not supported for {MODEL_NAME}",
            "continue_final_message",
        )
    if req.add_generation_prompt is False:
        raise bad_request(
            f"add_generation_prompt must be true for {MODEL_NAME}", "add_generation_prompt"
        )
