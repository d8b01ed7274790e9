"""Hostile input on the request surface: text a request carries that the server parses a
second time (schemas given as strings, tool-call arguments, logit_bias keys), specs whose
compilation could stall, thousands of tools, prompt logprobs of long prompts, and clients
that hang up halfway through their body. Each is a 400 naming its field or bounded work,
never a 500 or a stall; each test also checks that /health kept answering within a second
and that memory came back (tests/app/_hostile.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import structlog

import app.endpoints
from tests.app._hostile import connect, hostile, metric, wait_until
from tests.app._server_fixtures import RunningServer

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
COMPILE_TIMEOUT_S = 2.0
MESSAGES = [{"role": "user", "content": "Say something."}]
DEPTH = 5000


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with RunningServer(grammar_compile_timeout_s=COMPILE_TIMEOUT_S) as running:
        yield running


def _refused(response: httpx.Response, param: str, *words: str) -> str:
    assert response.status_code == 400, response.text[:2000]
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return str(error["message"])


def _not_a_server_error(response: httpx.Response) -> None:
    assert response.status_code in (200, 400), response.text[:2000]


def _deep_object(depth: int) -> str:
    return '{"a":' * depth + "{}" + "}" * depth


def _post_text(http: httpx.Client, path: str, body: dict[str, Any], deep: str) -> httpx.Response:
    """POST `body` with the JSON text `deep` put where its value "DEEP" is (the standard
    encoder cannot write a value nested that deeply)."""
    text = json.dumps(body).replace('"DEEP"', deep)
    return http.post(path, content=text, headers={"Content-Type": "application/json"})


# ---- 1: text parsed a second time is bounded before it is parsed ------------------------


HUGE_SCHEMA = {"enum": [f"v{i}" for i in range(300_000)]}
"""About 3 MB of schema: more than a spec may be, well within a body."""


@pytest.mark.parametrize(
    ("path", "field", "param"),
    [
        (CMPL, "guided_json", "guided_json"),
        (CHAT, "structured_outputs", "structured_outputs.json"),
        (CHAT, "response_format", "response_format.json_schema.schema"),
    ],
)
def test_a_huge_schema_is_refused_before_it_is_parsed_or_compiled(
    server: RunningServer, http: httpx.Client, path: str, field: str, param: str
) -> None:
    text = json.dumps(HUGE_SCHEMA)
    value: Any = {
        "guided_json": text,
        "structured_outputs": {"json": text},
        "response_format": {"type": "json_schema", "json_schema": {"schema": HUGE_SCHEMA}},
    }[field]
    prompt = {"prompt": "x"} if path == CMPL else {"messages": MESSAGES}
    with hostile(server.url):
        response = http.post(path, json={**prompt, "max_tokens": 4, field: value})
    _refused(response, param, "characters long")


def test_deep_tool_call_arguments_in_the_conversation_are_a_400(
    server: RunningServer, http: httpx.Client
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f"}}
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call, "function": {"name": "f", "arguments": _deep_object(DEPTH)}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    with hostile(server.url):
        response = http.post(CHAT, json={"messages": messages, "max_tokens": 2})
    _refused(response, "messages", "message 1: the arguments of tool call 0 nests too deeply")


def test_a_huge_logit_bias_key_is_refused_without_echoing_it(
    server: RunningServer, http: httpx.Client
) -> None:
    key = "7" * 5_000_000
    with hostile(server.url):
        response = http.post(CMPL, json={"prompt": "x", "max_tokens": 1, "logit_bias": {key: 1}})
    message = _refused(response, "logit_bias")
    assert len(message) < 1000, len(message)


def test_deep_chat_template_kwargs_and_many_vllm_xargs_are_bounded(
    server: RunningServer, http: httpx.Client
) -> None:
    with hostile(server.url):
        kwargs = _post_text(
            http,
            CHAT,
            {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"x": "DEEP"}},
            _deep_object(900),
        )
        many = {f"k{i}": i for i in range(200_000)}
        xargs = http.post(CMPL, json={"prompt": "x", "max_tokens": 1, "vllm_xargs": many})
    _not_a_server_error(kwargs)
    _refused(xargs, "vllm_xargs", "more than 256")


@pytest.mark.parametrize(
    ("field", "spec"),
    [
        ("guided_json", {"enum": [f"choice {i}" for i in range(100_000)]}),
        ("guided_json", {"type": "string", "maxLength": 1_000_000_000}),
        (
            "guided_json",
            {
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {"next": {"$ref": "#/$defs/node"}},
                    }
                },
                "$ref": "#/$defs/node",
            },
        ),
        ("guided_regex", "(a+)+$"),
        ("guided_regex", "(a|aa)*(b|c){1000}"),
        ("guided_regex", "((a{1000}){1000}){1000}"),
    ],
    ids=["huge-enum", "max-length-1e9", "recursive-ref", "nested-plus", "wide-repeat", "cubed"],
)
def test_costly_specs_are_refused_or_compiled_without_stalling_anyone(
    server: RunningServer, http: httpx.Client, field: str, spec: Any
) -> None:
    with hostile(server.url):
        response = http.post(CMPL, json={"prompt": "x", "max_tokens": 2, field: spec})
    _not_a_server_error(response)
    if response.status_code == 400:
        assert response.json()["error"]["param"] == field


# ---- 2: a client that hangs up mid-body is an abort, not a server error -----------------


def test_a_client_that_hangs_up_mid_body_is_counted_as_a_disconnect(
    server: RunningServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    capture = structlog.testing.LogCapture()
    monkeypatch.setattr(app.endpoints, "log", structlog.wrap_logger(None, processors=[capture]))
    before = metric(http, "tandem:client_disconnects_total")
    body = json.dumps({"messages": MESSAGES, "max_tokens": 4}).encode()
    with hostile(server.url):
        for path in (CHAT, CMPL, "/tokenize"):
            sock = connect(server.url)
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body) + 1000}\r\n\r\n".encode()
                + body
            )
            sock.close()
        wait_until(
            lambda: sum(e["event"] == "client_disconnected" for e in capture.entries) == 3,
            10,
            "the hang-ups were not seen",
        )
    events = [e["event"] for e in capture.entries]
    assert "internal_error" not in events, capture.entries
    assert metric(http, "tandem:client_disconnects_total") == before + 2  # chat, completions
    assert http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200


# ---- 3: tools ----------------------------------------------------------------------------


def _tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def test_thousands_of_tools_and_a_choice_naming_none_of_them_are_bounded(
    server: RunningServer, http: httpx.Client
) -> None:
    tools = [_tool(f"function_{i}") for i in range(5000)]
    body = {"messages": MESSAGES, "max_tokens": 2, "tools": tools}
    missing = {"type": "function", "function": {"name": "nowhere"}}
    with hostile(server.url):
        required = http.post(CHAT, json={**body, "tool_choice": "required"})
        named_missing = http.post(CHAT, json={**body, "tool_choice": missing})
        named_choice = {"type": "function", "function": {"name": "function_7"}}
        named = http.post(CHAT, json={**body, "tool_choice": named_choice})
    _refused(required, "tool_choice", "2000")
    message = _refused(named_missing, "tool_choice", "'nowhere'")
    assert len(message) < 2000, len(message)
    _not_a_server_error(named)


TOOL_CHOICES: list[Any] = ["required", {"type": "function", "function": {"name": "f"}}, "none"]


@pytest.fixture(scope="module")
def huge_parameters() -> dict[str, Any]:
    """A parameter schema of 200,000 properties, built once for the module."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200_000)}}


