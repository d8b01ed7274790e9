"""GET /v1/models and /v1/models/{id}: the model cards of the served names. Separate from
the generation routes because it touches neither the engine nor a request body."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.errors import model_not_found
from app.route_answers import json_response
from app.route_checks import checked_state
from app.server_state import ServerState


async def list_models(request: Request, request_id: str) -> Response:
    state = await checked_state(request)
    return json_response({"object": "list", "data": [_model_card(state, state.model_names[0])]})


async def retrieve_model(request: Request, request_id: str) -> Response:
    state = await checked_state(request)
    model_id = request.path_params["model_id"]
    if model_id not in state.model_names:
        raise model_not_found(model_id)
    return json_response(_model_card(state, model_id))


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
