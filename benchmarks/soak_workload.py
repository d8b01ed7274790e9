"""The soak test's request mix: seeded, so a failing request can be replayed by its index.

Each request is one of: a well-formed chat or text completion (streamed or not, random
lengths and sampling parameters) that the client reads to the end; the same, but the client
disconnects at a random moment; or a malformed request that must be refused with a 4xx.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

Plan = Literal["complete", "disconnect", "malformed"]

_WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "warm",
    "mat",
    "while",
    "rain",
    "fell",
    "over",
    "the",
    "quiet",
    "town",
    "and",
    "people",
    "walked",
    "home",
    "talking",
    "about",
    "music",
    "science",
    "food",
    "travel",
    "history",
    "stars",
    "oceans",
    "and",
    "small",
    "robots",
    "that",
    "learn",
    "to",
    "write",
    "poems",
]
STOP_STRINGS = (".", " the", "\n", "!")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True)
class SoakMix:
    max_tokens: int = 16
    """max_tokens of each request is drawn from [1, max_tokens]."""
    disconnect_fraction: float = 0.2
    malformed_fraction: float = 0.05
    max_prompt_words: int = 40
    max_n: int = 2
    disconnect_within_s: float = 3.0
    """A disconnecting client hangs up at a moment drawn from [0, disconnect_within_s]:
    set it near the typical request latency to spread the hang-ups over queueing,
    prefill and streaming."""


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    plan: Plan
    path: str
    body: dict[str, Any] | None
    """The JSON body; None when `raw_body` is sent instead."""
    raw_body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    expected_status: int = 200
    disconnect_after_s: float = 0.0
    """For plan 'disconnect': how long the client reads before it closes the connection."""
    disconnect_after_events: int | None = None
    """For a streamed 'disconnect': close after this many data events (if that comes first)."""

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream"))


def plan_request(index: int, seed: int, mix: SoakMix) -> PlannedRequest:
    rng = random.Random(seed * 1_000_003 + index)
    roll = rng.random()
    if roll < mix.malformed_fraction:
        return _malformed(index, rng)
    plan: Plan = (
        "disconnect" if roll < mix.malformed_fraction + mix.disconnect_fraction else "complete"
    )
    chat = rng.random() < 0.5
    body = _sampling_fields(rng, mix)
    body["stream"] = rng.random() < 0.5
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    else:
        body["return_token_ids"] = True
    if chat:
        body["messages"] = _messages(rng, mix)
        if rng.random() < 0.2:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
    else:
        body["prompt"] = _words(rng, mix.max_prompt_words)
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 3)
    return PlannedRequest(
        index=index,
        plan=plan,
        path=CHAT if chat else COMPLETIONS,
        body=body,
        disconnect_after_s=rng.uniform(0.0, mix.disconnect_within_s),
        disconnect_after_events=rng.randint(0, 4) if rng.random() < 0.5 else None,
    )


def _sampling_fields(rng: random.Random, mix: SoakMix) -> dict[str, Any]:
    max_tokens = rng.randint(1, mix.max_tokens)
    body: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": rng.choice((0.0, 0.0, 0.7, 1.0, 1.5)),
    }
    if rng.random() < 0.3:
        body["top_p"] = rng.choice((0.5, 0.9, 1.0))
    if rng.random() < 0.3:
        body["top_k"] = rng.choice((-1, 1, 5, 50))
    if rng.random() < 0.2:
        body["min_p"] = rng.choice((0.0, 0.05, 0.2))
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**32)
    if rng.random() < 0.2:
        body["n"] = rng.randint(1, mix.max_n)
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if rng.random() < 0.25:
        body["ignore_eos"] = True
    if rng.random() < 0.2:
        body["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.15:
        body["presence_penalty"] = rng.choice((-1.0, 0.5, 1.5))
        body["frequency_penalty"] = rng.choice((-0.5, 0.0, 1.0))
    if rng.random() < 0.1:
        body["repetition_penalty"] = rng.choice((0.8, 1.2))
    return body


def _words(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max_words)))


def _messages(rng: random.Random, mix: SoakMix) -> list[dict[str, str]]:
    turns = rng.randint(1, 3)
    roles = ["user" if i % 2 == 0 else "assistant" for i in range(2 * turns - 1)]
    messages = [
        {"role": role, "content": _words(rng, mix.max_prompt_words // 2 or 1)} for role in roles
    ]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "You are terse."})
    return messages


_JSON = {"Content-Type": "application/json"}
_MALFORMED: tuple[tuple[str, dict[str, Any] | None, bytes | None, dict[str, str], int], ...] = (
    (CHAT, None, b'{"messages": [', _JSON, 400),
    (CHAT, None, b"[1, 2, 3]", _JSON, 400),
    (CHAT, {"messages": []}, None, {}, 400),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, None, {}, 400),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, None, {}, 400),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, None, {}, 400),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"},
        None,
        {},
        400,
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"},
        None,
        {},
        404,
    ),
    (COMPLETIONS, {"prompt": 5}, None, {}, 400),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, None, {}, 400),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"x": 1}}, None, {}, 400),
    (COMPLETIONS, None, b"prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
)


def _malformed(index: int, rng: random.Random) -> PlannedRequest:
    path, body, raw, headers, status = rng.choice(_MALFORMED)
    return PlannedRequest(
        index=index,
        plan="malformed",
        path=path,
        body=body,
        raw_body=raw,
        headers=dict(headers),
        expected_status=status,
    )