@pytest.mark.parametrize("depth", [400, 900])
def test_a_deep_parameter_schema_is_not_a_server_error(
    server: RunningServer, http: httpx.Client, depth: int
) -> None:
    with hostile(server.url):
        for choice in TOOL_CHOICES:
            body = {"messages": MESSAGES, "max_tokens": 2, "tool_choice": choice}
            deep = _post_text(
                http, CHAT, {**body, "tools": [_tool("f", "DEEP")]}, _deep_object(depth)
            )
            _not_a_server_error(deep)


def test_a_huge_parameter_schema_is_not_a_server_error(
    server: RunningServer, http: httpx.Client, huge_parameters: dict[str, Any]
) -> None:
    with hostile(server.url):
        for choice in TOOL_CHOICES:
            body = {"messages": MESSAGES, "max_tokens": 2, "tool_choice": choice}
            large = http.post(CHAT, json={**body, "tools": [_tool("f", huge_parameters)]})
            if choice == "none":
                _not_a_server_error(large)
            else:
                _refused(large, "tool_choice", "characters long")


# ---- 4: prompt logprobs --------------------------------------------------------------------


def test_logprobs_are_capped_at_the_servers_maximum(http: httpx.Client) -> None:
    for field in ("logprobs", "prompt_logprobs"):
        response = http.post(CMPL, json={"prompt": "x", "max_tokens": 1, field: 21})
        _refused(response, field, "20")
    chat = http.post(
        CHAT, json={"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": 21}
    )
    _refused(chat, "top_logprobs", "20")


def test_echo_with_logprobs_is_bounded_by_the_size_of_its_answer(
    server: RunningServer, http: httpx.Client
) -> None:
    words = "one two three four five six seven eight nine ten "
    many = {"prompt": [words * 90] * 30, "max_tokens": 1, "echo": True, "logprobs": 20}
    one = {"prompt": words * 30, "max_tokens": 1, "echo": True, "logprobs": 20}
    with hostile(server.url):
        refused = http.post(CMPL, json=many)  # 30 x 900 tokens x 21 entries
        served = http.post(CMPL, json={**one, "prompt_logprobs": 20})
    _refused(refused, "logprobs", "more than the server returns")
    assert served.status_code == 200, served.text[:2000]
    choice = served.json()["choices"][0]
    num_prompt_tokens = served.json()["usage"]["prompt_tokens"]
    assert len(choice["prompt_logprobs"]) == num_prompt_tokens
    assert all(len(entry) >= 20 for entry in choice["prompt_logprobs"][1:])
    assert server.wait_engine_idle().num_unfinished_admitted == 0
