"""--max-logprobs (vLLM's): the most logprobs per token a request may ask for, in
`logprobs` / `top_logprobs` and in `prompt_logprobs`, on both endpoints; more is a 400
naming the field and the limit, and what is within it is served end to end. The default
(20) is held by tests/app/test_hostile_surface.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from actors.protocol.codec import Codec
from actors.protocol.config import ConfigError
from actors.protocol.messages import EngineRequest
from actors.protocol.sampling_params import SamplingParams
from app.cli import build_parser
from tests._engine_flags import config_from_flags
from tests.app._server_fixtures import ENGINE, RunningServer

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
LIMIT = 5
MESSAGES = [{"role": "user", "content": "Say something."}]


def test_the_flag_its_environment_variable_and_its_help(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TANDEM_MAX_LOGPROBS", raising=False)
    assert config_from_flags().max_logprobs == 20
    assert config_from_flags("--max-logprobs", "5").max_logprobs == 5
    assert config_from_flags("--max-logprobs", "-1").max_logprobs == -1
    monkeypatch.setenv("TANDEM_MAX_LOGPROBS", "7")
    assert config_from_flags().max_logprobs == 7
    assert config_from_flags("--max-logprobs", "3").max_logprobs == 3
    with pytest.raises(ConfigError, match="max_logprobs must be -1 or >= 0"):
        config_from_flags("--max-logprobs", "-2")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--max-logprobs" in capsys.readouterr().out


def test_the_engine_core_decodes_more_logprobs_than_vllms_default() -> None:
    """The core's decoder validates SamplingParams: it must take whatever the front end
    admitted under a raised --max-logprobs (it once dropped anything above 20)."""
    request = EngineRequest("r", (1, 2, 3), SamplingParams(logprobs=64, prompt_logprobs=64), 0.0)
    decoded = Codec().decode_to_core(Codec().encode(request))
    assert decoded.sampling_params.logprobs == decoded.sampling_params.prompt_logprobs == 64


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with RunningServer(engine=ENGINE.replace(max_logprobs=LIMIT)) as running:
        yield running


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CMPL, {"logprobs": LIMIT + 1}, "logprobs"),
        (CMPL, {"prompt_logprobs": LIMIT + 1}, "prompt_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": LIMIT + 1}, "top_logprobs"),
        (CHAT, {"prompt_logprobs": LIMIT + 1}, "prompt_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": LIMIT + 1, "stream": True}, "top_logprobs"),
    ],
)
def test_more_than_the_limit_is_a_400_naming_the_field_and_the_limit(
    http: httpx.Client, path: str, fields: dict[str, Any], param: str
) -> None:
    prompt: dict[str, Any] = {"prompt": "Hi"} if path == CMPL else {"messages": MESSAGES}
    response = http.post(path, json={**prompt, "max_tokens": 1, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error
    assert f"[0, {LIMIT}]" in error["message"], error


@pytest.mark.slow
def test_the_limit_itself_is_served_on_both_endpoints(http: httpx.Client) -> None:
    completion = http.post(
        CMPL,
        json={
            "prompt": "One two three",
            "max_tokens": 3,
            "temperature": 0.0,
            "logprobs": LIMIT,
            "prompt_logprobs": LIMIT,
        },
    )
    assert completion.status_code == 200, completion.text
    choice = completion.json()["choices"][0]
    # Greedy: the sampled token is the first of the top LIMIT (the legacy format merges them).
    assert [len(top) for top in choice["logprobs"]["top_logprobs"]] == [LIMIT] * 3
    assert choice["prompt_logprobs"][0] is None
    # Each position holds its prompt token and the top LIMIT (one entry when they agree).
    assert all(len(entry) in (LIMIT, LIMIT + 1) for entry in choice["prompt_logprobs"][1:])

    chat = {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": LIMIT}
    plain = http.post(CHAT, json={**chat, "prompt_logprobs": LIMIT})
    assert plain.status_code == 200, plain.text
    content = plain.json()["choices"][0]["logprobs"]["content"]
    assert [len(token["top_logprobs"]) for token in content] == [LIMIT] * len(content) != []
    assert len(plain.json()["prompt_logprobs"]) == plain.json()["usage"]["prompt_tokens"]

    streamed: list[int] = []
    with http.stream("POST", CHAT, json={**chat, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                logprobs = json.loads(line[6:])["choices"][0].get("logprobs") or {}
                streamed += [len(t["top_logprobs"]) for t in logprobs.get("content") or []]
    assert streamed == [LIMIT] * 3
