"""Everything a route checks before it looks at the request's meaning: the API key, the
server's phase, the body's size, that it is a JSON object, and that it fits the schema."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import re
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request

from app.errors import APIError, bad_request
from app.large_body import GC_PAUSE, SHORT_SWITCHES, decode_in_steps, release_unshared, validate
from app.server_state import ServerState

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")
_LOADING_RETRY_AFTER_S = 5
OFF_LOOP_BODY_BYTES = 8192
"""Requests with larger bodies are decoded, validated and turned into prompts in a worker
thread (the tokenizer gives the GIL back while it works; the chat template renders in
Python, which the event loop's thread interrupts within a short switch interval: see
app.large_body)."""
LARGE_BODY_BYTES = 1 << 20
"""Larger bodies are decoded in steps with the garbage collector paused (app.large_body)."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SCAN_BYTES = 1 << 20
"""The body is searched for surrogate escapes this much at a time (one search holds the
GIL; a body full of escapes takes a while)."""
_FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
_LARGE_BODY_LIMITERS: weakref.WeakKeyDictionary[Any, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)
"""One per event loop (a test process runs several servers, each on its own loop)."""


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
        raise APIError(
            503, "The model is still loading; retry shortly", retry_after_s=_LOADING_RETRY_AFTER_S
        )
    if state.phase == "draining":
        raise APIError(
            503, "The server is shutting down; retry on another replica", retry_after_s=retry
        )
    if state.phase == "stalled":
        raise APIError(503, "The engine has stopped answering; retry shortly", retry_after_s=retry)
    raise APIError(503, "The engine is not running", retry_after_s=retry)


async def read_body(request: Request, max_bytes: int, timeout_s: float = math.inf) -> bytes:
    """The request body: 415 for form bodies, 413 beyond `max_bytes`, 408 when it has not
    fully arrived `timeout_s` after the handler started reading (a client that sends
    headers and then stalls holds nothing for longer), 400 when empty."""
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
    return body


async def prepare_request(
    request: Request,
    state: ServerState,
    prepare: Callable[[dict[str, Any]], T],
    array_caps: Mapping[str, int] | None = None,
) -> T:
    """Read the body under the server's size and time limits, decode it as a JSON object and
    return `prepare(data)`, where `prepare` validates the request and builds what the route
    needs from it (prompts, token ids). For a body over OFF_LOOP_BODY_BYTES that all runs
    in a worker thread; for one over LARGE_BODY_BYTES as app.large_body describes, and one
    such body at a time; `array_caps` (top-level key -> most items) refuses too long arrays
    while decoding."""
    settings = state.settings
    body = await read_body(
        request, settings.max_request_body_bytes, settings.request_body_timeout_s
    )
    if len(body) <= OFF_LOOP_BODY_BYTES:
        return prepare(decode_json_object(body))
    # Large bodies one at a time: each busy thread is one more the event loop's thread
    # shares the GIL with.
    limiter = _large_body_limiter() if len(body) > LARGE_BODY_BYTES else None
    return await anyio.to_thread.run_sync(
        _prepare_off_loop, body, prepare, array_caps or {}, limiter=limiter
    )


def _large_body_limiter() -> anyio.CapacityLimiter:
    loop = asyncio.get_running_loop()
    limiter = _LARGE_BODY_LIMITERS.get(loop)
    if limiter is None:
        limiter = _LARGE_BODY_LIMITERS[loop] = anyio.CapacityLimiter(1)
    return limiter


def _prepare_off_loop(
    body: bytes, prepare: Callable[[dict[str, Any]], T], array_caps: Mapping[str, int]
) -> T:
    with SHORT_SWITCHES:
        if len(body) <= LARGE_BODY_BYTES:
            return prepare(decode_json_object(body))
        return _prepare_large(body, prepare, array_caps)


def _prepare_large(
    body: bytes, prepare: Callable[[dict[str, Any]], T], array_caps: Mapping[str, int]
) -> T:
    with GC_PAUSE:
        data: dict[str, Any] = {}
        try:
            data = decode_json_object(body, array_caps)
            return prepare(data)
        except APIError as exc:
            # Free what the failed step held (the frames of the traceback) now, while the
            # collector is off, rather than when the route answers the error.
            error = exc.with_traceback(None)
            error.__context__ = error.__cause__ = None
        finally:
            release_unshared(data)
    raise error


def decode_json_object(body: bytes, array_caps: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The body as a JSON object (400 when it is not one, or holds text that is not
    Unicode). With `array_caps` the top-level arrays are decoded item by item (see
    app.large_body). The standard parser, not orjson: orjson turns integers beyond 64 bits
    into floats, and then the schema could not say that e.g. a seed is out of range."""
    try:
        if array_caps is None:
            data = json.loads(body, parse_constant=_reject_constant)
        else:
            data = decode_in_steps(body, array_caps, _reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {_json_kind(data)}")
    # The parser accepts a lone UTF-16 surrogate ("\ud800", or its bytes); such a string is
    # not text: encoding it for the tokenizer, a log line or a response would fail.
    if _may_hold_surrogate(body) and _holds_surrogate(data):
        raise bad_request(
            "The request body holds a lone UTF-16 surrogate (such as \\ud800), which is not text"
        )
    return data


def _may_hold_surrogate(body: bytes) -> bool:
    """A surrogate escape, or the UTF-8-style bytes of a surrogate (whose lead byte is
    0xED), somewhere in the body: only then is the decoded body searched for one."""
    if b"\xed" in body:
        return True
    return any(
        _SURROGATE_ESCAPE.search(body, start, start + _SCAN_BYTES + 5)
        for start in range(0, len(body), _SCAN_BYTES)
    )


def _holds_surrogate(value: Any) -> bool:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_model(model: type[ModelT], data: dict[str, Any]) -> ModelT:
    """`data` validated as `model`; a 400 naming the first bad fields otherwise."""
    return validate(model, data)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {max_bytes} bytes")


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
