"""The OpenAI-compatible route table: /v1/chat/completions, /v1/completions, /v1/models.
Each route's handler lives in its own module (routes_chat, routes_completions,
routes_models); app/endpoints.py wraps them with request ids and error answers."""

from __future__ import annotations

from starlette.routing import Route

from app.endpoints import api_endpoint, generation_endpoint
from app.routes_chat import chat_completions
from app.routes_completions import completions
from app.routes_models import list_models, retrieve_model


def openai_routes() -> list[Route]:
    return [
        Route(
            "/v1/chat/completions", generation_endpoint("chat", chat_completions), methods=["POST"]
        ),
        Route(
            "/v1/completions",
            generation_endpoint("text_completion", completions),
            methods=["POST"],
        ),
        Route("/v1/models", api_endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", api_endpoint(retrieve_model), methods=["GET"]),
    ]
