"""POST /v1/completions: one or more prompts (text, token ids or embeddings), each with
`n` choices, optionally echoed with their logprobs, answered streamed or whole. Separate
from chat because its prompts, echo and response shape are its own."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app import prompt_logprobs
from app.endpoints import CLIENT_CLOSED_STATUS
from app.http_input import parse_model, prepare_request
from app.prompts import (
    Prompt,
    completion_prompts,
    engine_requests,
    require_tokenizer,
    sampling_params,
)
from app.request_telemetry import RequestTelemetry
from app.responses import ChoiceState, ResponseMeta, completion_response
from app.route_answers import collect, continuous_usage, json_response, stream_response
from app.route_checks import admit, array_caps, check_request, check_size, checked_state
from app.schemas import CompletionRequest
from app.server_state import ServerState
from app.sse_completion_chunks import CompletionChunkFormatter
from app.structured_outputs import constrain_params


async def completions(request: Request, request_id: str, call: RequestTelemetry) -> Response:
    state = await checked_state(request)
    req, model, prompts = await prepare_request(
        request,
        state,
        functools.partial(_prepare_completion, state, request_id, call),
        array_caps(state),
    )
    prompt_lens = [len(p.token_ids) for p in prompts]
    params = await constrain_params(
        prompt_logprobs.with_prompt_logprobs(
            sampling_params(state, req, prompt_lens), bool(req.echo)
        ),
        req,
        state.grammar_checker,
        num_ranks=state.settings.engine.num_ranks,
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
    group = await admit(
        state,
        engine_requests(uuid.uuid4().hex, prompts, params, state, req, call.arrival_time),
        params,
    )
    prompt_ids = (
        [() if p.embeds is not None else p.token_ids for p in prompts]
        if req.return_token_ids
        else None
    )
    if req.stream:
        formatter = CompletionChunkFormatter(
            meta,
            prompt_lens,
            choices,
            continuous_usage(req),
            echo_texts=echo_texts,
            echo_first_tokens=echo_first_tokens,
            prompt_token_ids=prompt_ids,
        )
        return stream_response(group, formatter, req, state, request_id, call)
    if not await collect(request, group, choices, request_id, call, prompt_lens):
        return Response(status_code=CLIENT_CLOSED_STATUS)
    body = completion_response(
        meta, choices, prompt_lens, echo_texts=echo_texts, prompt_token_ids=prompt_ids
    )
    prompt_logprobs.add_to_completion(body, choices, echo_first_tokens)
    return json_response(body)


def _prepare_completion(
    state: ServerState, request_id: str, call: RequestTelemetry, data: dict[str, Any]
) -> tuple[CompletionRequest, str, list[Prompt]]:
    check_size(state, data, completions=True)
    req = parse_model(CompletionRequest, data)
    model = check_request(state, req, request_id, call)
    return req, model, completion_prompts(state, req)


def _first_token_text(state: ServerState, token_ids: Sequence[int]) -> str:
    tokenizer = state.tokenizer
    return "" if tokenizer is None else tokenizer.decode([token_ids[0]], skip_special_tokens=False)
