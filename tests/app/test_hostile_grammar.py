"""Hostile structured-output specs: each is refused with a 400 that names the limit, before
the first token, while the server keeps serving everyone else. Specs that overflowed the
grammar compiler's stack (a segfault of the API server), compiled for minutes on the engine
core's loop (every stream stalled), or failed only after the first token."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.actors.test_grammar_limits import lark_chain, ref_chain
from tests.app._hostile import hostile
from tests.app._server_fixtures import RunningServer
from tests.app.test_grammar_checker import slow_schema

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
COMPILE_TIMEOUT_S = 2.0
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with RunningServer(grammar_compile_timeout_s=COMPILE_TIMEOUT_S) as running:
        yield running


def _refused(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def _json_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _served(http: httpx.Client) -> None:
    answer = http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 4})
    assert answer.status_code == 200, answer.text


def test_specs_that_overflowed_the_compilers_stack_are_400s_naming_the_limit(
    server: RunningServer, http: httpx.Client
) -> None:
    chain = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "response_format": _json_schema(ref_chain(1000)),
    }
    assert len(json.dumps(chain)) > 90_000  # the probe's 94 KB body
    with hostile(server.url):
        _refused(http.post(CHAT, json=chain), "response_format", "at most 1024")
        _refused(
            http.post(
                CMPL, json={"prompt": "x", "max_tokens": 4, "guided_grammar": lark_chain(3000)}
            ),
            "guided_grammar",
            "at most 1000",
        )
    _served(http)


def test_a_schema_past_the_compile_budget_is_refused_and_other_streams_never_wait(
    server: RunningServer, http: httpx.Client
) -> None:
    gaps_s: list[float] = []
    streaming, refused_at = threading.Event(), threading.Event()

    def stream() -> None:  # until the refusal has come, then it hangs up
        body = {"messages": MESSAGES, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, timeout=120) as client:
            with client.stream("POST", CHAT, json=body) as events:
                last = time.monotonic()
                for line in events.iter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        if streaming.is_set():
                            gaps_s.append(now - last)
                        streaming.set()
                        last = now
                    if refused_at.is_set():
                        return

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(60)
    started = time.monotonic()
    schema = json.loads(slow_schema(350).text)  # the probe's 19 KB body: 10.7 s on the core
    refused = http.post(
        CHAT, json={"messages": MESSAGES, "max_tokens": 4, "response_format": _json_schema(schema)}
    )
    elapsed_s = time.monotonic() - started
    refused_at.set()
    reader.join()
    _refused(refused, "response_format", "--grammar-compile-timeout")
    assert COMPILE_TIMEOUT_S <= elapsed_s < COMPILE_TIMEOUT_S + 10
    assert gaps_s and max(gaps_s) < 1.0, max(gaps_s)


def test_thousands_of_choices_are_served_and_a_row_too_wide_is_refused_before_any_token(
    server: RunningServer, http: httpx.Client
) -> None:
    choices = [f"option {i}" for i in range(3000)]
    answer = http.post(
        CMPL, json={"prompt": "Pick one:", "max_tokens": 10, "guided_choice": choices}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] in choices
    one_of_many = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(1500)
        ]
    }
    for stream in (False, True):  # a 400, not a stream that fails after its first token
        _refused(
            http.post(
                CHAT,
                json={
                    "messages": MESSAGES,
                    "max_tokens": 4,
                    "stream": stream,
                    "response_format": _json_schema(one_of_many),
                },
            ),
            "response_format",
            "max is 2000",
        )
    over = {"anyOf": [{"type": "integer", "minimum": i} for i in range(2001)]}
    _refused(
        http.post(CMPL, json={"prompt": "x", "max_tokens": 4, "guided_json": over}),
        "guided_json",
        "at most 2000",
    )


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (CMPL, "guided_json"),
        (CHAT, "guided_json"),
        (CHAT, "response_format"),
        (CMPL, "structured_outputs"),
    ],
)
def test_a_schema_nested_deep_inside_a_string_is_a_400(
    server: RunningServer, http: httpx.Client, path: str, field: str
) -> None:
    deep = '{"type":"object","properties":{"a":' * 5000 + "{}" + "}}" * 5000
    value: Any = {
        "guided_json": deep,
        "response_format": _json_schema(deep),
        "structured_outputs": {"json": deep},
    }[field]
    prompt = {"prompt": "x"} if path == CMPL else {"messages": MESSAGES}
    with hostile(server.url):
        response = http.post(path, json={**prompt, "max_tokens": 4, field: value})
    assert response.status_code == 400, response.text
    assert "nests too deeply" in response.json()["error"]["message"]
