"""A custom logits processor end to end through `tandem serve`: loaded from
--logits-processors, selecting V1 by rule 5, steered per request by `vllm_xargs`, with
concurrent requests each getting only their own arguments, and bad arguments refused."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.app._server_fixtures import ENGINE, RunningServer

pytestmark = pytest.mark.slow

SAMPLE = "tests.gpu._sample_logits_processor:ForceOrBanTokens"
PROMPT = "The capital of France is"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


SELECTION_WARNINGS = _Records()


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    selection_log = logging.getLogger("gpu.runner_selection")
    selection_log.addHandler(SELECTION_WARNINGS)
    try:
        running = RunningServer(engine=ENGINE.replace(logits_processors=(SAMPLE,)))
    finally:
        selection_log.removeHandler(SELECTION_WARNINGS)
    yield running
    running.stop()


def _complete(http: httpx.Client, **fields: Any) -> httpx.Response:
    body = {
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        **fields,
    }
    return http.post("/v1/completions", json=body)


def _tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_rule5_selects_v1_and_says_why(http: httpx.Client) -> None:
    version = http.get("/version").json()
    assert version["runner"] == "v1" and version["runner_rule"] == "unsupported_features"
    assert f"custom logits processors ({SAMPLE})" in version["runner_reason"]
    assert version["weights"] == "weights: float32"  # what runs in what precision


def test_the_fallback_logs_one_warning(server: RunningServer) -> None:
    assert len(SELECTION_WARNINGS.messages) == 1
    assert "rule 5 (unsupported_features)" in SELECTION_WARNINGS.messages[0]
    assert "custom logits processors" in SELECTION_WARNINGS.messages[0]


def test_concurrent_requests_get_their_own_arguments(
    server: RunningServer, http: httpx.Client
) -> None:
    plain = _tokens(_complete(http))
    forced_a, forced_b = 1000, 2024
    requests = [
        {"vllm_xargs": {"force_token_id": forced_a}},
        {},
        {"vllm_xargs": {"ban_token_ids": [plain[0]]}},
        {"vllm_xargs": {"force_token_id": forced_b}},
        {"vllm_xargs": {"unrelated": "value"}},
    ]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        outputs = list(pool.map(lambda fields: _tokens(_complete(http, **fields)), requests))
    assert outputs[0] == [forced_a] * 8
    assert outputs[1] == plain and outputs[4] == plain
    assert outputs[2][0] != plain[0] and plain[0] not in outputs[2]
    assert outputs[3] == [forced_b] * 8
    assert server.wait_engine_idle().num_running == 0


def test_chat_requests_take_arguments_too(http: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0.8,
        "seed": 3,
        "vllm_xargs": {"force_token_id": 42},
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == [42] * 4


@pytest.mark.parametrize(
    ("xargs", "message"),
    [
        ({"force_token_id": -4}, "force_token_id must be a non-negative integer"),
        ({"ban_token_ids": "7"}, "ban_token_ids must be a list of token ids"),
    ],
)
def test_arguments_the_processor_refuses_are_a_400(
    http: httpx.Client, xargs: dict, message: str
) -> None:
    response = _complete(http, vllm_xargs=xargs)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "vllm_xargs"


@pytest.mark.parametrize("xargs", [{"flag": True}, {"nested": {"a": 1}}, ["force_token_id"]])
def test_xargs_outside_the_schema_are_a_400(http: httpx.Client, xargs: Any) -> None:
    response = _complete(http, vllm_xargs=xargs)
    assert response.status_code == 400
    assert "vllm_xargs" in response.text
