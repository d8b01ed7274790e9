"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import functools
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import orjson
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from actors.frontend.admission import AdmissionRefused, RequestLimitError
from actors.frontend.admitted_group import AdmittedGroup
from actors.protocol.messages import EngineRequest
from actors.protocol.sampling_params import SamplingParams
from app import prompt_logprobs
from app.errors import (
    APIError,
    bad_request,
    error_response,
    internal_error,
    model_not_found,
    request_failed_error,
)
from app.harmony.request import (
    harmony_format,
    harmony_output_factory,
    harmony_params,
    harmony_prompt_ids,
    harmony_tool_plan,
)
from app.http_input import (
    check_api_key,
    parse_model,
    prepare_request,
    require_serving,
    server_state,
)
from app.large_body import release_gradually
from app.prompts import (
    ChatPrompt,
    Prompt,
    chat_prompt,
    completion_prompts,
    engine_requests,
    require_tokenizer,
    sampling_params,
    truncate_and_check,
)
from app.request_limits import (
    MAX_VLLM_XARGS,
    check_generation_size,
    check_priority,
    drop_truncated_tokens,
)
from app.request_telemetry import RequestTelemetry
from app.responses import ChoiceState, ResponseMeta, chat_response, completion_response
from app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    unsupported_field,
)
from app.server_state import ServerState
from app.sse import (
    ChatChunkFormatter,
    ChunkFormatter,
    CompletionChunkFormatter,
    EventStreamResponse,
    StreamOptions,
)
from app.structured_outputs import constrain_params
from app.tool_calls.request import ToolPlan, resolve_parser, tool_plan
from telemetry.logging import bind_request

log = structlog.get_logger("tandem.server")

Handler = Callable[[Request, str], Awaitable[Response]]
GenerationHandler = Callable[[Request, str, RequestTelemetry], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
CLIENT_CLOSED_STATUS = 499
"""Logged for a request whose client left before its answer; nobody receives it."""


def openai_routes() -> list[Route]:
    return [
        Route(
            "/v1/chat/completions", generation_endpoint("chat", _chat_completions), methods=["POST"]
        ),
        Route(
            "/v1/completions",
            generation_endpoint("text_completion", _completions),
            methods=["POST"],
        ),
        Route("/v1/models", api_endpoint(_list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", api_endpoint(_retrieve_model), methods=["GET"]),
    ]


def api_endpoint(handler: Handler) -> Endpoint:
    """Gives the handler a request id and turns every error into an OpenAI-shaped answer:
    APIError as-is, a client that hung up mid-body a 499 nobody receives (a disconnect,
    not a server error), anything else a logged 500 that shows no internals."""

    async def endpoint(request: Request) -> Response:
        request_id = client_request_id(request)
        return await _answer(request, request_id, lambda: handler(request, request_id))

    return endpoint


def generation_endpoint(operation: str, handler: GenerationHandler) -> Endpoint:
    """`api_endpoint` for a request the engine generates for: the handler also gets the
    request's telemetry, whose span starts at arrival (`operation`: 'chat' or
    'text_completion') and ends with the request however it ends."""

    async def endpoint(request: Request) -> Response:
        state = server_state(request)
        call = RequestTelemetry.start(state.tracing, state.metrics, operation, request.headers)
        request_id = client_request_id(request)
        return await _answer(request, request_id, lambda: handler(request, request_id, call), call)

    return endpoint


async def _answer(
    request: Request,
    request_id: str,
    work: Callable[[], Awaitable[Response]],
    call: RequestTelemetry | None = None,
) -> Response:
    headers = {"X-Request-Id": request_id}
    try:
        with bind_request(request_id, None if call is None else call.trace_id):
            response = await work()
    except APIError as exc:
        log.info(
            "request_refused",
            request_id=request_id,
            status=exc.status,
            param=exc.param,
            message=exc.message,
        )
        if call is not None:
            call.refused(exc, server_state(request).phase)
        return error_response(exc, headers)
    except ClientDisconnect:  # it hung up before its body had arrived: the client's doing
        log.info("client_disconnected", request_id=request_id, path=request.url.path)
        if call is not None:
            call.end((), (), disconnected=True)
        return Response(status_code=CLIENT_CLOSED_STATUS, headers=headers)
    except Exception as exc:
        log.exception("internal_error", request_id=request_id, path=request.url.path)
        if call is not None:
            call.failed(exc)
        return error_response(internal_error(request_id), headers)
    except BaseException as exc:  # cancelled: end the span before unwinding
        if call is not None:
            call.failed(exc)
        raise
    response.headers.setdefault("X-Request-Id", request_id)
    return response


def exception_handlers() -> dict[Any, Callable[..., Any]]:
    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {
            404: f"No route for {request.url.path}",
            405: f"Method {request.method} is not allowed on {request.url.path}",
        }
        return error_response(
            APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)))
        )

    return {HTTPException: http_error}


def client_request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _CLIENT_REQUEST_ID.match(given) else uuid.uuid4().hex


