"""`python -m benchmarks.multi_turn`: the conversations it builds, a whole run against a fake
server (httpx's MockTransport: no server starts), and the command line (the figures:
test_multi_turn_figures.py)."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from app.tokenizer_loader import load_tokenizer
from benchmarks import multi_turn
from benchmarks.multi_turn import parse_args
from benchmarks.multi_turn_chat import (
    STREAM,
    Conversation,
    Settings,
    TurnRecord,
    build_conversations,
    chat_turn,
    turn_messages,
)
from benchmarks.multi_turn_figures import describe


def _settings(*flags: str) -> Settings:
    settings: Settings = parse_args(list(flags)).settings
    return settings


def test_each_turn_carries_the_earlier_turns_and_their_answers() -> None:
    chat = Conversation(3, "be brief", ("u1", "u2", "u3"))
    assert turn_messages(chat, []) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "u1"},
    ]
    assert turn_messages(chat, ["a1", "a2"]) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]
    # --system-len 0: no system message at all.
    assert turn_messages(Conversation(0, "", ("u1",)), []) == [{"role": "user", "content": "u1"}]


def test_conversations_share_the_system_prompt_and_are_sized_in_tokens() -> None:
    settings = _settings("--conversations", "3", "--turns", "2", "--system-len", "40")
    settings = replace(settings, user_len=7)
    tokenizer = load_tokenizer("default")
    assert tokenizer is not None
    chats = build_conversations(settings, 1.0, tokenizer)
    assert [c.index for c in chats] == [0, 1, 2] and {c.system for c in chats} == {chats[0].system}
    assert len(tokenizer.encode(chats[0].system)) == 40
    users = [u for c in chats for u in c.users]
    assert [len(c.users) for c in chats] == [2, 2, 2] and len(set(users)) == 6
    assert [len(tokenizer.encode(u)) for u in users] == [7] * 6
    assert build_conversations(settings, 1.0, tokenizer) == chats  # seeded
    seeded = replace(settings, seed=1)
    assert build_conversations(seeded, 1.0, tokenizer)[0].users != chats[0].users
    # Without a tokenizer: words sized by the server's tokens per word.
    words = build_conversations(settings, 2.0, None)
    assert len(words[0].system.split()) == 20 and len(words[0].users[0].split()) == 4
    none = build_conversations(replace(settings, system_len=0), 1.0, tokenizer)
    assert none[0].system == ""


# ---- a fake server ------------------------------------------------------------------------


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


class FakeServer:
    """/v1/models, /version, /tokenize (2 tokens a word) and streamed chat completions: the
    answer names the conversation's first user words and the turn; usage counts a token per
    word, all but the last user message as cached."""

    def __init__(self, fail_turn: int | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail_turn = fail_turn

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        if path == "/version":
            return httpx.Response(200, json={"version": "0"})
        body = json.loads(request.content)
        if path == "/tokenize":
            return httpx.Response(200, json={"count": 2 * len(body["prompt"].split())})
        self.bodies.append(body)
        messages = body["messages"]
        turn = sum(1 for m in messages if m["role"] == "user")
        if turn == self.fail_turn:
            return httpx.Response(503, text="busy")
        words = [len(m["content"].split()) for m in messages]
        first = next(m for m in messages if m["role"] == "user")["content"].split()[0]
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        usage = {
            "prompt_tokens": sum(words),
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": sum(words[:-1])},
        }
        return httpx.Response(
            200,
            content=_sse(
                role,
                {"choices": [{"index": 0, "delta": {"content": f"{first} said"}}]},
                {"choices": [{"index": 0, "delta": {"content": f" turn {turn}"}}]},
                {"choices": [], "usage": usage},
            ),
        )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    server = FakeServer()
    client = functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(server))
    monkeypatch.setattr(httpx, "AsyncClient", client)
    counts = iter([{"vllm:prefix_cache_hits_total": 5.0}, {"vllm:prefix_cache_hits_total": 9.0}])
    # multi_turn.run calls read_counters by the name it imported into benchmarks.multi_turn.
    monkeypatch.setattr(multi_turn, "read_counters", lambda url, key=None: next(counts))
    return server


async def test_a_turn_sends_its_history_and_returns_the_answer_text(fake: FakeServer) -> None:
    chat = Conversation(5, "sys", ("alpha beta", "gamma"))
    base = {**STREAM, "model": "fake", "max_tokens": 3, "temperature": 0.0}
    async with httpx.AsyncClient(base_url="http://fake") as client:
        record, answer = await chat_turn(client, base, chat, [])
        assert answer == "alpha said turn 1"
        assert record == TurnRecord(5, 1, True, record.ttft_s, 3, 1, 3, "")
        record, answer = await chat_turn(client, base, chat, [answer])
    assert (record.turn, record.prompt_tokens, record.cached_tokens) == (2, 8, 7)
    body = fake.bodies[-1]
    assert body["messages"][2] == {"role": "assistant", "content": "alpha said turn 1"}
    assert body["ignore_eos"] is True and body["max_tokens"] == 3
    assert body["stream_options"] == {"include_usage": True}


def test_a_whole_run_against_the_fake_server(fake: FakeServer) -> None:
    flags = "--conversations 4 --turns 3 --system-len 10 --user-len 4 --answer-len 5"
    settings = _settings(*flags.split(), "--concurrency", "2")
    details = multi_turn.run(settings)
    assert details["model"] == "fake" and details["sized_by"] == "2.000 tokens/word"
    assert len(fake.bodies) == 12
    # The fake counts one token a word: system 5 words, users 2, answers "<word> said turn k".
    turns = details["turns"]
    assert [t["requests"] for t in turns] == [4, 4, 4]
    assert [t["prompt_tokens_mean"] for t in turns] == [7, 7 + 4 + 2, 13 + 4 + 2]
    assert [t["cached_tokens_mean"] for t in turns] == [5, 11, 17]
    assert [t["computed_prefill_tokens_mean"] for t in turns] == [2, 2, 2]
    assert [t["prior_context_tokens_mean"] for t in turns] == [None, 12, 18]
    o = details["overall"]
    assert (o["requests"], o["failed"], o["output_tokens"], o["answer_len_mismatches"]) == (
        12,
        0,
        60,
        0,
    )
    assert o["prefill_tokens_computed"] == 24 and o["hit_rate"] == pytest.approx(132 / 156)
    assert details["server_counters"]["vllm:prefix_cache_hits_total"] == 4.0
    assert all(isinstance(line, str) for line in describe(details))


def test_a_failed_turn_ends_its_conversation(fake: FakeServer) -> None:
    fake.fail_turn = 2
    settings = _settings("--conversations", "2", "--turns", "3", "--system-len", "4")
    details = multi_turn.run(replace(settings, user_len=2, answer_len=2))
    assert [(t["requests"], t["failed"]) for t in details["turns"]] == [(2, 0), (0, 2), (0, 0)]
    assert details["overall"]["errors"] == ["HTTP 503: busy"]
    assert details["turns"][2]["ttft_p50_ms"] is None
    assert any(line.startswith("first error") for line in describe(details))


def _conversation_order(fake: FakeServer) -> list[str]:
    """Each request's conversation (its first user word), in the order the server got them."""
    return [next(m for m in b["messages"] if m["role"] == "user")["content"] for b in fake.bodies]


