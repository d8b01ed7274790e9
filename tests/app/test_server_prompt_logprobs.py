"""Prompt logprobs over HTTP: completions echo + logprobs exactly as lm-eval's
local-completions sends and reads it (loglikelihood), vLLM's prompt_logprobs field on chat
and completions, against transformers' log_softmax on the same weights; and lm-eval itself
running a multiple-choice task from a local dataset file through local-completions, with
the server's remote tokenizer endpoints."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests._hf_reference import hf_reference_model
from tests.app._server_fixtures import RunningServer

pytestmark = pytest.mark.slow

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATIONS = (" Paris", " Berlin is a city")
DOCS = [{"question": "The capital of France is", "choices": ["Paris", "Tokyo"], "answer": 0},
        {"question": "Two plus two equals", "choices": ["seven", "four"], "answer": 1},
        {"question": "The sky on a clear day is", "choices": ["blue", "green"], "answer": 0}]
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


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = RunningServer()
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
        body = http.post("/v1/completions", json={
            "model": "default", "prompt": prompt, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}).json()
        logprobs = body["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(prompt) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        reference = _reference_logprobs(tuple(prompt))
        expected = reference.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = torch.tensor(logprobs["token_logprobs"][1:len(prompt)])
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
        ctxlen = len(context)
        scored = logprobs["token_logprobs"][ctxlen:-1]
        tops = logprobs["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(scored, tops))
        greedy_ids = reference[ctxlen - 1:].argmax(-1).tolist()
        assert is_greedy == (greedy_ids == prompt[ctxlen:])
        results.append(sum(scored))
        assert body["choices"][0]["text"].startswith(server.state.tokenizer.decode(prompt))
    assert results[0] > results[1]  # Paris beats a wrong, longer answer


def test_prompt_logprobs_field_on_completions_and_chat(server: RunningServer,
                                                       http: httpx.Client) -> None:
    prompt = _tokens(server, CONTEXT)
    body = http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3}).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    reference = _reference_logprobs(tuple(prompt))
    for position, entry in enumerate(entries[1:], start=1):
        token = str(prompt[position])
        top3 = reference[position - 1].topk(3).indices.tolist()
        assert {str(t) for t in top3} <= set(entry) and token in entry
        assert {entry[str(t)]["rank"] for t in top3} == {1, 2, 3}
        assert entry[token]["logprob"] == pytest.approx(
            reference[position - 1, prompt[position]].item(), abs=2e-3)
    assert body["choices"][0]["logprobs"] is None  # no echo: output logprobs not asked
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_a_cached_prefix_still_yields_prompt_logprobs(server: RunningServer,
                                                      http: httpx.Client) -> None:
    prompt = _tokens(server, CONTEXT * 4)  # several full KV blocks
    plain = {"prompt": prompt, "max_tokens": 1}
    assert http.post("/v1/completions", json=plain).status_code == 200
    again = http.post("/v1/completions", json=plain).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    scored = http.post("/v1/completions", json={**plain, "prompt_logprobs": 0}).json()
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    entries = scored["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and all(e is not None for e in entries[1:])


def _reference_loglikelihood(tokenizer: object, context_text: str, continuation_text: str
                             ) -> float:
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
        model_args={"base_url": server.url + "/v1/completions", "model": "default",
                    "tokenizer_backend": "remote", "num_concurrent": 2, "max_retries": 1},
        tasks=["tandem_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, limit=len(DOCS))
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
