"""Bad requests: each gets the right status and an OpenAI-shaped error body, never a 5xx,
and the server stays healthy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.app._server_fixtures import MAX_MODEL_LEN, RunningServer

pytestmark = pytest.mark.slow

API_KEY = "sk-test-key"
MAX_BODY_BYTES = 64 * 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSGS = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any
    status: int
    param: str | None = None
    """Expected error.param (None: not checked)."""
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=lambda: dict(AUTH))
    method: str = "POST"
    message_has: str | None = None


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSGS, "max_tokens": 4, **fields}


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 4, **fields}


LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 100)

CASES = [
    Case("malformed json", CHAT, None, 400, raw=b'{"messages": ['),
    Case("NaN is not JSON", CHAT, None, 400, raw=b'{"messages": [], "temperature": NaN}'),
    Case("non-object body (array)", CHAT, [1, 2], 400),
    Case("non-object body (string)", CHAT, "hi", 400),
    Case("empty body", CHAT, None, 400, raw=b""),
    Case(
        "form content type",
        CHAT,
        None,
        415,
        raw=b"a=b",
        headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
    ),
    Case("missing messages", CHAT, {"max_tokens": 4}, 400, "messages"),
    Case("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    Case("messages not a list", CHAT, chat(messages="hi"), 400, "messages"),
    Case("message without role", CHAT, chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
    Case("content is a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400),
    Case(
        "image content part",
        CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        ),
        400,
        "messages.0.content.0",
        message_has="image_url content is not supported: this model takes text only",
    ),
    Case(
        "audio content part after text",
        CHAT,
        chat(
            messages=[
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Transcribe:"},
                        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                    ],
                },
            ]
        ),
        400,
        "messages.1.content.1",
        message_has="messages.1.content.1: input_audio content is not supported",
    ),
    Case(
        "file content part to tokenize",
        "/tokenize",
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
        400,
        "messages.0.content.0",
        message_has="file content is not supported: this model takes text only",
    ),
    Case("negative temperature", CHAT, chat(temperature=-1), 400, "temperature"),
    Case("temperature wrong type", CHAT, chat(temperature="hot"), 400, "temperature"),
    Case("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    Case("top_p above one", CHAT, chat(top_p=1.5), 400, "top_p"),
    Case("n zero", CHAT, chat(n=0), 400, "n"),
    Case("n above server limit", CHAT, chat(n=17), 400, "n"),
    Case("max_tokens zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    Case("max_tokens negative", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    Case("max_tokens fractional", CHAT, chat(max_tokens=4.5), 400, "max_tokens"),
    Case("max_tokens a word", CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    Case(
        "max_completion_tokens zero",
        CHAT,
        chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
    ),
    Case("max_tokens over context", CHAT, chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    Case(
        "prompt too long",
        CHAT,
        chat(messages=[{"role": "user", "content": LONG_PROMPT}]),
        400,
        "input_tokens",
        message_has="maximum context length",
    ),
    Case("seed too large", CHAT, chat(seed=2**64), 400, "seed", message_has="less_than_equal"),
    Case(
        "seed too small",
        CHAT,
        chat(seed=-(2**63) - 1),
        400,
        "seed",
        message_has="greater_than_equal",
    ),
    Case("presence_penalty out of range", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    Case(
        "frequency_penalty out of range", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"
    ),
    Case("repetition_penalty zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    Case("top_k below -1", CHAT, chat(top_k=-2), 400, "top_k"),
    Case("min_p above one", CHAT, chat(min_p=1.5), 400, "min_p"),
    Case("logit_bias key not a token id", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    Case("logit_bias value out of range", CHAT, chat(logit_bias={"1": 500}), 400, "logit_bias.1"),
    Case(
        "logit_bias token outside vocab", CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias"
    ),
    Case("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    Case(
        "top_logprobs 21 streamed",
        CHAT,
        chat(logprobs=True, top_logprobs=21, stream=True),
        400,
        "top_logprobs",
    ),
    Case("top_logprobs without logprobs", CHAT, chat(top_logprobs=5), 400, "top_logprobs"),
    Case("stop is a number", CHAT, chat(stop=5), 400, "stop"),
    Case("too many stop strings", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    Case("empty stop string", CHAT, chat(stop=[""]), 400, "stop"),
    Case("stop_token_ids negative", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids.0"),
    Case("min_tokens above max_tokens", CHAT, chat(min_tokens=10, max_tokens=4), 400, "min_tokens"),
    Case("ignore_eos not a boolean", CHAT, chat(ignore_eos="maybe"), 400, "ignore_eos"),
    Case("chat logprobs 2", CHAT, chat(logprobs=2), 400, "logprobs"),
    Case(
        "stream_options without stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    Case("tools not a list", CHAT, chat(tools={"name": "f"}), 400, "tools"),
    Case(
        "tool without a name",
        CHAT,
        chat(tools=[{"type": "function", "function": {}}]),
        400,
        "tools.0.function",
    ),
    Case("tool of another type", CHAT, chat(tools=[{"type": "retrieval"}]), 400, "tools.0"),
    Case(
        "tool_choice auto without a parser",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto"),
        400,
        "tool_choice",
        message_has="--tool-call-parser",
    ),
    Case(
        "tools without tool_choice mean auto, which needs a parser",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tool_choice",
        message_has="tools without tool_choice (auto) needs a tool-call parser",
    ),
    Case(
        "tool_choice names an unknown function",
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
    ),
    Case(
        "tool_choice required without tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"
    ),
    Case(
        "response_format unknown type",
        CHAT,
        chat(response_format={"type": "yaml"}),
        400,
        "response_format",
    ),
    Case(
        "response_format json_schema without schema",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema",
    ),
    Case(
        "response_format invalid schema",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objectx"}, "strict": True},
            }
        ),
        400,
        "response_format",
        message_has="objectx",
    ),
    Case(
        "structured_outputs invalid regex",
        CHAT,
        chat(structured_outputs={"regex": "a+("}),
        400,
        "structured_outputs.regex",
        message_has="regular expression",
    ),
    Case(
        "structured_outputs two kinds",
        CHAT,
        chat(structured_outputs={"regex": "a+", "choice": ["a"]}),
        400,
        "structured_outputs",
    ),
    Case(
        "structured_outputs unknown grammar rule",
        CHAT,
        chat(structured_outputs={"grammar": "start: foo"}),
        400,
        "structured_outputs.grammar",
    ),
    Case("guided_choice not a list", CHAT, chat(guided_choice="a"), 400, "guided_choice"),
    Case(
        "two constraints",
        CHAT,
        chat(guided_regex="a+", response_format={"type": "json_object"}),
        400,
        "guided_regex",
    ),
    Case(
        "completions: invalid guided_json", CMPL, cmpl(guided_json={"type": 5}), 400, "guided_json"
    ),
    Case("prompt_logprobs out of range", CHAT, chat(prompt_logprobs=21), 400, "prompt_logprobs"),
    Case("use_beam_search", CHAT, chat(use_beam_search=True), 400, "use_beam_search"),
    Case(
        "continue_final_message with generation prompt",
        CHAT,
        chat(continue_final_message=True),
        400,
        "continue_final_message",
    ),
    Case(
        "unknown model",
        CHAT,
        chat(model="no-such-model"),
        404,
        "model",
        message_has="does not exist",
    ),
    Case("completions: missing prompt", CMPL, {"max_tokens": 4}, 400, "prompt"),
    Case("completions: empty string prompt", CMPL, cmpl(prompt=""), 400, "prompt"),
    Case("completions: empty prompt list", CMPL, cmpl(prompt=[]), 400, "prompt"),
    Case("completions: prompt is a number", CMPL, cmpl(prompt=5), 400, "prompt"),
    Case("completions: token id outside vocab", CMPL, cmpl(prompt=[1, 99999999]), 400, "prompt"),
    Case("completions: suffix", CMPL, cmpl(suffix="end"), 400, "suffix"),
    Case("completions: logprobs 21", CMPL, cmpl(logprobs=21), 400, "logprobs"),
    Case("completions: unknown model", CMPL, cmpl(model="x"), 404, "model"),
    Case("missing API key", CHAT, chat(), 401, headers={}),
    Case("wrong API key", CHAT, chat(), 401, headers={"Authorization": "Bearer nope"}),
    Case("API key without Bearer", CHAT, chat(), 401, headers={"Authorization": API_KEY}),
    Case(
        "oversized body",
        CHAT,
        chat(messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}]),
        413,
    ),
    Case("GET on a POST route", CHAT, None, 405, method="GET"),
    Case("unknown route", "/v1/nothing-here", chat(), 404),
    Case("retrieve unknown model", "/v1/models/org/unknown", None, 404, "model", method="GET"),
    Case("tokenize without input", "/tokenize", {"add_special_tokens": True}, 400, "prompt"),
    Case("detokenize outside vocab", "/detokenize", {"tokens": [99999999]}, 400, "tokens"),
    Case("tokenize without API key", "/tokenize", {"prompt": "hi"}, 401, headers={}),
]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with RunningServer(api_key=API_KEY, max_request_body_bytes=MAX_BODY_BYTES) as running:
        yield running


def test_there_are_at_least_40_cases() -> None:
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request(case: Case, http: httpx.Client) -> None:
    headers = dict(case.headers)
    if case.raw is not None:
        content = case.raw
        headers.setdefault("Content-Type", "application/json")
    else:
        content = None if case.body is None else json.dumps(case.body).encode()
        if content is not None:
            headers["Content-Type"] = "application/json"
    response = http.request(case.method, case.path, content=content, headers=headers)
    assert response.status_code == case.status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["code"] == case.status
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.message_has is not None:
        assert case.message_has in error["message"]
    assert "Traceback" not in response.text and "/work/" not in response.text


def test_server_still_healthy_and_serving_after_bad_requests(http: httpx.Client) -> None:
    for case in CASES[:10]:
        http.post(case.path, content=case.raw or json.dumps(case.body).encode(), headers=AUTH)
    assert http.get("/health").status_code == 200
    ok = http.post(CHAT, json=chat(temperature=0), headers=AUTH)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_open_endpoints_need_no_key(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    version = http.get("/version").json()
    assert version["runner"] in ("v1", "v2") and version["runner_reason"]
    schema = http.get("/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]
    chat_schema = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "max_completion_tokens", "top_logprobs"} <= set(chat_schema["properties"])


def test_tokenize_round_trip(http: httpx.Client, server: RunningServer) -> None:
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}, headers=AUTH).json()
    assert tokens["tokens"] == server.state.tokenizer.encode("Hello world", add_special_tokens=True)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH).json()
    assert text["prompt"] == "Hello world"
    chat_tokens = http.post("/tokenize", json={"messages": MSGS}, headers=AUTH).json()
    rendered = server.state.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True)
    assert chat_tokens["tokens"] == server.state.tokenizer.encode(rendered)
