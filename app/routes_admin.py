"""Operational routes: /health, /version, /metrics, /tokenize, /detokenize, /tokenizer_info,
/reset_prefix_cache, /openapi.json."""

from __future__ import annotations

import functools
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.frontend.engine_client import EngineUnavailable
from actors.protocol.mailbox import ActorStopped
from app.chat_template import ChatTemplateError
from app.endpoints import api_endpoint
from app.errors import APIError, bad_request, context_length_error, model_not_found
from app.http_input import (
    check_api_key,
    parse_model,
    prepare_request,
    require_serving,
    server_state,
)
from app.large_body import release_gradually
from app.openapi import openapi_document
from app.prompts import encode_checked, require_tokenizer, template_kwargs
from app.schemas import REQUEST_TEMPLATE_REFUSED, DetokenizeRequest, TokenizeRequest
from app.server_state import ServerState
from app.tokenizer_export import tokenizer_info
from app.version import package_version

_HEALTH_RETRY_AFTER_S = 5


def admin_routes() -> list[Route]:
    return [
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", api_endpoint(_tokenize), methods=["POST"]),
        Route("/detokenize", api_endpoint(_detokenize), methods=["POST"]),
        Route("/tokenizer_info", api_endpoint(_tokenizer_info), methods=["GET"]),
        Route("/reset_prefix_cache", api_endpoint(_reset_prefix_cache), methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


async def health(request: Request) -> Response:
    """200 while serving; 503 while loading, draining, or when the engine is stalled (its
    process has not answered for --engine-stall-timeout) or dead."""
    state = server_state(request)
    if state.phase == "serving":
        return _json({"status": "ok"})
    return _json(
        {"status": state.phase}, status=503, headers={"Retry-After": str(_HEALTH_RETRY_AFTER_S)}
    )


async def version(request: Request) -> Response:
    state = server_state(request)
    info = state.engine_info
    return _json(
        {
            "version": package_version(),
            "runner": info.runner if info else None,
            "runner_reason": info.runner_reason if info else None,
            "runner_rule": info.runner_rule if info else None,
            "weights": info.weights if info else None,
            "kv_cache_dtype": info.kv_cache_dtype if info else None,
            "kv_offload_tiers": (info.kv_offload or None) if info else None,
            "api_server": state.client_index,
            "api_server_count": state.settings.api_server_count,
            "data_parallel_size": state.num_cores,
        }
    )


async def metrics(request: Request) -> Response:
    """Prometheus exposition (text 0.0.4, or OpenMetrics when the Accept header asks).
    Open like /health: scrapers carry no API key. The load gauges are read at scrape time,
    so the engine's step loop never pays for them."""
    state = server_state(request)
    if state.phase == "serving":
        try:
            for core, stats in enumerate(await state.cores.stats_by_core()):
                state.metrics.set_engine_load(stats, engine_index=core)
        except EngineUnavailable:  # a core is stopping: keep the last values
            pass
    admission = state.admission
    if admission is not None:
        try:
            state.metrics.set_unsent((await admission.stats()).num_unsent)
        except ActorStopped:
            pass
    body, content_type = state.metrics.render(request.headers.get("accept"))
    return Response(body, headers={"Content-Type": content_type})


@functools.cache
async def _tokenize(request: Request, request_id: str) -> Response:
    state = await _ready(request)
    return _json(await prepare_request(request, state, functools.partial(_tokenize_body, state)))


def _tokenize_body(state: ServerState, data: dict[str, Any]) -> dict[str, Any]:
    """What /tokenize answers; like vLLM it refuses input longer than the context."""
    req = parse_model(TokenizeRequest, data)
    _check_model(state, req.model)
    if req.chat_template is not None:
        raise bad_request(REQUEST_TEMPLATE_REFUSED, "chat_template")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
    if req.messages is not None:
        try:
            text = _render(state, req)
        finally:
            release_gradually(req.messages)  # only the text is needed from here on
        add_special = bool(req.add_special_tokens)
    else:
        text = req.prompt or ""
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
    tokens = encode_checked(
        require_tokenizer(state, "prompt"),
        text,
        add_special,
        state.max_model_len,
        state.max_model_len,
    )
    if len(tokens) > state.max_model_len:
        raise context_length_error(len(tokens), state.max_model_len)
    body: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": state.max_model_len,
        "tokens": tokens,
        "token_strs": None,
    }
    if req.return_token_strs:
        body["token_strs"] = [
            require_tokenizer(state, "return_token_strs").id_to_token(t) for t in tokens
        ]
    return body


def _render(state: ServerState, req: TokenizeRequest) -> str:
    messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
    try:
        text: str = require_tokenizer(state, "messages").apply_chat_template(
            messages,
            add_generation_prompt=bool(req.add_generation_prompt),
            **template_kwargs(req.chat_template_kwargs),
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    finally:
        release_gradually(messages)
    return text


async def _detokenize(request: Request, request_id: str) -> Response:
    state = await _ready(request)
    return _json(await prepare_request(request, state, functools.partial(_detokenize_body, state)))


def _detokenize_body(state: ServerState, data: dict[str, Any]) -> dict[str, Any]:
    # More tokens than the context holds are no sequence of this model; the cap (checked
    # before the ids are validated one by one) also keeps a small request from asking for
    # a response many times its size.
    tokens = data.get("tokens")
    if isinstance(tokens, list) and len(tokens) > state.max_model_len:
        raise bad_request(
            f"at most {state.max_model_len} tokens (the model's context length) "
            f"can be detokenized, got {len(tokens)}",
            "tokens",
        )
    req = parse_model(DetokenizeRequest, data)
    _check_model(state, req.model)
    if req.tokens and max(req.tokens) >= state.vocab_size:
        bad = next(t for t in req.tokens if t >= state.vocab_size)
        raise bad_request(
            f"token id {bad} is outside the vocabulary [0, {state.vocab_size})", "tokens"
        )
    return {"prompt": require_tokenizer(state, "tokens").decode(req.tokens)}


async def _tokenizer_info(request: Request, request_id: str) -> Response:
    """tokenizer_config.json as vLLM serves it (lm-eval's remote tokenizer reads it)."""
    state = await _ready(request)
    if state.tokenizer is None:
        raise APIError(404, "This model is served without a tokenizer")
    return _json(tokenizer_info(state.tokenizer, state.max_model_len))


async def _reset_prefix_cache(request: Request, request_id: str) -> Response:
    """vLLM's admin route: drop the cached KV blocks no request holds (blocks in use stay
    cached). Behind the API key, as it changes what later requests cost."""
    state = await _ready(request)
    try:
        reset = await state.reset_prefix_cache()
    except EngineUnavailable:
        raise APIError(503, "The engine did not reset its prefix cache; retry shortly") from None
    return _json(
        {
            "status": "ok",
            "num_dropped_blocks": reset.num_dropped_blocks,
            "num_kept_blocks": reset.num_kept_blocks,
            "num_dropped_offloaded_blocks": reset.num_dropped_offloaded_blocks,
        }
    )


async def _ready(request: Request) -> ServerState:
    state = server_state(request)
    check_api_key(request, state)
    require_serving(state)
    return state


def _check_model(state: ServerState, model: str | None) -> None:
    if state.resolve_model(model) is None:
        raise model_not_found(str(model))


async def openapi(request: Request) -> Response:
    api_key_required = bool(server_state(request).settings.api_key)
    return Response(openapi_document(api_key_required), media_type="application/json")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )
