"""The conversations of benchmarks.multi_turn and how one client holds them: the run's
settings, the seeded texts (sized in tokens by a tokenizer, or by the server's tokens per
word), each turn's messages and streamed request, and one client's share of conversations
run turn after turn."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

import anyio
import httpx

from benchmarks.serve_clients import Share
from benchmarks.serve_config import ServeConfig
from benchmarks.stream_client import auth_headers, stream_request
from benchmarks.workloads import text_prompts

STREAM = {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
"""Every request's (with the model, max_tokens and temperature)."""


@dataclass(frozen=True, slots=True)
class Settings:
    target: ServeConfig  # base_url, model, api key, timeouts (its workload is unused)
    conversations: int
    turns: int
    system_len: int
    user_len: int
    answer_len: int
    concurrency: int
    clients: int
    temperature: float
    seed: int
    tokenizer: str | None
    token_ids: bool = False
    """Turns go to /v1/completions as token ids, each answer's exact ids sent back."""
    think_time_s: float = 0.0
    """Pause before each later turn, with the conversation's slot given up meanwhile (0: a
    conversation holds its slot for all its turns, the next turn sent at once)."""


@dataclass(frozen=True, slots=True)
class TurnRecord:
    conversation: int
    turn: int  # from 1
    success: bool
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    system: str
    users: tuple[str, ...]
    system_ids: tuple[int, ...] = ()  # the texts as token ids (Settings.token_ids)
    user_ids: tuple[tuple[int, ...], ...] = ()


def build_conversations(settings: Settings, tokens_per_word: float, tokenizer: Any) -> list[Any]:
    """Seeded texts: one system prompt shared by all, `turns` user turns per conversation;
    with `settings.token_ids` also their ids (the tokenizer is needed then)."""
    n, turns = settings.conversations, settings.turns

    def texts(count: int, length: int, seed: int) -> list[str]:
        if length == 0 or tokenizer is not None:
            return text_prompts(count, length, seed, tokenizer) if length else [""] * count
        return text_prompts(count, max(1, round(length / tokens_per_word)), seed)

    (system,) = texts(1, settings.system_len, settings.seed)
    users = texts(n * turns, settings.user_len, settings.seed + 1)
    chats = [Conversation(c, system, tuple(users[c * turns : (c + 1) * turns])) for c in range(n)]
    if not settings.token_ids:
        return chats

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text)) if text else ()

    return [replace(c, system_ids=ids(c.system), user_ids=tuple(map(ids, c.users))) for c in chats]


def turn_messages(conversation: Conversation, answers: list[str]) -> list[dict[str, str]]:
    """The messages of the turn after `answers`: the system prompt, each earlier user turn
    followed by its answer, then the next user turn."""
    messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
    for user, answer in zip(conversation.users, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": conversation.users[len(answers)]}]


async def tokens_per_word(settings: Settings, model: str) -> float:
    """The server's tokens per word of this benchmark's text (1.0 if /tokenize fails)."""
    body = {"prompt": text_prompts(1, 400, 0)[0], "add_special_tokens": False, "model": model}
    headers = auth_headers(settings.target.api_key)
    try:
        async with httpx.AsyncClient(base_url=settings.target.base_url, headers=headers) as client:
            response = await client.post("/tokenize", json=body, timeout=60)
        return float(response.json()["count"]) / 400 if response.status_code == 200 else 1.0
    except (httpx.HTTPError, ValueError, KeyError):
        return 1.0


async def chat_turn(
    client: httpx.AsyncClient, base: dict[str, Any], chat: Conversation, answers: list[str]
) -> tuple[TurnRecord, str]:
    """Send the turn after `answers` (`base`: the rest of the body); its record and text."""
    body = {**base, "messages": turn_messages(chat, answers)}
    pieces: list[str] = []

    def keep_text(event: dict[str, Any]) -> None:
        pieces.extend((c.get("delta") or {}).get("content") or "" for c in event.get("choices", ()))

    r = await stream_request(client, "/v1/chat/completions", body, keep_text)
    tokens = (r.prompt_tokens, r.cached_prompt_tokens, r.output_tokens)
    record = TurnRecord(chat.index, len(answers) + 1, r.success, r.ttft_s, *tokens, r.error)
    return record, "".join(pieces)


async def token_turn(
    client: httpx.AsyncClient,
    base: dict[str, Any],
    chat: Conversation,
    answers: list[tuple[int, ...]],
) -> tuple[TurnRecord, tuple[int, ...]]:
    """The turn after `answers` as one token-id prompt: the system prompt, each earlier
    user turn followed by its answer's exact ids, then the next user turn; no template."""
    prompt = list(chat.system_ids)
    for user, answer in zip(chat.user_ids, answers, strict=False):
        prompt += [*user, *answer]
    body = {**base, "prompt": [*prompt, *chat.user_ids[len(answers)]], "return_token_ids": True}
    answer_ids: list[int] = []

    def keep_ids(event: dict[str, Any]) -> None:
        answer_ids.extend(i for c in event.get("choices", ()) for i in c.get("token_ids") or ())

    r = await stream_request(client, "/v1/completions", body, keep_ids)
    tokens = (r.prompt_tokens, r.cached_prompt_tokens, r.output_tokens)
    record = TurnRecord(chat.index, len(answers) + 1, r.success, r.ttft_s, *tokens, r.error)
    return record, tuple(answer_ids)


async def run_share(
    settings: Settings, model: str, share: Share, barrier: Any
) -> tuple[list[TurnRecord], float, float]:
    """One client's conversations (`share.prompts`): their records, start and end."""
    limiter, records = anyio.Semaphore(share.concurrency), []
    base = {**STREAM, "model": model, "max_tokens": settings.answer_len}
    base["temperature"] = settings.temperature
    async with httpx.AsyncClient(
        base_url=settings.target.base_url,
        limits=httpx.Limits(max_connections=share.concurrency + 8),
        timeout=httpx.Timeout(settings.target.timeout_s, connect=30.0),
        headers=auth_headers(settings.target.api_key),
    ) as client:
        send_turn: Any = token_turn if settings.token_ids else chat_turn

        thinking = settings.think_time_s > 0
        conversation_slot = contextlib.nullcontext() if thinking else limiter
        turn_slot = limiter if thinking else contextlib.nullcontext()

        async def converse(chat: Conversation) -> None:
            async with conversation_slot:
                answers: list[Any] = []  # texts, or id tuples with token_ids
                while len(answers) < settings.turns:
                    if answers and thinking:
                        await anyio.sleep(settings.think_time_s)
                    async with turn_slot:
                        record, answer = await send_turn(client, base, chat, answers)
                    records.append(record)
                    if not record.success:
                        return  # no answer to build the next turn on
                    answers.append(answer)

        if barrier is not None:
            await anyio.to_thread.run_sync(barrier.wait)
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for chat in share.prompts:
                tg.start_soon(converse, chat)
    return records, started, time.monotonic()
