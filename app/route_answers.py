"""How the OpenAI routes answer an admitted request: as an SSE stream, or by reading every
choice to its end (racing the client) for one JSON body. Shared by the chat and text
completion routes, which differ only in how they build the request and format the body."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import orjson
import structlog
from starlette.requests import Request
from starlette.responses import Response

from actors.frontend.admitted_group import AdmittedGroup
from app.errors import request_failed_error
from app.http_input import server_state
from app.request_telemetry import RequestTelemetry
from app.responses import ChoiceState
from app.schemas import SamplingFields
from app.server_state import ServerState
from app.sse import EventStreamResponse, StreamOptions
from app.sse_chunks import ChunkFormatter

log = structlog.get_logger("tandem.server")


def continuous_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


def stream_response(
    group: AdmittedGroup,
    formatter: ChunkFormatter,
    req: SamplingFields,
    state: ServerState,
    request_id: str,
    call: RequestTelemetry,
) -> Response:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    options = StreamOptions(
        include_usage=include_usage,
        continuous_usage=continuous_usage(req),
        keep_alive=state.keep_alive,
    )
    return EventStreamResponse(
        group, formatter, options, request_id, headers={"X-Request-Id": request_id}, telemetry=call
    )


async def collect(
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


def json_response(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")
