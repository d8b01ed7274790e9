"""`prompt_embeds` on /v1/completions (app/prompt_embeds.py) against a real server on the
float32 model: the prompt tokens' own embeddings give those tokens' completion (chunked,
streamed, batched with text prompts, through the official client), and every payload the
engine cannot run, or that would be unpickled, is a 400 naming the field, cheaply."""

from __future__ import annotations

import base64
import io
import json
import pickle
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save

from tests.app._hostile import hostile
from tests.app._server_fixtures import (
    ENGINE,
    MAX_MODEL_LEN,
    RunningServer,
    openai_client,
    shared_model,
)

pytestmark = pytest.mark.slow

CMPL = "/v1/completions"
# 16 tokens a step: a 45-row prompt prefills in chunks beside the other requests.
EMBEDS_ENGINE = ENGINE.replace(enable_prompt_embeds=True, max_num_batched_tokens=16)
PROMPT = (
    "The three primary colors are red, yellow and blue. Mixing red and yellow gives orange;"
    " mixing yellow and blue gives green; mixing blue and red gives"
)
GREEDY = {"model": "default", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _rows(token_ids: list[int]) -> torch.Tensor:  # [len(token_ids), hidden_size] float32
    return shared_model().worker.model.embed_tokens[torch.tensor(token_ids)].detach().clone()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _safetensors(rows: torch.Tensor) -> str:
    return _b64(save({"embeds": rows.contiguous()}))


def _refused(response: httpx.Response, fragment: str = "", param: str = "prompt_embeds") -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)
    assert fragment in error["message"], error["message"]
    return str(error["message"])


def test_the_field_is_refused_unless_the_server_enables_it() -> None:
    # Before the module's server starts (servers share the model and never overlap).
    with RunningServer() as off, httpx.Client(base_url=off.url, timeout=60) as http:
        rows = _rows([1, 2, 3])
        response = http.post(CMPL, json={**GREEDY, "prompt_embeds": _safetensors(rows)})
        _refused(response, "--enable-prompt-embeds")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with RunningServer(engine=EMBEDS_ENGINE) as running:
        yield running


@pytest.fixture(scope="module")
def prompt_ids(http: httpx.Client) -> list[int]:
    tokens = http.post("/tokenize", json={"model": "default", "prompt": PROMPT}).json()["tokens"]
    assert len(tokens) > 16
    return list(tokens)


def test_the_tokens_own_embeddings_give_the_tokens_completion(
    http: httpx.Client, prompt_ids: list[int]
) -> None:
    rows = _rows(prompt_ids)
    raw = {"data": _b64(rows.numpy().tobytes()), "dtype": "float32", "shape": list(rows.shape)}
    body = {**GREEDY, "return_token_ids": True, "logprobs": 1}
    hello = [19556, 28]
    expected = http.post(CMPL, json={**body, "prompt": [prompt_ids, hello]}).json()
    got = http.post(
        CMPL, json={**body, "prompt_embeds": [_safetensors(rows), raw], "prompt": [hello]}
    ).json()
    # Embeddings first, then the prompts of `prompt`, as vLLM orders them.
    texts = [c["text"] for c in got["choices"]]
    assert texts == [expected["choices"][0]["text"]] * 2 + [expected["choices"][1]["text"]]
    assert got["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    # Another batch chunks the prompts elsewhere: the sums differ in their last bits.
    got_logprobs, expected_logprobs = (
        r["choices"][0]["logprobs"]["token_logprobs"] for r in (got, expected)
    )
    assert got_logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert got["choices"][0]["prompt_token_ids"] == []
    assert got["usage"]["prompt_tokens"] == 2 * len(prompt_ids) + len(hello)


def test_streamed_and_through_the_official_client(
    server: RunningServer, http: httpx.Client, prompt_ids: list[int]
) -> None:
    expected = http.post(CMPL, json={**GREEDY, "prompt": prompt_ids}).json()["choices"][0]["text"]
    encoded = _safetensors(_rows(prompt_ids).unsqueeze(0))  # [1, n, h] is read as [n, h]
    client = openai_client(server)
    completion = client.completions.create(
        model="default",
        prompt="",  # the client wants a prompt; an empty one beside prompt_embeds is none
        max_tokens=8,
        temperature=0,
        extra_body={"prompt_embeds": encoded, "ignore_eos": True},
    )
    assert completion.choices[0].text == expected
    assert completion.usage is not None and completion.usage.prompt_tokens == len(prompt_ids)
    chunks = client.completions.create(
        model="default",
        prompt="",
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"prompt_embeds": encoded, "ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_truncate_prompt_tokens_keeps_the_last_rows(
    http: httpx.Client, prompt_ids: list[int]
) -> None:
    body = {**GREEDY, "truncate_prompt_tokens": 5}
    expected = http.post(CMPL, json={**body, "prompt": prompt_ids}).json()
    got = http.post(CMPL, json={**body, "prompt_embeds": _safetensors(_rows(prompt_ids))}).json()
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]
    assert got["usage"]["prompt_tokens"] == 5


