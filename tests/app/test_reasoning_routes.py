"""Chat completions of `<think>` models under --reasoning-parser, through the real routes
and SSE writer, on a scripted engine: the completion's text pieces are fixed, one piece per
read, and the reading of them (reasoning_content, content, tool_calls) must agree streamed
and not (the chat: tests/app/_reasoning_chat.py). The tokenizer here has no `<think>`
token of its own, so an output constraint binds from the first token (after reasoning:
test_reasoning_constraints.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from app.server_state import ServerState
from tests.actors._tokenizer_fixtures import tiny_tokenizer
from tests.app._reasoning_chat import (
    ASK,
    MODEL,
    WEATHER,
    chat,
    chat_stream,
    qwen3_like_state,
    serve_script,
)
from tests.app._scripted_chat import joined_deltas, routes_client

THOUGHT = [
    "<th",
    "ink>",
    "\nThe user",
    " asks. <tool_",
    "call> is not",
    " needed.</",
    "think",
    ">\n\nSun",
    "ny.",
]
"""A Qwen3 completion in pieces, its tags split across them."""
CALL = [
    "<think>\nCall it.</think>\n\n<tool_",
    'call>\n{"name": "get_weather", "arguments": ',
    '{"city": "Paris"}}\n</tool_call>',
]


@pytest.fixture(scope="module")
def state() -> Iterator[ServerState]:
    yield qwen3_like_state(tiny_tokenizer())


@pytest.fixture(scope="module")
def client(state: ServerState) -> Iterator[TestClient]:
    with routes_client(state) as test_client:
        yield test_client


def _kinds(chunks: list[dict[str, Any]]) -> list[str]:
    """The field each chunk's delta carries, in order (the role chunk and the finish chunk
    left out)."""
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    return [next(iter(d)) for d in deltas if d]


def test_qwen3_reasoning_then_content(client: TestClient, state: ServerState) -> None:
    serve_script(state, "qwen3", THOUGHT)
    (choice,) = chat(client, messages=ASK)["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "\n\nSunny.",
        "reasoning_content": "\nThe user asks. <tool_call> is not needed.",
        "reasoning": "\nThe user asks. <tool_call> is not needed.",
    }
    assert choice["finish_reason"] == "stop"

    chunks = chat_stream(client, messages=ASK)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert joined_deltas(chunks) == {
        "reasoning": choice["message"]["reasoning_content"],
        "content": choice["message"]["content"],
        "calls": {},
        "finish": "stop",
    }
    kinds = _kinds(chunks)
    assert kinds.count("reasoning_content") > 2 and "content" in kinds
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k != "content")
    assert chunks[-1]["choices"][0]["delta"] == {}


def test_qwen3_without_thinking_is_content(client: TestClient, state: ServerState) -> None:
    serve_script(state, "qwen3", ["Sunny", ".</think> stays"])
    body = chat(client, messages=ASK, chat_template_kwargs={"enable_thinking": False})
    prompt = state.tokenizer.decode(list(state.admission.requests[-1].prompt_token_ids))
    assert prompt.endswith("<think>\n\n</think>\n\n")
    message = body["choices"][0]["message"]
    assert message["content"] == "Sunny.</think> stays" and message["reasoning_content"] is None


def test_qwen3_prompt_that_opens_the_think_block(client: TestClient, state: ServerState) -> None:
    serve_script(state, "qwen3", ["Because.</thi", "nk>\n\nSunny."])
    kwargs = {"think_open": True}
    message = chat(client, messages=ASK, chat_template_kwargs=kwargs)["choices"][0]["message"]
    assert message["reasoning_content"] == "Because." and message["content"] == "\n\nSunny."
    joined = joined_deltas(chat_stream(client, messages=ASK, chat_template_kwargs=kwargs))
    assert (joined["reasoning"], joined["content"]) == ("Because.", "\n\nSunny.")


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_r1_reasoning_that_never_ends(
    client: TestClient, state: ServerState, stream: bool
) -> None:
    """Cut off by max_tokens before `</think>`: all of it is reasoning, even a held-back
    partial tag."""
    serve_script(state, "deepseek_r1", ["Let me", " think", " more </thi"], finish="length")
    if stream:
        joined = joined_deltas(chat_stream(client, messages=ASK))
        assert joined == {
            "reasoning": "Let me think more </thi",
            "content": "",
            "calls": {},
            "finish": "length",
        }
        return
    (choice,) = chat(client, messages=ASK)["choices"]
    assert choice["message"]["reasoning_content"] == "Let me think more </thi"
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"


def test_deepseek_r1_without_opening_tag(client: TestClient, state: ServerState) -> None:
    serve_script(state, "deepseek_r1", ["Hmm.", "</think>", "Sunny."])
    message = chat(client, messages=ASK)["choices"][0]["message"]
    assert message["reasoning_content"] == "Hmm." and message["content"] == "Sunny."


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_then_hermes_tool_call(
    client: TestClient, state: ServerState, parser: str
) -> None:
    serve_script(state, parser, CALL)
    (choice,) = chat(client, messages=ASK, tools=[WEATHER])["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == "\nCall it." and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and choice["finish_reason"] == "tool_calls"

    chunks = chat_stream(client, messages=ASK, tools=[WEATHER])
    joined = joined_deltas(chunks)
    assert joined["reasoning"] == "\nCall it." and joined["content"] == ""
    (streamed_call,) = joined["calls"].values()
    assert streamed_call["name"] == "get_weather" and streamed_call["id"].startswith("call_")
    assert streamed_call["arguments"] == '{"city": "Paris"}'
    assert joined["finish"] == "tool_calls"
    kinds = _kinds(chunks)
    assert kinds[0] == "reasoning_content" and set(kinds[1:]) == {"tool_calls"}


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false(client: TestClient, state: ServerState, stream: bool) -> None:
    serve_script(state, "qwen3", THOUGHT)
    if stream:
        chunks = chat_stream(client, messages=ASK, include_reasoning=False)
        assert all("reasoning_content" not in c["choices"][0]["delta"] for c in chunks)
        assert joined_deltas(chunks)["content"] == "\n\nSunny."
        return
    message = chat(client, messages=ASK, include_reasoning=False)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "\n\nSunny.",
        "reasoning_content": None,
        "reasoning": None,
    }


def test_parser_none_leaves_the_text_as_content(client: TestClient, state: ServerState) -> None:
    """Today's shapes: the message has no reasoning_content; each piece is one content
    chunk as it came, the last one on the finish chunk."""
    serve_script(state, "none", THOUGHT)
    (choice,) = chat(client, messages=ASK)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "".join(THOUGHT)}
    chunks = chat_stream(client, messages=ASK)
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert deltas == [{"content": piece} for piece in THOUGHT]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_logprobs_cover_every_token(client: TestClient, state: ServerState, parser: str) -> None:
    """Pieces held back (a partial tag) still send their token's entry, on a content chunk
    of their own; the stream's entries are the whole response's."""
    serve_script(state, parser, THOUGHT)
    body = chat(client, messages=ASK, logprobs=True, top_logprobs=1)
    entries = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"t{1000 + i}" for i in range(len(THOUGHT))]
    chunks = chat_stream(client, messages=ASK, logprobs=True, top_logprobs=1)
    streamed = [
        entry
        for chunk in chunks
        for entry in ((chunk["choices"][0].get("logprobs") or {}).get("content") or [])
    ]
    assert streamed == entries
    assert {"content": ""} in [c["choices"][0]["delta"] for c in chunks[1:]]  # "<th" held
    joined = joined_deltas(chunks)
    assert joined["reasoning"] == body["choices"][0]["message"]["reasoning_content"]


def test_each_choice_has_its_own_reader(client: TestClient, state: ServerState) -> None:
    serve_script(state, "qwen3", THOUGHT)
    chunks = chat_stream(client, messages=ASK, n=2)
    for index in (0, 1):
        joined = joined_deltas(chunks, index)
        assert joined["reasoning"] == "\nThe user asks. <tool_call> is not needed."
        assert joined["content"] == "\n\nSunny."


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_constrained_output_is_content(client: TestClient, state: ServerState, parser: str) -> None:
    """Without think tokens to name in a grammar, a JSON answer is bound from its first
    token, so there is no reasoning to read, even where the prompt opens a think block."""
    serve_script(state, parser, ['{"t": ', "21}"])
    body = chat(
        client,
        messages=ASK,
        response_format={"type": "json_object"},
        chat_template_kwargs={"think_open": True},
    )
    assert state.admission.requests[-1].sampling_params.structured_output is not None
    message = body["choices"][0]["message"]
    assert message["content"] == '{"t": 21}' and message["reasoning_content"] is None


def test_named_tool_choice_reads_the_arguments(client: TestClient, state: ServerState) -> None:
    serve_script(state, "deepseek_r1", ['{"city": ', '"Paris"}'])
    named = {"type": "function", "function": {"name": "get_weather"}}
    (choice,) = chat(client, messages=ASK, tools=[WEATHER], tool_choice=named)["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["reasoning_content"] is None and choice["finish_reason"] == "stop"


def test_text_completions_are_not_parsed(client: TestClient, state: ServerState) -> None:
    serve_script(state, "qwen3", THOUGHT)
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "".join(THOUGHT)
