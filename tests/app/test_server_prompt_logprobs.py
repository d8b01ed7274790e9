"""Prompt logprobs over HTTP: completions echo + logprobs exactly as lm-eval's
local-completions sends and reads it (loglikelihood), vLLM's prompt_logprobs field on chat
and completions, against transformers' log_softmax on the same weights; and lm-eval itself
running a multiple-choice task from a local dataset file through local-completions, with
the server's remote tokenizer endpoints. The server runs the float32 model (--quantization
none), which is what transformers computes."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests._hf_reference import hf_reference_model
from tests.app._server_fixtures import ENGINE, RunningServer, openai_client

pytestmark = pytest.mark.slow

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATIONS = (" Paris", " Berlin is a city")
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Tokyo"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["seven", "four"], "answer": 1},
    {"question": "The sky on a clear day is", "choices": ["blue", "green"], "answer": 0},
]
TASK = """task: tandem_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


FLOAT32_ENGINE = dataclasses.replace(ENGINE, quantization="none", num_kv_blocks=256)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = RunningServer(engine=FLOAT32_ENGINE)  # on the session's float32 model
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@functools.cache
def _reference_logprobs(token_ids: tuple[int, ...]) -> torch.Tensor:  # [len - 1, vocab]
    with torch.no_grad():
        logits = hf_reference_model()(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _tokens(server: RunningServer, text: str) -> list[int]:
    return server.state.tokenizer.encode(text)


def test_lm_eval_loglikelihood_request(server: RunningServer, http: httpx.Client) -> None:
    """lm-eval's local-completions with tokenized requests: the context and continuation
    token ids as the prompt, echo, logprobs=1, max_tokens=1, temperature 0; it sums the
    continuation's token_logprobs and checks each is the top one (is_greedy)."""
    context = _tokens(server, CONTEXT)
    results = []
    for continuation in CONTINUATIONS:
        prompt = context + _tokens(server, continuation)
        body = http.post(
            "/v1/completions",
            json={
                "model": "default",
                "prompt": prompt,
                "temperature": 0,
                "max_tokens": 1,
                "logprobs": 1,
                "seed": 1234,
                "echo": True,
            },
        ).json()
        logprobs = body["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(prompt) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        reference = _reference_logprobs(tuple(prompt))
        expected = reference.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = torch.tensor(logprobs["token_logprobs"][1 : len(prompt)])
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
        ctxlen = len(context)
        scored = logprobs["token_logprobs"][ctxlen:-1]
        tops = logprobs["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(scored, tops))
        greedy_ids = reference[ctxlen - 1 :].argmax(-1).tolist()
        assert is_greedy == (greedy_ids == prompt[ctxlen:])
        results.append(sum(scored))
        assert body["choices"][0]["text"].startswith(server.state.tokenizer.decode(prompt))
    assert results[0] > results[1]  # Paris beats a wrong, longer answer


def test_prompt_logprobs_field_on_completions_and_chat(
    server: RunningServer, http: httpx.Client
) -> None:
    prompt = _tokens(server, CONTEXT)
    body = http.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3}
    ).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    reference = _reference_logprobs(tuple(prompt))
    for position, entry in enumerate(entries[1:], start=1):
        token = str(prompt[position])
        top3 = reference[position - 1].topk(3).indices.tolist()
        assert {str(t) for t in top3} <= set(entry) and token in entry
        assert {entry[str(t)]["rank"] for t in top3} == {1, 2, 3}
        assert entry[token]["logprob"] == pytest.approx(
            reference[position - 1, prompt[position]].item(), abs=2e-3
        )
    assert body["choices"][0]["logprobs"] is None  # no echo: output logprobs not asked
    chat = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "prompt_logprobs": 0,
        },
    ).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_a_cached_prefix_still_yields_prompt_logprobs(
    server: RunningServer, http: httpx.Client
) -> None:
    prompt = _tokens(server, CONTEXT * 4)  # several full KV blocks
    plain = {"prompt": prompt, "max_tokens": 1}
    assert http.post("/v1/completions", json=plain).status_code == 200
    again = http.post("/v1/completions", json=plain).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    scored = http.post("/v1/completions", json={**plain, "prompt_logprobs": 0}).json()
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    entries = scored["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and all(e is not None for e in entries[1:])


def _reference_loglikelihood(tokenizer: object, context_text: str, continuation_text: str) -> float:
    """As lm-eval splits a request: the whole text's tokens, the context's tokens first."""
    whole = tokenizer.encode(context_text + continuation_text)  # type: ignore[attr-defined]
    context = tokenizer.encode(context_text)  # type: ignore[attr-defined]
    logprobs = _reference_logprobs(tuple(whole))
    return sum(logprobs[p - 1, whole[p]].item() for p in range(len(context), len(whole)))


def test_local_completions_loglikelihood_task(server: RunningServer, tmp_path: Path) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": server.url + "/v1/completions",
            "model": "default",
            "tokenizer_backend": "remote",
            "num_concurrent": 2,
            "max_retries": 1,
        },
        tasks=["tandem_tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
        limit=len(DOCS),
    )
    assert results is not None
    samples = results["samples"]["tandem_tiny_mc"]
    assert len(samples) == len(DOCS)
    tokenizer = server.state.tokenizer
    for sample in samples:
        doc = sample["doc"]
        for choice, response in zip(doc["choices"], sample["resps"]):
            loglikelihood, _ = response[0]
            # lm-eval's default target delimiter joins the question and each choice.
            expected = _reference_loglikelihood(tokenizer, doc["question"], " " + choice)
            assert loglikelihood == pytest.approx(expected, abs=5e-3)
    accuracy = results["results"]["tandem_tiny_mc"]["acc,none"]
    assert 0.0 <= accuracy <= 1.0


