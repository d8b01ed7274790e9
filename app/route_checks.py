"""What the OpenAI routes check before the engine sees a request: the server is serving
and the key is right, the body's size and array lengths, the model and the fields, and
admission. Shared by the chat, text completion and model routes."""

from __future__ import annotations

from typing import Any

import structlog
from starlette.requests import Request

from actors.frontend.admission import AdmissionRefused, RequestLimitError
from actors.frontend.admitted_group import AdmittedGroup
from actors.protocol.messages import EngineRequest
from actors.protocol.sampling_params import SamplingParams
from app.errors import APIError, bad_request, model_not_found
from app.http_input import check_api_key, require_serving, server_state
from app.request_limits import (
    MAX_VLLM_XARGS,
    check_generation_size,
    check_priority,
    drop_truncated_tokens,
)
from app.request_telemetry import RequestTelemetry
from app.schemas import SamplingFields, unsupported_field
from app.server_state import ServerState

log = structlog.get_logger("tandem.server")


async def checked_state(request: Request) -> ServerState:
    state = server_state(request)
    check_api_key(request, state)
    require_serving(state)
    return state


def check_size(state: ServerState, data: dict[str, Any], completions: bool) -> None:
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


def array_caps(state: ServerState) -> dict[str, int]:
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


def check_request(
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


async def admit(
    state: ServerState, requests: list[EngineRequest], params: SamplingParams
) -> AdmittedGroup:
    assert state.admission is not None
    try:
        return await state.admission.admit(requests, params)
    except RequestLimitError as exc:
        raise bad_request(str(exc), exc.param) from None
    except AdmissionRefused as exc:
        raise APIError(exc.status, exc.message, retry_after_s=exc.retry_after_s) from None