def _torch_save(rows: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(rows, buffer)
    return buffer.getvalue()


def _bad_payloads() -> dict[str, tuple[Any, str]]:
    hidden = shared_model().worker.model_config.hidden_size
    good = torch.ones(3, hidden)
    nan = good.clone()
    nan[1, 2] = float("nan")
    return {
        "torch.save": (_b64(_torch_save(good)), "never loads"),
        "pickle": (_b64(pickle.dumps(good.numpy())), "never loads"),
        "garbage": (_b64(b"\x07" * 600), "safetensors"),
        "not base64": ("this is not base64!", "base64"),
        "wrong width": (_safetensors(torch.ones(3, hidden + 1)), f"hidden size is {hidden}"),
        "1-D": (_safetensors(torch.ones(hidden)), "shape"),
        "batch of two": (_safetensors(torch.ones(2, 3, hidden)), "shape"),
        "int64": (_b64(save({"e": torch.ones(3, hidden, dtype=torch.int64)})), "I64"),
        "float64": (_b64(save({"e": torch.ones(3, hidden, dtype=torch.float64)})), "F64"),
        "nan": (_safetensors(nan), "NaN"),
        "no rows": (_safetensors(torch.ones(0, hidden)), "no rows"),
        "too many rows": (_safetensors(torch.ones(MAX_MODEL_LEN, hidden)), "more than"),
        "raw bytes too few": (
            {"data": _b64(b"\x00" * 8), "dtype": "float32", "shape": [3, hidden]},
            "bytes",
        ),
        "empty list": ([], "empty"),
        "a number": (42, ""),
    }


@pytest.mark.parametrize(
    "name",
    [
        "torch.save",
        "pickle",
        "garbage",
        "not base64",
        "wrong width",
        "1-D",
        "batch of two",
        "int64",
        "float64",
        "nan",
        "no rows",
        "too many rows",
        "raw bytes too few",
        "empty list",
        "a number",
    ],
)
def test_every_bad_payload_is_a_400_naming_the_field(http: httpx.Client, name: str) -> None:
    value, fragment = _bad_payloads()[name]
    _refused(http.post(CMPL, json={**GREEDY, "prompt_embeds": value}), fragment)


def test_echo_and_prompt_logprobs_are_refused_with_embeddings(
    http: httpx.Client, prompt_ids: list[int]
) -> None:
    encoded = _safetensors(_rows(prompt_ids[:4]))
    _refused(http.post(CMPL, json={**GREEDY, "prompt_embeds": encoded, "echo": True}), param="echo")
    _refused(
        http.post(CMPL, json={**GREEDY, "prompt_embeds": encoded, "prompt_logprobs": 1}),
        param="prompt_logprobs",
    )
    _refused(http.post(CMPL, json={**GREEDY}), "required", param="prompt")


def test_an_oversized_payload_is_refused_before_it_is_decoded(
    server: RunningServer, http: httpx.Client
) -> None:
    # 12 MB of base64 (within the 16 MB body limit): more than 2047 rows could take.
    huge = "A" * (12 << 20)
    body = json.dumps({**GREEDY, "prompt_embeds": huge}).encode()
    with hostile(server.url):
        message = _refused(
            http.post(CMPL, content=body, headers={"Content-Type": "application/json"}),
            "base64 characters",
        )
    assert "AAAA" not in message
    server.check_kv_invariants()


def test_embedded_prompts_count_toward_the_sequences_a_request_may_ask_for(
    server: RunningServer, http: httpx.Client
) -> None:
    capacity = server.state.admission.limits  # type: ignore[union-attr]
    num_items = capacity.max_num_running + capacity.max_queued_requests + 1
    body = {**GREEDY, "prompt_embeds": ["AAAA"] * num_items}
    _refused(http.post(CMPL, json=body), f"{num_items} prompts", param="n")
