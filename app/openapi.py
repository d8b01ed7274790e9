"""The `/openapi.json` document: request schemas from the pydantic models, response schemas
written out here, per-route status codes, and the bearer scheme when an API key is set.

The response schemas describe what the routes really send (fuzzing checks every response
against them), so a change to a response body must change its schema here too.
"""

from __future__ import annotations

import functools
from typing import Any

import orjson

from app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from app.version import package_version

_REQUEST_MODELS = {
    "ChatCompletionRequest": ChatCompletionRequest,
    "CompletionRequest": CompletionRequest,
    "TokenizeRequest": TokenizeRequest,
    "DetokenizeRequest": DetokenizeRequest,
}
_INT = {"type": "integer"}
_COUNT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": _STR, "event": _STR, "id": _STR, "retry": {"type": "integer"}},
}
"""OpenAPI before 3.2 describes each server-sent event with the media type's schema."""


def _obj(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_CHOICE_END = {
    "finish_reason": {"enum": ["stop", "length", "abort"]},
    "stop_reason": {"type": ["string", "integer", "null"]},
    "token_ids": {"type": "array", "items": _COUNT},
}
RESPONSE_SCHEMAS: dict[str, Any] = {
    "ErrorResponse": _obj(
        ["error"],
        error=_obj(
            ["message", "type", "param", "code"],
            message=_STR,
            type=_STR,
            param={"type": ["string", "null"]},
            code=_INT,
        ),
    ),
    "Usage": _obj(
        ["prompt_tokens", "completion_tokens", "total_tokens"],
        prompt_tokens=_COUNT,
        completion_tokens=_COUNT,
        total_tokens=_COUNT,
    ),
    "ChatCompletion": _obj(
        ["id", "object", "created", "model", "choices", "usage"],
        id=_STR,
        object={"const": "chat.completion"},
        created=_INT,
        model=_STR,
        usage=_ref("Usage"),
        choices={
            "type": "array",
            "minItems": 1,
            "items": _obj(
                ["index", "message", "finish_reason"],
                index=_COUNT,
                message=_obj(["role", "content"], role=_STR, content={"type": ["string", "null"]}),
                logprobs={"type": ["object", "null"]},
                **_CHOICE_END,
            ),
        },
    ),
    "Completion": _obj(
        ["id", "object", "created", "model", "choices", "usage"],
        id=_STR,
        object={"const": "text_completion"},
        created=_INT,
        model=_STR,
        usage=_ref("Usage"),
        choices={
            "type": "array",
            "minItems": 1,
            "items": _obj(
                ["index", "text", "finish_reason"],
                index=_COUNT,
                text=_STR,
                logprobs={"type": ["object", "null"]},
                **_CHOICE_END,
            ),
        },
    ),
    "Model": _obj(
        ["id", "object", "created", "owned_by"],
        id=_STR,
        object={"const": "model"},
        created=_INT,
        owned_by=_STR,
        root=_STR,
        max_model_len=_COUNT,
    ),
    "ModelList": _obj(
        ["object", "data"], object={"const": "list"}, data={"type": "array", "items": _ref("Model")}
    ),
    "TokenizeResponse": _obj(
        ["count", "max_model_len", "tokens"],
        count=_COUNT,
        max_model_len=_COUNT,
        tokens={"type": "array", "items": _COUNT},
        token_strs={"type": ["array", "null"], "items": _STR},
    ),
    "DetokenizeResponse": _obj(["prompt"], prompt=_STR),
    "Health": _obj(
        ["status"], status={"enum": ["ok", "loading", "draining", "stalled", "stopped", "dead"]}
    ),
    "Version": _obj(
        ["version", "runner"],
        version=_STR,
        runner={"type": ["string", "null"]},
        runner_reason={"type": ["string", "null"]},
        runner_rule={"type": ["string", "null"]},
        weights={"type": ["string", "null"]},
        kv_cache_dtype={"type": ["string", "null"]},
    ),
}
_ERROR_DESCRIPTIONS = {
    400: "Invalid request",
    401: "Missing or invalid API key",
    404: "Unknown model",
    408: "The request body did not arrive in time",
    413: "Request body too large",
    415: "Unsupported Content-Type",
    429: "Overloaded: retry after Retry-After seconds",
    500: "The engine failed this request (the message names the request id)",
    503: "Loading, draining, or the engine is stalled or dead: retry after Retry-After seconds",
}
_BODY_ERRORS = (400, 401, 404, 408, 413, 415, 503)


def openapi_document(api_key_required: bool) -> bytes:
    return _document(api_key_required)


@functools.cache
def _document(api_key_required: bool) -> bytes:
    schemas: dict[str, Any] = dict(RESPONSE_SCHEMAS)
    for name, model in _REQUEST_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
    model_id = [{"name": "model_id", "in": "path", "required": True, "schema": _STR}]
    paths = {
        "/v1/chat/completions": _post(
            "Create a chat completion",
            "ChatCompletionRequest",
            _generation_ok("ChatCompletion"),
            (*_BODY_ERRORS, 429, 500),
        ),
        "/v1/completions": _post(
            "Create a text completion",
            "CompletionRequest",
            _generation_ok("Completion"),
            (*_BODY_ERRORS, 429, 500),
        ),
        "/tokenize": _post(
            "Tokenize a prompt or a conversation",
            "TokenizeRequest",
            _json_ok("TokenizeResponse"),
            _BODY_ERRORS,
        ),
        "/detokenize": _post(
            "Turn token ids back into text",
            "DetokenizeRequest",
            _json_ok("DetokenizeResponse"),
            _BODY_ERRORS,
        ),
        "/v1/models": _get("List the served model", _json_ok("ModelList"), (401, 503)),
        "/v1/models/{model_id}": _get(
            "Describe one served model", _json_ok("Model"), (401, 404, 503), parameters=model_id
        ),
        "/health": _get(
            "200 when serving; 503 while loading, draining or dead",
            _json_ok("Health"),
            open_route=True,
            extra={"503": {"description": "Not serving", "content": _json_content("Health")}},
        ),
        "/version": _get(
            "Version, active model runner and why it was chosen",
            _json_ok("Version"),
            open_route=True,
        ),
        "/metrics": _get(
            "Prometheus metrics (vLLM's names under vllm:, tandem's under tandem:)",
            {
                "description": "Prometheus text exposition",
                "content": {
                    "text/plain": {"schema": _STR},
                    "application/openmetrics-text": {"schema": _STR},
                },
            },
            open_route=True,
        ),
    }
    components: dict[str, Any] = {"schemas": schemas}
    if api_key_required:
        components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
        for operations in paths.values():
            for operation in operations.values():
                if not operation.pop("x-open", False):
                    operation["security"] = [{"bearerAuth": []}]
    else:
        for operations in paths.values():
            for operation in operations.values():
                operation.pop("x-open", None)
                operation["responses"].pop("401", None)
    document = {
        "openapi": "3.1.0",
        "info": {"title": "tandem", "version": package_version()},
        "paths": paths,
        "components": components,
    }
    return orjson.dumps(document)


def _json_content(schema: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(schema)}}


def _json_ok(schema: str) -> dict[str, Any]:
    return {"description": "OK", "content": _json_content(schema)}


def _generation_ok(schema: str) -> dict[str, Any]:
    return {
        "description": "The completion; with `stream: true` server-sent events "
        "(`data: {chunk}` lines, then `data: [DONE]`)",
        "content": {**_json_content(schema), "text/event-stream": {"schema": _SSE_EVENT}},
    }


def _errors(statuses: tuple[int, ...]) -> dict[str, Any]:
    return {
        str(status): {
            "description": _ERROR_DESCRIPTIONS[status],
            "content": _json_content("ErrorResponse"),
        }
        for status in statuses
    }


def _post(
    summary: str, request_schema: str, ok: dict[str, Any], errors: tuple[int, ...]
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json_content(request_schema)},
            "responses": {"200": ok, **_errors(errors)},
        }
    }


def _get(
    summary: str,
    ok: dict[str, Any],
    errors: tuple[int, ...] = (),
    *,
    parameters: list[dict[str, Any]] | None = None,
    open_route: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": ok, **_errors(errors), **(extra or {})},
    }
    if parameters:
        operation["parameters"] = parameters
    if open_route:
        operation["x-open"] = True
    return {"get": operation}
