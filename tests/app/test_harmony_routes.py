"""Chat completions of a gpt-oss model through the real routes and SSE writer, on a
scripted engine: the completion tokens are fixed, one token per read, and the harmony
reading of them (reasoning_content, content, tool_calls) must agree streamed and not.
Forced tool choices and JSON answers are checked as the engine compiles them: the grammar
sent with the request must take the scripted completion."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from actors.core.grammar import GrammarMatcher, compile_matcher
from actors.core.grammar_worker import SpecChecker
from actors.protocol.config import EngineConfig
from actors.protocol.messages import GrammarCheckerStart
from actors.protocol.structured_output import StructuredOutputSpec
from app.harmony.render import render_prompt
from app.harmony.vocab import ENCODINGS_BASE_ENV
from app.serve_settings import ServeSettings
from app.server_state import ServerState
from app.tokenizer_loader import load_tokenizer
from tests._gpt_oss_tokenizer import gpt_oss_model_dir
from tests.app._scripted_chat import (
    joined_deltas,
    routes_client,
    scripted_state,
    stream_chunks,
)

VOCAB_SIZE = 201_088
EOS_TOKEN_IDS = (200002, 199999, 200012)
"""gpt-oss's generation_config: <|return|>, <|endoftext|>, <|call|>."""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
BAD_NAME = {"type": "function", "function": {"name": "get weather"}}
BAD_SCHEMA = {
    "type": "function",
    "function": {"name": "broken", "parameters": {"type": "object", "minProperties": "x"}},
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WITH_CALL = (
    "<|channel|>analysis<|message|>The user wants the weather. Ça va: call the tool.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Checking Paris…<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
ANSWER = (
    "<|channel|>analysis<|message|>Simple.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Sunny, 21 °C.<|return|>"
)


class InProcessChecker:
    """The grammar checker's verdicts, compiled in this process (as its worker does)."""

    def __init__(self, tokenizer_json: str) -> None:
        self.checker = SpecChecker(GrammarCheckerStart(tokenizer_json, VOCAB_SIZE, EOS_TOKEN_IDS))
        self.checked: list[StructuredOutputSpec] = []

    async def check(self, spec: StructuredOutputSpec) -> str | None:
        self.checked.append(spec)
        return self.checker.verdict(spec).error


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerState]:
    root = tmp_path_factory.mktemp("gpt-oss")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENCODINGS_BASE_ENV, "")
        patch.delenv(ENCODINGS_BASE_ENV)
        patch.setenv("TANDEM_CACHE_DIR", os.fspath(root / "cache"))
        model = gpt_oss_model_dir(root)
        tokenizer = load_tokenizer(model)
        checker = InProcessChecker(tokenizer.raw.to_str())
        settings = ServeSettings(engine=EngineConfig(model=model), port=0)
        yield scripted_state(settings, tokenizer, VOCAB_SIZE, checker)


@pytest.fixture(scope="module")
def client(state: ServerState) -> Iterator[TestClient]:
    with routes_client(state) as test_client:
        yield test_client


def _script(state: ServerState, text: str) -> None:
    tokens = state.tokenizer.harmony.encoding.encode(text, allowed_special="all")
    state.admission.script = tokens


