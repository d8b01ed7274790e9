"""`python -m benchmarks.multi_turn --token-ids`: turns sent to /v1/completions as token ids,
each answer's exact streamed ids carried into the next turn (a fake server, httpx's
MockTransport: no server starts)."""

from __future__ import annotations

import functools
import json
from typing import Any

import httpx
import orjson
import pytest

from app.tokenizer_loader import load_tokenizer
from benchmarks import multi_turn
from benchmarks.multi_turn import parse_args
from benchmarks.multi_turn_chat import Settings, build_conversations


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


class FakeCompletions:
    """Streams an answer of ids [1000 * turn + k] over two chunks, with usage that counts
    everything before the last user turn as cached; keeps every request body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0"})
        body = json.loads(request.content)
        assert request.url.path == "/v1/completions" and body["return_token_ids"] is True
        self.bodies.append(body)
        turn = len(self.bodies)
        ids = [1000 * turn + k for k in range(body["max_tokens"])]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}
        usage["prompt_tokens_details"] = {"cached_tokens": len(body["prompt"]) // 2}
        return httpx.Response(
            200,
            content=_sse(
                {"choices": [{"index": 0, "text": "x", "token_ids": ids[:1]}]},
                {"choices": [{"index": 0, "text": "y", "token_ids": ids[1:]}]},
                {"choices": [], "usage": usage},
            ),
        )


def test_each_turn_sends_the_earlier_answers_exact_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    server = FakeCompletions()
    client = functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(server))
    monkeypatch.setattr(httpx, "AsyncClient", client)
    monkeypatch.setattr(multi_turn, "read_counters", lambda url, key=None: {})
    flags = "--conversations 1 --concurrency 1 --turns 3 --system-len 6 --user-len 4"
    settings: Settings = parse_args(
        [*flags.split(), "--answer-len", "3", "--tokenizer", "default", "--token-ids"]
    ).settings
    details = multi_turn.run(settings)
    assert details["overall"]["failed"] == 0 and [t["requests"] for t in details["turns"]] == [
        1,
        1,
        1,
    ]
    tokenizer = load_tokenizer("default")
    (chat,) = build_conversations(settings, 1.0, tokenizer)
    assert chat.system_ids == tuple(tokenizer.encode(chat.system)) and len(chat.system_ids) == 6
    assert [len(u) for u in chat.user_ids] == [4, 4, 4]
    answers = [[1000, 1001, 1002], [2000, 2001, 2002]]
    system, users = list(chat.system_ids), [list(u) for u in chat.user_ids]
    assert [b["prompt"] for b in server.bodies] == [
        system + users[0],
        system + users[0] + answers[0] + users[1],
        system + users[0] + answers[0] + users[1] + answers[1] + users[2],
    ]


def test_token_ids_need_the_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--token-ids"])
    assert "--token-ids needs --tokenizer" in capsys.readouterr().err