def _by_index(chunks: list[dict]) -> dict[int, list[dict]]:
    choices: dict[int, list[dict]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            choices.setdefault(choice["index"], []).append(choice)
    return choices


def _joined_logprobs(pieces: list[dict]) -> dict[str, list]:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for p in pieces if p["logprobs"] for v in p["logprobs"][k]] for k in keys}


def test_streamed_echo_with_logprobs_equals_the_response(server: RunningServer) -> None:
    """Each choice's first chunk (n=2, two prompts) echoes its prompt with the prompt's
    logprobs before any generated text; its chunks put together equal the response."""
    client = openai_client(server)
    prompts = [_tokens(server, CONTEXT), _tokens(server, "The capital of France is")]
    kwargs = {
        "model": "default",
        "prompt": prompts,
        "n": 2,
        "max_tokens": 4,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
    }
    whole = client.completions.create(**kwargs).model_dump()["choices"]
    streamed = _by_index([c.model_dump() for c in client.completions.create(stream=True, **kwargs)])
    assert sorted(streamed) == [c["index"] for c in whole] == [0, 1, 2, 3]
    for choice in whole:
        pieces = streamed[choice["index"]]
        prompt_ids = prompts[choice["index"] // 2]
        first = pieces[0]["logprobs"]
        assert pieces[0]["text"].startswith(server.state.tokenizer.decode(prompt_ids))
        assert len(first["tokens"]) > len(prompt_ids) and first["token_logprobs"][0] is None
        assert "".join(p["text"] for p in pieces) == choice["text"]
        assert pieces[0]["prompt_logprobs"] == choice["prompt_logprobs"]
        assert all("prompt_logprobs" not in p or p["prompt_logprobs"] is None for p in pieces[1:])
        joined, expected = _joined_logprobs(pieces), choice["logprobs"]
        assert joined["tokens"] == expected["tokens"]
        assert joined["text_offset"] == expected["text_offset"]
        assert joined["token_logprobs"][0] is None and joined["top_logprobs"][0] is None
        assert joined["token_logprobs"][1:] == pytest.approx(
            expected["token_logprobs"][1:], abs=1e-4
        )
        assert joined["top_logprobs"][1:] == [
            pytest.approx(top, abs=1e-4) for top in expected["top_logprobs"][1:]
        ]


def _sse_chunks(server: RunningServer, path: str, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", server.url + path, json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        raw = b"".join(response.iter_raw()).decode()
    events = [e for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def test_streamed_prompt_logprobs_field_on_the_first_chunk(
    server: RunningServer, http: httpx.Client
) -> None:
    """vLLM's prompt_logprobs in a stream: on each completions choice's first chunk (no
    echo: no prompt text), once at the top of a chat stream's first chunk."""
    prompt = _tokens(server, CONTEXT)
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    pieces = _by_index(_sse_chunks(server, "/v1/completions", body))[0]
    assert pieces[0]["prompt_logprobs"] == _close(whole["prompt_logprobs"])
    assert all("prompt_logprobs" not in p for p in pieces[1:])
    assert "".join(p["text"] for p in pieces) == whole["text"]
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "prompt_logprobs": 0,
        "n": 2,
    }
    expected = http.post("/v1/chat/completions", json=chat).json()["prompt_logprobs"]
    chunks = _sse_chunks(server, "/v1/chat/completions", chat)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["prompt_logprobs"] == _close(expected)
    assert all("prompt_logprobs" not in c for c in chunks[1:])


def _close(entries: list) -> list:
    """vLLM prompt_logprobs entries with each logprob compared within float tolerance."""
    return [
        None
        if e is None
        else {t: {**v, "logprob": pytest.approx(v["logprob"], abs=1e-4)} for t, v in e.items()}
        for e in entries
    ]