def test_think_time_gives_the_slot_to_other_conversations_between_turns(
    fake: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(multi_turn, "read_counters", lambda url, key=None: {})
    flags = "--conversations 2 --turns 2 --system-len 4 --user-len 2 --answer-len 2"
    held = multi_turn.run(_settings(*flags.split(), "--concurrency", "1"))
    held_order = _conversation_order(fake)
    fake.bodies.clear()
    thinking = _settings(*flags.split(), "--concurrency", "1", "--think-time", "0.2")
    assert thinking.think_time_s == 0.2
    multi_turn.run(thinking)
    think_order = _conversation_order(fake)
    first, second = held_order[0], held_order[2]
    assert first != second and held["overall"]["failed"] == 0
    # Held: one conversation's turns back to back. Thinking: the other's first turn comes
    # while the first conversation pauses.
    assert held_order == [first, first, second, second]
    assert think_order == [first, second, first, second]


# ---- figures ------------------------------------------------------------------------------


# ---- the command line ---------------------------------------------------------------------


def test_defaults_are_the_issue_workload() -> None:
    s = _settings()
    assert (s.conversations, s.turns, s.system_len, s.user_len, s.answer_len) == (
        128,
        8,
        1000,
        200,
        300,
    )
    assert (s.concurrency, s.clients, s.temperature, s.tokenizer) == (64, 1, 0.0, None)
    assert s.target.base_url == "http://127.0.0.1:8000" and s.target.model is None
    s = _settings("--base-url", "http://h:1/v1/", "--model", "m", "--api-key", "k")
    assert (s.target.base_url, s.target.model, s.target.api_key) == ("http://h:1", "m", "k")
    assert s.target.ready_timeout_s == 60.0
    assert _settings("--server", "--device cpu").target.ready_timeout_s == 600.0  # it starts
    assert parse_args(["--compare", "a.json", "b.json"]).compare == [Path("a.json"), Path("b.json")]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--turns", "0"], "--turns"),
        (["--conversations", "0"], "--conversations"),
        (["--system-len", "-1"], "--system-len"),
        (["--answer-len", "0"], "--answer-len"),
        (["--concurrency", "0"], "--concurrency"),
        (["--clients", "3", "--concurrency", "2"], "--clients"),
        (["--think-time", "-1"], "--think-time"),
        (["--base-url", "127.0.0.1:8000"], "--base-url"),
        (["--server", "--device cpu", "--compare", "a", "b"], "not allowed with"),
        (["--base-url", "http://h:1", "--server", "--device cpu"], "not allowed with"),
    ],
)
def test_bad_flags_name_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
