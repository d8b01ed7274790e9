"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Clients depend on the HTTP status and `error.message`; `code` repeats the status as vLLM
does. Messages are written by tandem itself: a response never carries a stack trace or a
filesystem path. Internal faults are logged with the request id and answered with a
generic 500 that names that id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import structlog
from pydantic import ValidationError
from starlette.responses import Response

log = structlog.get_logger("tandem.server")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_MAX_ERRORS_LISTED = 3
# Pydantic names a union member in an error location (`stop.str`, `prompt.list[int]`);
# the member is noise in `param`, which should name the request field.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|function-\w+|\w+\[.*\]|[A-Z]\w*)$")


class APIError(Exception):
    """An error answered to the client as-is. `retry_after_s` adds a Retry-After header."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.error_type = error_type or ERROR_TYPES.get(status, "APIError")

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, error_type=self.error_type)

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def error_body(
    status: int, message: str, *, param: str | None = None, error_type: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type or ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def error_response(error: APIError, extra_headers: Mapping[str, str] | None = None) -> Response:
    headers = {**error.headers(), **(extra_headers or {})}
    return Response(
        encode_json(error.body()),
        status_code=error.status,
        media_type="application/json",
        headers=headers,
    )


def encode_json(body: Any) -> bytes:
    """`body` as JSON. A message may quote what the client sent; should that hold a lone
    surrogate (not text, so not UTF-8), it is written as a JSON escape instead of failing."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        return json.dumps(body, ensure_ascii=True).encode("ascii")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def internal_error(request_id: str, reason: str | None = None) -> APIError:
    """A 500 for a request that failed; `reason`, the engine's words for it when it gave
    any (a grammar the output broke, a step that failed), goes to the client too."""
    if reason:
        return APIError(500, f"Internal server error (request id {request_id}): {reason}")
    return APIError(
        500, f"Internal server error (request id {request_id}); the server log has the details"
    )


def request_failed_error(
    request_id: str, reason: str | None, retryable: bool, retry_after_s: int | None = None
) -> APIError:
    """The answer to a request the engine failed: a 503 (with `retry_after_s` as Retry-After)
    when the failure came from the server's state (its engine core stopped answering) and a
    retry may succeed, otherwise `internal_error`."""
    if retryable:
        return APIError(
            503, reason or "The engine is unavailable; retry shortly", retry_after_s=retry_after_s
        )
    return internal_error(request_id, reason)


def context_length_error(num_tokens: int, max_model_len: int) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. "
        f"However, your request has {num_tokens} input tokens. Please reduce "
        "the length of the input messages.",
        param="input_tokens",
    )


def text_too_long_error(num_chars: int, max_num_tokens: int, max_model_len: int) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. "
        f"However, your input has {num_chars} characters, more than "
        f"{max_num_tokens} tokens of this model can hold. Please reduce the "
        "length of the input.",
        param="input_tokens",
    )


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model")


def validation_error(
    exc: ValidationError, loc_prefix: tuple[str, ...] = (), index_offset: int = 0
) -> APIError:
    """A 400 listing the first few problems, `param` naming the first bad field.
    `loc_prefix` and `index_offset` place errors of a slice of a list (validated on its
    own) in the request: the slice's item i is item `index_offset + i` of that field."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    parts: list[str] = []
    first_param: str | None = None
    for err in errors[:_MAX_ERRORS_LISTED]:
        loc = tuple(err.get("loc", ()))
        if loc and isinstance(loc[0], int):
            loc = (loc[0] + index_offset, *loc[1:])
        loc = (*loc_prefix, *loc)
        param = _param_from_loc(loc)
        first_param = first_param or param
        where = f"{param}: " if param else ""
        parts.append(f"{where}{err.get('msg', 'invalid value')} [type={err.get('type')}]")
    if len(errors) > _MAX_ERRORS_LISTED:
        parts.append(f"and {len(errors) - _MAX_ERRORS_LISTED} more")
    return APIError(400, "Invalid request: " + "; ".join(parts), param=first_param)


def _param_from_loc(loc: Sequence[Any]) -> str | None:
    names: list[str] = []
    for item in loc:
        if isinstance(item, str) and names and _UNION_MEMBER.match(item):
            break
        names.append(str(item))
    return ".".join(names) or None