def _chat(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/chat/completions", json={"model": "gpt-oss-20b", **body})


def _stream(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    return stream_chunks(client, "gpt-oss-20b", **body)


def test_tool_call_streamed_and_not(client: TestClient, state: ServerState) -> None:
    _script(state, WITH_CALL)
    body = _chat(client, messages=ASK, tools=[WEATHER], reasoning_effort="low").json()
    (choice,) = body["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == "The user wants the weather. Ça va: call the tool."
    assert message["content"] == "Checking Paris…"
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert choice["finish_reason"] == "tool_calls"
    (request,) = state.admission.requests[-1:]
    encoding = state.tokenizer.harmony.encoding
    assert list(request.prompt_token_ids) == render_prompt(encoding, ASK, [WEATHER], "low")
    assert set(state.tokenizer.harmony.stop_token_ids) <= set(
        request.sampling_params.stop_token_ids
    )

    _script(state, WITH_CALL)
    chunks = _stream(client, messages=ASK, tools=[WEATHER], reasoning_effort="low")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    joined = joined_deltas(chunks)
    assert joined["reasoning"] == message["reasoning_content"]
    assert joined["content"] == message["content"]
    assert joined["finish"] == "tool_calls"
    (streamed_call,) = joined["calls"].values()
    assert streamed_call["name"] == "get_weather"
    assert streamed_call["arguments"] == call["function"]["arguments"]
    # Token by token: the reasoning, the content and the arguments came in several pieces.
    kinds = [next(iter(c["choices"][0]["delta"]), None) for c in chunks]
    assert kinds.count("reasoning_content") > 5 and kinds.count("content") > 2
    assert kinds.count("tool_calls") > 3
    assert kinds.index("reasoning_content") < kinds.index("content") < kinds.index("tool_calls")


def test_final_answer(client: TestClient, state: ServerState) -> None:
    _script(state, ANSWER)
    body = _chat(client, messages=ASK).json()
    (choice,) = body["choices"]
    assert choice["message"]["content"] == "Sunny, 21 °C."
    assert choice["message"]["reasoning_content"] == "Simple."
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    _script(state, ANSWER)
    joined = joined_deltas(_stream(client, messages=ASK, include_reasoning=False))
    assert joined == {"reasoning": "", "content": "Sunny, 21 °C.", "calls": {}, "finish": "stop"}


def test_history_with_tool_result_renders(client: TestClient, state: ServerState) -> None:
    _script(state, ANSWER)
    history = [
        *ASK,
        {
            "role": "assistant",
            "reasoning_content": "Call it.",
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
    ]
    response = _chat(client, messages=history, tools=[WEATHER])
    assert response.status_code == 200
    prompt = state.tokenizer.decode(list(state.admission.requests[-1].prompt_token_ids))
    assert "<|start|>functions.get_weather<|channel|>commentary<|message|>sunny<|end|>" in prompt


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"messages": [*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}]},
            "messages.1.tool_call_id",
        ),
        ({"messages": ASK, "reasoning_effort": "extreme"}, "reasoning_effort"),
        (
            {
                "messages": ASK,
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"messages": ASK, "guided_regex": "[a-z]+"}, "guided_regex"),
        (
            {"messages": ASK, "structured_outputs": {"choice": ["a", "b"]}},
            "structured_outputs.choice",
        ),
        (
            {"messages": ASK, "tools": [BAD_NAME], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            {"messages": ASK, "tools": [WEATHER, BAD_SCHEMA], "tool_choice": "required"},
            "tools.1.function.parameters",
        ),
        (
            {
                "messages": ASK,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                },
            },
            "response_format",
        ),
        (
            {"messages": ASK, "continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_bad_requests(client: TestClient, body: dict[str, Any], param: str) -> None:
    response = _chat(client, **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["message"]


def _grammar_takes(state: ServerState, spec: StructuredOutputSpec, tokens: list[int]) -> bool:
    """Whether the request's grammar, compiled as the engine does, takes the whole
    completion and ends with it."""
    checker: InProcessChecker = state.grammar_checker  # type: ignore[assignment]
    matcher = GrammarMatcher(compile_matcher(checker.checker._tokenizer, spec))
    return all(matcher.accept_token(t) for t in tokens) and matcher.is_terminated


CALL_ONLY = (
    "<|channel|>analysis<|message|>Must call it.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
)


@pytest.mark.parametrize(
    ("tool_choice", "finish_reason"),
    [
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ],
)
def test_forced_tool_choice(
    client: TestClient, state: ServerState, tool_choice: Any, finish_reason: str
) -> None:
    _script(state, CALL_ONLY)
    body = _chat(client, messages=ASK, tools=[TIME, WEATHER], tool_choice=tool_choice).json()
    (choice,) = body["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert choice["finish_reason"] == finish_reason
    request = state.admission.requests[-1]
    spec = request.sampling_params.structured_output
    assert spec.kind == "grammar" and spec in state.grammar_checker.checked
    assert _grammar_takes(state, spec, state.admission.script)
    # Every tool is shown to the model, as for tool_choice auto.
    prompt = state.tokenizer.decode(list(request.prompt_token_ids))
    assert "type get_time" in prompt and "type get_weather" in prompt
    # The grammar holds the call to what was asked: a final answer cannot end the turn,
    # and a named choice allows no other function.
    assert not _grammar_takes(state, spec, _tokens(state, ANSWER))
    other = CALL_ONLY.replace("get_weather", "get_time").replace('{"city":"Paris"}', "{}")
    assert _grammar_takes(state, spec, _tokens(state, other)) == (tool_choice == "required")

    _script(state, CALL_ONLY)
    joined = joined_deltas(
        _stream(client, messages=ASK, tools=[TIME, WEATHER], tool_choice=tool_choice)
    )
    assert joined["finish"] == finish_reason
    assert [c["arguments"] for c in joined["calls"].values()] == ['{"city":"Paris"}']


def test_json_answer(client: TestClient, state: ServerState) -> None:
    schema = {"type": "object", "properties": {"t": {"type": "integer"}}, "required": ["t"]}
    answer = (
        "<|channel|>analysis<|message|>JSON, then.<|end|>"
        '<|start|>assistant<|channel|>final<|message|>{"t": 21}<|return|>'
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    _script(state, answer)
    body = _chat(client, messages=ASK, response_format=fmt).json()
    (choice,) = body["choices"]
    assert choice["message"]["content"] == '{"t": 21}' and choice["finish_reason"] == "stop"
    spec = state.admission.requests[-1].sampling_params.structured_output
    assert _grammar_takes(state, spec, state.admission.script)
    assert not _grammar_takes(state, spec, _tokens(state, ANSWER))  # free text refused
    assert not _grammar_takes(state, spec, _tokens(state, CALL_ONLY))  # no tools shown

    # With tools under tool_choice auto, a call may end the turn instead.
    _script(state, CALL_ONLY)
    body = _chat(client, messages=ASK, tools=[WEATHER], response_format={"type": "json_object"})
    spec = state.admission.requests[-1].sampling_params.structured_output
    assert body.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert _grammar_takes(state, spec, state.admission.script)
    json_answer = answer.replace('{"t": 21}', '{"any": "object"}')
    assert _grammar_takes(state, spec, _tokens(state, json_answer))


def test_free_requests_carry_no_grammar(client: TestClient, state: ServerState) -> None:
    _script(state, WITH_CALL)
    assert _chat(client, messages=ASK, tools=[WEATHER], tool_choice="auto").status_code == 200
    assert state.admission.requests[-1].sampling_params.structured_output is None


def test_logprobs_cover_every_output_token(client: TestClient, state: ServerState) -> None:
    """As vLLM reports them for gpt-oss: one entry per generated token, markup included,
    in order; the stream carries the same entries as the whole response."""
    _script(state, WITH_CALL)
    tokens = list(state.admission.script)
    body = _chat(client, messages=ASK, tools=[WEATHER], logprobs=True, top_logprobs=1).json()
    entries = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"t{t}" for t in tokens]
    assert [e["logprob"] for e in entries] == [-t / 1e6 for t in tokens]
    assert [e["top_logprobs"][0]["token"] for e in entries] == [f"t{t + 1}" for t in tokens]

    _script(state, WITH_CALL)
    chunks = _stream(client, messages=ASK, tools=[WEATHER], logprobs=True, top_logprobs=1)
    streamed = [
        entry
        for chunk in chunks
        for entry in ((chunk["choices"][0].get("logprobs") or {}).get("content") or [])
    ]
    assert streamed == entries
    joined = joined_deltas(chunks)
    assert joined["reasoning"] == "The user wants the weather. Ça va: call the tool."
    assert joined["calls"][0]["arguments"] == '{"city": "Paris"}'


def _tokens(state: ServerState, text: str) -> list[int]:
    return state.tokenizer.harmony.encoding.encode(text, allowed_special="all")