# ---- chat ----------------------------------------------------------------------------


async def _chat_completions(request: Request, request_id: str, call: RequestTelemetry) -> Response:
    state = await _checked_state(request)
    req, model, chat, tools = await prepare_request(
        request,
        state,
        functools.partial(_prepare_chat, state, request_id, call),
        _array_caps(state),
    )
    prompt = truncate_and_check(chat.prompt, req.truncate_prompt_tokens, state.max_model_len)
    harmony = harmony_format(state.tokenizer)
    params = sampling_params(state, req, [len(prompt.token_ids)])
    tp_size = state.settings.engine.tensor_parallel_size
    if harmony is None:
        params = await constrain_params(params, req, state.grammar_checker, tools, tp_size)
    else:
        params = await harmony_params(harmony, params, req, tools, state.grammar_checker, tp_size)
    prompt_logprobs.check_num_entries(params, [len(prompt.token_ids)], 1, "prompt_logprobs")
    new_tool_output = tools.output_factory()
    new_harmony_output = None if harmony is None else harmony_output_factory(harmony, req, tools)
    meta = ResponseMeta(f"chatcmpl-{req.request_id or request_id}", int(time.time()), model)
    call.set_request(model, params, stream=bool(req.stream), response_id=meta.response_id)
    choices = [ChoiceState(index=i) for i in range(params.n)]
    group = await _admit(
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
            _continuous(req),
            role=chat.role,
            echo_prefix=chat.echo_prefix,
            tool_calls=new_tool_output,
            harmony=new_harmony_output,
        )
        return _stream(group, formatter, req, state, request_id, call)
    if not await _collect(request, group, choices, request_id, call, [num_prompt_tokens]):
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
    )
    prompt_logprobs.add_to_chat(body, choices)
    return _json(body)


def _prepare_chat(
    state: ServerState, request_id: str, call: RequestTelemetry, data: dict[str, Any]
) -> tuple[ChatCompletionRequest, str, ChatPrompt, ToolPlan]:
    _check_size(state, data, completions=False)
    req = parse_model(ChatCompletionRequest, data)
    model = _check_request(state, req, request_id, call)
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


# ---- completions ---------------------------------------------------------------------


async def _completions(request: Request, request_id: str, call: RequestTelemetry) -> Response:
    state = await _checked_state(request)
    req, model, prompts = await prepare_request(
        request,
        state,
        functools.partial(_prepare_completion, state, request_id, call),
        _array_caps(state),
    )
    prompt_lens = [len(p.token_ids) for p in prompts]
    params = await constrain_params(
        prompt_logprobs.with_prompt_logprobs(
            sampling_params(state, req, prompt_lens), bool(req.echo)
        ),
        req,
        state.grammar_checker,
        tensor_parallel_size=state.settings.engine.tensor_parallel_size,
    )
    prompt_logprobs.check_num_entries(
        params, prompt_lens, params.n, "prompt_logprobs" if req.prompt_logprobs else "logprobs"
    )
    meta = ResponseMeta(f"cmpl-{req.request_id or request_id}", int(time.time()), model)
    call.set_request(model, params, stream=bool(req.stream), response_id=meta.response_id)
    choices = [
        ChoiceState(index=p * params.n + s, prompt_index=p)
        for p in range(len(prompts))
        for s in range(params.n)
    ]
    echo_texts = echo_first_tokens = None
    if req.echo:
        echo_texts = [
            p.text
            if p.text is not None
            else require_tokenizer(state, "echo").decode(list(p.token_ids))
            for p in prompts
        ]
        if req.logprobs is not None:
            echo_first_tokens = [_first_token_text(state, p.token_ids) for p in prompts]
    group = await _admit(
        state,
        engine_requests(uuid.uuid4().hex, prompts, params, state, req, call.arrival_time),
        params,
    )
    if req.stream:
        formatter = CompletionChunkFormatter(
            meta,
            prompt_lens,
            choices,
            _continuous(req),
            echo_texts=echo_texts,
            echo_first_tokens=echo_first_tokens,
        )
        return _stream(group, formatter, req, state, request_id, call)
    if not await _collect(request, group, choices, request_id, call, prompt_lens):
        return Response(status_code=CLIENT_CLOSED_STATUS)
    prompt_ids = (
        [() if p.embeds is not None else p.token_ids for p in prompts]
        if req.return_token_ids
        else None
    )
    body = completion_response(
        meta, choices, prompt_lens, echo_texts=echo_texts, prompt_token_ids=prompt_ids
    )
    prompt_logprobs.add_to_completion(body, choices, echo_first_tokens)
    return _json(body)


def _prepare_completion(
    state: ServerState, request_id: str, call: RequestTelemetry, data: dict[str, Any]
) -> tuple[CompletionRequest, str, list[Prompt]]:
    _check_size(state, data, completions=True)
    req = parse_model(CompletionRequest, data)
    model = _check_request(state, req, request_id, call)
    return req, model, completion_prompts(state, req)


