"""Output constraints on a `<think>` model whose tokenizer has `<think>` and `</think>` as
tokens of their own (as Qwen3's): the spec the engine gets lets the model reason first,
and the reasoning is read into `reasoning_content` while the constrained answer (a JSON
object, a named tool's arguments) is the content or the call, streamed and not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient
from tokenizers import AddedToken, Tokenizer

from actors.protocol.structured_output import StructuredOutputSpec
from app.server_state import ServerState
from tests.actors._tokenizer_fixtures import tiny_tokenizer
from tests.app._reasoning_chat import (
    ASK,
    WEATHER,
    chat,
    chat_stream,
    qwen3_like_state,
    serve_script,
)
from tests.app._scripted_chat import joined_deltas, routes_client

ANSWER = ["<think>\nJSON, then", ' {"t": 1}? No.', "</think>", "\n\n", '{"t": ', "21}"]
"""Reasoning (with a JSON-looking piece in it), the blank line, the constrained answer."""


@pytest.fixture(scope="module")
def state() -> Iterator[ServerState]:
    tokenizer = Tokenizer.from_str(tiny_tokenizer().to_str())
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    yield qwen3_like_state(tokenizer)


@pytest.fixture(scope="module")
def client(state: ServerState) -> Iterator[TestClient]:
    with routes_client(state) as test_client:
        yield test_client


def _sent_spec(state: ServerState) -> StructuredOutputSpec:
    spec = state.admission.requests[-1].sampling_params.structured_output
    assert spec is not None
    return spec


@pytest.mark.parametrize(
    ("parser", "template_kwargs", "lead"),
    [
        ("qwen3", {}, "may_think"),
        ("qwen3", {"think_open": True}, "thinking"),
        ("qwen3", {"enable_thinking": False}, "may_think"),
        ("deepseek_r1", {}, "thinking"),
    ],
)
def test_the_engine_gets_a_spec_that_lets_the_model_think(
    client: TestClient, state: ServerState, parser: str, template_kwargs: dict, lead: str
) -> None:
    serve_script(state, parser, ANSWER)
    chat(
        client,
        messages=ASK,
        response_format={"type": "json_object"},
        chat_template_kwargs=template_kwargs,
    )
    assert _sent_spec(state).reasoning == lead and _sent_spec(state).kind == "json"


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_then_a_json_answer(client: TestClient, state: ServerState, parser: str) -> None:
    serve_script(state, parser, ANSWER)
    body = {"messages": ASK, "response_format": {"type": "json_object"}}
    message = chat(client, **body)["choices"][0]["message"]
    assert message["reasoning_content"] == '\nJSON, then {"t": 1}? No.'
    assert message["content"] == '\n\n{"t": 21}'
    joined = joined_deltas(chat_stream(client, **body))
    assert (joined["reasoning"], joined["content"]) == (
        message["reasoning_content"],
        message["content"],
    )


def test_reasoning_then_a_named_tool_call(client: TestClient, state: ServerState) -> None:
    serve_script(state, "qwen3", ["<think>Weather: call it.</think>", "\n", '{"city": "Paris"}'])
    body = {
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    (choice,) = chat(client, **body)["choices"]
    assert _sent_spec(state).reasoning == "may_think"
    assert choice["message"]["reasoning_content"] == "Weather: call it."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    (streamed,) = joined_deltas(chat_stream(client, **body))["calls"].values()
    assert streamed["arguments"] == '{"city": "Paris"}'


def test_text_completions_stay_bound_from_the_first_token(
    client: TestClient, state: ServerState
) -> None:
    serve_script(state, "qwen3", ['{"t": ', "21}"])
    response = client.post(
        "/v1/completions",
        json={"model": "qwen3-test", "prompt": "Hi", "response_format": {"type": "json_object"}},
    )
    assert response.status_code == 200, response.text
    assert _sent_spec(state).reasoning == ""
