"""`tandem serve` through the official `openai` client, against a real Hypercorn."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.app._server_fixtures import RunningServer, openai_client

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = RunningServer()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat_prompt_len(server: RunningServer, messages: list[dict[str, str]]) -> int:
    tokenizer = server.state.tokenizer
    return len(
        tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    )


def test_models_list_and_retrieve(client: openai.OpenAI, model: str) -> None:
    assert model == "SmolLM2-135M-Instruct"
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    alias = client.models.retrieve("default")  # the alias given on the command line
    assert alias.id == "default"


def test_chat_non_stream_answers_and_counts_usage(
    client: openai.OpenAI, model: str, server: RunningServer
) -> None:
    out = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=0
    )
    choice = out.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.usage.prompt_tokens == _chat_prompt_len(server, QUESTION)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert 0 < out.usage.completion_tokens <= 16


def test_exact_usage_with_max_completion_tokens(
    client: openai.OpenAI, model: str, server: RunningServer
) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=STORY,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    prompt_len = _chat_prompt_len(server, STORY)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        prompt_len,
        5,
        prompt_len + 5,
    )


def test_stream_equals_non_stream_at_temperature_zero(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "messages": STORY, "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert roles == ["assistant"] and len(finishes) == 1
    assert len({c.id for c in chunks}) == 1 and all(c.usage is None for c in chunks)


def test_stream_include_usage_puts_usage_on_a_last_empty_chunk(
    client: openai.OpenAI, model: str
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    num_texts = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert 0 < last.usage.completion_tokens <= 6 and num_texts >= 1


def test_continuous_usage_stats_grow_to_the_last_token(client: openai.OpenAI, model: str) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=STORY,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"min_tokens": 10},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 10


def test_n2_non_stream_and_stream(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=STORY,
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=7,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in out.choices] == [0, 1]
    num_tokens = [len(c.model_extra["token_ids"]) for c in out.choices]
    assert out.usage.completion_tokens == sum(num_tokens) and all(n > 0 for n in num_tokens)
    stream = list(
        client.chat.completions.create(
            model=model, messages=STORY, max_tokens=8, n=2, temperature=1.0, seed=7, stream=True
        )
    )
    texts = {0: "", 1: ""}
    finishes = {0: 0, 1: 0}
    for chunk in stream:
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        finishes[choice.index] += choice.finish_reason is not None
    assert finishes == {0: 1, 1: 1}
    # Seeded: the stream reproduces the non-stream samples choice by choice.
    assert texts == {0: out.choices[0].message.content, 1: out.choices[1].message.content}


def test_streamed_completion_carries_its_token_ids(client: openai.OpenAI, model: str) -> None:
    """With return_token_ids, each chunk carries its own ids and a choice's first chunk the
    prompt's: a client can send the exact conversation back as tokens."""
    kwargs: dict[str, Any] = {"model": model, "prompt": "Once upon a time", "max_tokens": 10}
    kwargs |= {"temperature": 0, "n": 2, "extra_body": {"return_token_ids": True}}
    whole = client.completions.create(**kwargs)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list[list[int]]] = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_extra["token_ids"]
            if "prompt_token_ids" in choice.model_extra:
                prompts[choice.index].append(choice.model_extra["prompt_token_ids"])
    for choice in whole.choices:
        assert streamed[choice.index] == choice.model_extra["token_ids"]
        assert len(streamed[choice.index]) == 10
        assert prompts[choice.index] == [choice.model_extra["prompt_token_ids"]]
    plain = client.completions.create(stream=True, **{**kwargs, "extra_body": {}})
    assert all("token_ids" not in (c.model_extra or {}) for ch in plain for c in ch.choices)


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, model: str) -> None:
    def sample(seed: int) -> str:
        return (
            client.chat.completions.create(
                model=model, messages=STORY, max_tokens=12, temperature=1.0, seed=seed
            )
            .choices[0]
            .message.content
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=5
    )
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 5
        assert -9999.0 <= entry.logprob <= 0.0
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert bytes(entry.bytes) == entry.token.encode("utf-8")  # an ASCII answer
    zero = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True, top_logprobs=0
    )
    assert all(e.top_logprobs == [] for e in zero.choices[0].logprobs.content)
    none = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=3, temperature=0
    )
    assert none.choices[0].logprobs is None


def test_stop_string_cuts_the_text(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "messages": STORY, "max_tokens": 30, "temperature": 0}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    words = full.split()
    stop = " " + words[len(words) // 2]
    cut = full[: full.index(stop)]
    out = client.chat.completions.create(stop=[stop], **kwargs)
    choice = out.choices[0]
    assert choice.message.content == cut
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    kept = client.chat.completions.create(
        stop=[stop], extra_body={"include_stop_str_in_output": True}, **kwargs
    )
    assert kept.choices[0].message.content == cut + stop


def test_completions_text_and_token_ids_agree(
    client: openai.OpenAI, model: str, server: RunningServer
) -> None:
    prompt = "The quick brown fox"
    token_ids = server.state.tokenizer.encode(prompt)
    by_text = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=token_ids, max_tokens=8, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(token_ids) == by_ids.usage.prompt_tokens
    batch = client.completions.create(
        model=model, prompt=[prompt, "Once upon a time"], n=2, max_tokens=4, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy samples of one prompt
    assert batch.choices[0].text == by_text.choices[0].text[: len(batch.choices[0].text)]
    id_batch = client.completions.create(
        model=model, prompt=[token_ids, token_ids[:2]], max_tokens=4, temperature=0
    )
    assert id_batch.usage.prompt_tokens == len(token_ids) + 2


def test_completions_echo_logprobs_and_stream_index(client: openai.OpenAI, model: str) -> None:
    echoed = client.completions.create(
        model=model, prompt="Hello there", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith("Hello there")
    out = client.completions.create(
        model=model, prompt="Hello there", max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text
    chunks = list(
        client.completions.create(
            model=model, prompt=["A", "B"], max_tokens=3, temperature=0, stream=True
        )
    )
    assert all(len(c.choices) == 1 for c in chunks)
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_content_parts_equal_string_content(client: openai.OpenAI, model: str) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}
    ]
    a = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    b = client.chat.completions.create(model=model, messages=parts, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_unknown_fields_are_ignored(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=2,
        temperature=0,
        extra_body={"some_vendor_field": 1},
    )
    assert out.choices[0].message.content


def test_cached_tokens_reported_for_a_repeated_prompt(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "Answer in one word. " * 12}, *QUESTION]
    block_size = 16

    def usage() -> openai.types.CompletionUsage:
        return client.chat.completions.create(
            model=model, messages=messages, max_tokens=2, temperature=0
        ).usage

    first, second = usage(), usage()
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    # Whole blocks of the prompt come from the prefix cache; at least the last token is
    # always computed again.
    assert cached % block_size == 0
    assert second.prompt_tokens - 2 * block_size <= cached < second.prompt_tokens