def _first_token_text(state: ServerState, token_ids: Sequence[int]) -> str:
    tokenizer = state.tokenizer
    return "" if tokenizer is None else tokenizer.decode([token_ids[0]], skip_special_tokens=False)


# ---- models --------------------------------------------------------------------------


async def _list_models(request: Request, request_id: str) -> Response:
    state = await _checked_state(request)
    return _json({"object": "list", "data": [_model_card(state, state.model_names[0])]})


async def _retrieve_model(request: Request, request_id: str) -> Response:
    state = await _checked_state(request)
    model_id = request.path_params["model_id"]
    if model_id not in state.model_names:
        raise model_not_found(model_id)
    return _json(_model_card(state, model_id))


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "tandem",
        "root": state.model_names[0],
        "parent": None,
        "max_model_len": state.max_model_len,
        "permission": [],
    }


# ---- shared steps --------------------------------------------------------------------


async def _checked_state(request: Request) -> ServerState:
    state = server_state(request)
    check_api_key(request, state)
    require_serving(state)
    return state


def _check_size(state: ServerState, data: dict[str, Any], completions: bool) -> None:
    assert state.admission is not None
    check_generation_size(
        data,
        state.admission.limits,
        max_model_len=state.max_model_len,
        vocab_size=state.vocab_size,
        completions=completions,
    )
    if completions:
        drop_truncated_tokens(data, state.max_model_len)


def _array_caps(state: ServerState) -> dict[str, int]:
    """Most items of what is refused while a large body is decoded: more prompts than the
    server holds at once, more stop strings, logit_bias or vllm_xargs entries than allowed."""
    assert state.admission is not None
    limits = state.admission.limits
    return {
        "prompt": limits.max_num_running + limits.max_queued_requests,
        "prompt_embeds": limits.max_num_running + limits.max_queued_requests,
        "stop": limits.max_stop_strings,
        "logit_bias": limits.max_logit_bias_entries,
        "vllm_xargs": MAX_VLLM_XARGS,
    }


def _check_request(
    state: ServerState, req: SamplingFields, request_id: str, call: RequestTelemetry
) -> str:
    """The served model name; refuses unknown models and unimplemented fields."""
    model = state.resolve_model(req.model)
    if model is None:
        raise model_not_found(str(req.model))
    call.set_request(model, stream=bool(req.stream))  # names the span should it fail early
    unsupported = unsupported_field(req)
    if unsupported is not None:
        raise bad_request(unsupported[1], unsupported[0])
    check_priority(req.priority, state.settings.priority_scheduling)
    if req.model_extra:
        log.warning(
            "request_fields_ignored", request_id=request_id, fields=sorted(req.model_extra)[:20]
        )
    return model


async def _admit(
    state: ServerState, requests: list[EngineRequest], params: SamplingParams
) -> AdmittedGroup:
    assert state.admission is not None
    try:
        return await state.admission.admit(requests, params)
    except RequestLimitError as exc:
        raise bad_request(str(exc), exc.param) from None
    except AdmissionRefused as exc:
        raise APIError(exc.status, exc.message, retry_after_s=exc.retry_after_s) from None


def _continuous(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


def _stream(
    group: AdmittedGroup,
    formatter: ChunkFormatter,
    req: SamplingFields,
    state: ServerState,
    request_id: str,
    call: RequestTelemetry,
) -> Response:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    options = StreamOptions(
        include_usage=include_usage, continuous_usage=_continuous(req), keep_alive=state.keep_alive
    )
    return EventStreamResponse(
        group, formatter, options, request_id, headers={"X-Request-Id": request_id}, telemetry=call
    )


async def _collect(
    request: Request,
    group: AdmittedGroup,
    choices: Sequence[ChoiceState],
    request_id: str,
    call: RequestTelemetry,
    prompt_lens: Sequence[int],
) -> bool:
    """Read every choice to its end, racing the client: False if it disconnected first (the
    engine requests are then aborted). Raises a 500 APIError if a choice failed. Ends the
    request's telemetry either way."""
    completed = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
            async with anyio.create_task_group() as readers:
                for index, choice in enumerate(choices):
                    readers.start_soon(_read_choice, group, index, choice)
            completed = True
            tg.cancel_scope.cancel()
    finally:
        group.close()
    if not completed:
        log.info("client_disconnected", request_id=request_id)
        call.end(choices, prompt_lens, disconnected=True)
        return False
    call.end(choices, prompt_lens)
    failed = [c for c in choices if c.finish_reason == "error"]
    if failed:
        log.error("request_failed", request_id=request_id, error=failed[0].error)
        retry_after_s = server_state(request).settings.retry_after_s
        raise request_failed_error(request_id, failed[0].error, failed[0].retryable, retry_after_s)
    return True


async def _read_choice(group: AdmittedGroup, index: int, choice: ChoiceState) -> None:
    while (delta := await group.get(index)) is not None:
        choice.add(delta)


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _json(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")
