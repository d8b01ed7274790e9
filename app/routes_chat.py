"""POST /v1/chat/completions: a conversation (or a harmony prompt for gpt-oss models)
rendered to one prompt, its tool plan and constraints, answered streamed or whole.
Separate from text completions because its prompt, tools and response shape are its own."""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors.protocol.structured_output import ReasoningLead
from app import prompt_logprobs
from app.endpoints import CLIENT_CLOSED_STATUS
from app.errors import APIError
from app.harmony.request import (
    harmony_format,
    harmony_output_factory,
    harmony_params,
    harmony_prompt_ids,
    harmony_tool_plan,
)
from app.http_input import parse_model, prepare_request
from app.large_body import release_gradually
from app.prompts import (
    ChatPrompt,
    Prompt,
    chat_prompt,
    engine_requests,
    sampling_params,
    truncate_and_check,
)
from app.reasoning.output import reasoning_output_factory
from app.reasoning.parsers import THINK_CLOSE, THINK_OPEN, constraint_lead
from app.request_telemetry import RequestTelemetry
from app.responses import ChoiceState, ResponseMeta, chat_response
from app.route_answers import collect, continuous_usage, json_response, stream_response
from app.route_checks import admit, array_caps, check_request, check_size, checked_state
from app.schemas import ChatCompletionRequest
from app.server_state import ServerState
from app.sse_chat_chunks import ChatChunkFormatter
from app.structured_outputs import constrain_params
from app.tool_calls.request import ToolPlan, resolve_parser, tool_plan


def _constraint_lead(state: ServerState, prompt: str | None) -> ReasoningLead:
    tokenizer = state.tokenizer
    has_think_tokens = tokenizer is not None and all(
        tokenizer.is_added_token(tag) for tag in (THINK_OPEN, THINK_CLOSE)
    )
    return constraint_lead(state.settings.reasoning_parser, prompt, has_think_tokens)


async def chat_completions(request: Request, request_id: str, call: RequestTelemetry) -> Response:
    state = await checked_state(request)
    req, model, chat, tools = await prepare_request(
        request,
        state,
        functools.partial(_prepare_chat, state, request_id, call),
        array_caps(state),
    )
    prompt = truncate_and_check(chat.prompt, req.truncate_prompt_tokens, state.max_model_len)
    harmony = harmony_format(state.tokenizer)
    params = sampling_params(state, req, [len(prompt.token_ids)])
    num_ranks = state.settings.engine.num_ranks
    if harmony is None:
        lead = _constraint_lead(state, chat.prompt.text)
        params = await constrain_params(
            params, req, state.grammar_checker, tools, num_ranks, reasoning=lead
        )
    else:
        params = await harmony_params(harmony, params, req, tools, state.grammar_checker, num_ranks)
    prompt_logprobs.check_num_entries(params, [len(prompt.token_ids)], 1, "prompt_logprobs")
    new_tool_output = tools.output_factory()
    new_harmony_output = None if harmony is None else harmony_output_factory(harmony, req, tools)
    new_reasoning_output = None
    if harmony is None:  # harmony has its own reasoning channel
        new_reasoning_output = reasoning_output_factory(
            state.settings.reasoning_parser, req, chat.prompt.text, new_tool_output, params
        )
    meta = ResponseMeta(f"chatcmpl-{req.request_id or request_id}", int(time.time()), model)
    call.set_request(model, params, stream=bool(req.stream), response_id=meta.response_id)
    choices = [ChoiceState(index=i) for i in range(params.n)]
    group = await admit(
        state,
        engine_requests(uuid.uuid4().hex, [prompt], params, state, req, call.arrival_time),
        params,
    )
    prompt_ids = prompt.token_ids if req.return_token_ids else None
    num_prompt_tokens = len(prompt.token_ids)
    if req.stream:
        formatter = ChatChunkFormatter(
            meta,
            [num_prompt_tokens],
            choices,
            continuous_usage(req),
            role=chat.role,
            echo_prefix=chat.echo_prefix,
            tool_calls=new_tool_output,
            harmony=new_harmony_output,
            reasoning=new_reasoning_output,
        )
        return stream_response(group, formatter, req, state, request_id, call)
    if not await collect(request, group, choices, request_id, call, [num_prompt_tokens]):
        return Response(status_code=CLIENT_CLOSED_STATUS)
    body = chat_response(
        meta,
        choices,
        num_prompt_tokens,
        role=chat.role,
        echo_prefix=chat.echo_prefix,
        prompt_token_ids=prompt_ids,
        tool_calls=new_tool_output,
        harmony=new_harmony_output,
        reasoning=new_reasoning_output,
    )
    prompt_logprobs.add_to_chat(body, choices)
    return json_response(body)


def _prepare_chat(
    state: ServerState, request_id: str, call: RequestTelemetry, data: dict[str, Any]
) -> tuple[ChatCompletionRequest, str, ChatPrompt, ToolPlan]:
    check_size(state, data, completions=False)
    req = parse_model(ChatCompletionRequest, data)
    model = check_request(state, req, request_id, call)
    harmony = harmony_format(state.tokenizer)
    if harmony is not None:
        tools = harmony_tool_plan(req)
        prompt_ids = tuple(harmony_prompt_ids(harmony, req, tools))
        return req, model, ChatPrompt(Prompt(prompt_ids, None), "assistant", ""), tools
    tools = tool_plan(
        req.tools,
        req.tool_choice,
        resolve_parser(
            state.settings.tool_call_parser, getattr(state.tokenizer, "chat_template", None)
        ),
    )
    try:
        return req, model, chat_prompt(state, req, tools.template_tools), tools
    except APIError:
        release_gradually(req.messages)  # a refused conversation may be huge
        raise
