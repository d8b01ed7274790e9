"""Everything a route checks before it looks at the request's meaning: the API key, the
server's phase, the body's size, that it is a JSON object, and that it fits the schema."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from app.errors import APIError, bad_request, validation_error
from app.server_state import ServerState

ModelT = TypeVar("ModelT", bound=BaseModel)
_LOADING_RETRY_AFTER_S = 5
OFF_LOOP_JSON_BYTES = 1 << 20
"""Bodies larger than this are parsed in a worker thread."""
_FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tandem
    return state


def check_api_key(request: Request, state: ServerState) -> None:
    """Bearer token, compared in constant time."""
    expected = state.settings.api_key
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not api_key_matches(token.strip(), expected):
        raise APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'")


def api_key_matches(token: str, expected: str) -> bool:
    """Constant-time comparison that also hides the key's length: both sides are hashed
    to equal-length digests first. `token` is a header value as Starlette decodes it
    (latin-1), so encoding it back gives the bytes the client sent, and a UTF-8 key works."""
    sent = hashlib.sha256(token.encode("latin-1")).digest()
    wanted = hashlib.sha256(expected.encode("utf-8")).digest()
    return hmac.compare_digest(sent, wanted)


def require_serving(state: ServerState) -> None:
    """503 + Retry-After unless the engine is up and the server is not draining."""
    if state.phase == "serving" and state.admission is not None:
        return
    retry = state.settings.retry_after_s
    if state.phase == "loading":
        raise APIError(503, "The model is still loading; retry shortly",
                       retry_after_s=_LOADING_RETRY_AFTER_S)
    if state.phase == "draining":
        raise APIError(503, "The server is shutting down; retry on another replica",
                       retry_after_s=retry)
    raise APIError(503, "The engine is not running", retry_after_s=retry)


async def read_json_object(request: Request, max_bytes: int,
                           timeout_s: float = math.inf) -> dict[str, Any]:
    """The body as a JSON object: 415 for form bodies, 413 beyond `max_bytes`, 408 when it
    has not fully arrived `timeout_s` after the handler started reading (a client that
    sends headers and then stalls holds nothing for longer), 400 when it is not an object."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in _FORM_TYPES:
        raise APIError(415, f"Unsupported Content-Type {content_type!r}; send application/json")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    with anyio.move_on_after(timeout_s) as reading:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    if reading.cancelled_caught:
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} seconds")
    body = b"".join(chunks)
    if not body.strip():
        raise bad_request("The request body is empty; send a JSON object")
    if len(body) > OFF_LOOP_JSON_BYTES:
        data = await anyio.to_thread.run_sync(_parse_json, body)
    else:
        data = _parse_json(body)
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {_json_kind(data)}")
    return data


async def read_json_body(request: Request, state: ServerState) -> dict[str, Any]:
    """`read_json_object` under the server's body size and time limits."""
    settings = state.settings
    return await read_json_object(request, settings.max_request_body_bytes,
                                  settings.request_body_timeout_s)


def _parse_json(body: bytes) -> Any:
    # The standard parser, not orjson: orjson turns integers beyond 64 bits into floats,
    # and then the schema could not say that e.g. a seed is out of range.
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_model(model: type[ModelT], data: dict[str, Any]) -> ModelT:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of "
                         f"{max_bytes} bytes")


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return "a number"
