"""Route handlers become Starlette endpoints here: each gets a request id, and whatever it
raises becomes an OpenAI-shaped answer. Separate from the routes because the OpenAI and
the admin routes wrap their handlers the same way."""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from app.errors import APIError, error_response, internal_error
from app.http_input import server_state
from app.request_telemetry import RequestTelemetry
from telemetry.logging import bind_request

log = structlog.get_logger("tandem.server")

Handler = Callable[[Request, str], Awaitable[Response]]
GenerationHandler = Callable[[Request, str, RequestTelemetry], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
CLIENT_CLOSED_STATUS = 499
"""Logged for a request whose client left before its answer; nobody receives it."""


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
