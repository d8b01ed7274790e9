"""The prefix cache of a real `tandem serve`: a chat's second turn reuses the first turn's
prompt and answer, /reset_prefix_cache (behind the API key) drops what no request holds,
and vllm:prefix_cache_queries / vllm:prefix_cache_hits count every hit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.app._server_fixtures import RunningServer

pytestmark = pytest.mark.slow

API_KEY = "sk-prefix-cache-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16
TEXT = (
    "The committee met on Tuesday to review the budget. It agreed to fund the new library "
    "wing and the park renovation."
)
TURN_1 = [{"role": "user", "content": f"Repeat this text word for word: {TEXT}"}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with RunningServer(api_key=API_KEY) as running:
        yield running


def _post(server: RunningServer, path: str, body: dict[str, Any] | None = None) -> Any:
    response = httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _chat(server: RunningServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    return _post(
        server,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 40, "temperature": 0},
    )


def _prefix_cache_counters(server: RunningServer) -> tuple[float, float]:
    """(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def _counters_after(
    server: RunningServer, expected: tuple[float, float], timeout_s: float = 20.0
) -> tuple[float, float]:
    """The counters once they reach `expected` (the front end takes them with each step's
    outputs), or as they are after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (counters := _prefix_cache_counters(server)) != expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return counters


def test_reset_prefix_cache_is_behind_the_api_key(server: RunningServer) -> None:
    refused = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
    assert refused.status_code == 401
    wrong = httpx.post(
        server.url + "/reset_prefix_cache", headers={"Authorization": "Bearer nope"}, timeout=30
    )
    assert wrong.status_code == 401
    body = _post(server, "/reset_prefix_cache")
    assert body["status"] == "ok" and body["num_kept_blocks"] == 0


def test_a_reset_drops_the_cached_blocks(server: RunningServer) -> None:
    prompt = {"prompt": "Answer in one word. " * 12 + "The sky is", "max_tokens": 2}
    _post(server, "/reset_prefix_cache")
    first = _post(server, "/v1/completions", prompt)["usage"]
    again = _post(server, "/v1/completions", prompt)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] >= BLOCK_SIZE
    reset = _post(server, "/reset_prefix_cache")
    assert reset["num_dropped_blocks"] > 0 and reset["num_kept_blocks"] == 0
    after_reset = _post(server, "/v1/completions", prompt)["usage"]
    assert after_reset["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_second_turn_hits_the_first_answer_and_the_metrics_count_it(
    server: RunningServer,
) -> None:
    _post(server, "/reset_prefix_cache")
    queries_before, hits_before = _prefix_cache_counters(server)
    turn_1 = _chat(server, TURN_1)
    answer = turn_1["choices"][0]["message"]["content"]
    turn_2_messages = [
        *TURN_1,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now say it once more."},
    ]
    turn_2 = _chat(server, turn_2_messages)
    usage_1, usage_2 = turn_1["usage"], turn_2["usage"]
    cached = usage_2["prompt_tokens_details"]["cached_tokens"]
    num_prompt_1, num_answer_1 = usage_1["prompt_tokens"], usage_1["completion_tokens"]
    # Turn 2's prompt renders turn 1's answer as the model wrote it (closed by the EOS it
    # sampled): every full block of turn 1 whose KV ran is a hit, the answer's included.
    assert num_answer_1 >= BLOCK_SIZE
    assert cached == (num_prompt_1 + num_answer_1 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached > num_prompt_1
    expected = (
        queries_before + num_prompt_1 + usage_2["prompt_tokens"],
        hits_before + cached,
    )
    assert _counters_after(server, expected) == expected
