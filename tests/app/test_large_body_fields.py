"""A body over app.http_input.LARGE_BODY_BYTES takes another path (decoded in steps, its
containers freed gradually afterwards); every request field must come out of it exactly as
out of a small body. Each field is sent twice, padded to 2 MiB with a long `user` string and
not padded, and what the server built is compared: the validated request as the route holds
it once the answer is sent, the engine requests (prompt ids, sampling parameters with their
structured output spec), the tool plan, or the error."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import app.routes_chat
import app.routes_completions
from actors.frontend.admission import AdmissionRefused
from app.http_input import LARGE_BODY_BYTES
from app.schemas import ChatCompletionRequest, CompletionRequest
from tests.app._server_fixtures import RunningServer

pytestmark = pytest.mark.slow

PAD_CHARS = 2 * LARGE_BODY_BYTES
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CHOICES = ["yes", "no"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}

COMMON_FIELDS: dict[str, Any] = {
    "model": None,  # the served name, filled in by the test
    "max_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "n": 2,
    "stop": ["x", "yz"],
    "seed": 7,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "logit_bias": {"5": 1.0, "9": -2.0},
    "stream": True,
    "stream_options": {"include_usage": True, "stream": True},
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "ignore_eos": True,
    "min_tokens": 1,
    "stop_token_ids": [5, 6],
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "include_stop_str_in_output": True,
    "truncate_prompt_tokens": 3,
    "priority": 1,
    "request_id": "fields-1",
    "cache_salt": "salt",
    "return_token_ids": True,
    "vllm_xargs": {"a": [1, "b"], "c": 2.5},
    "prompt_logprobs": 2,
    "use_beam_search": True,
    "length_penalty": 2.0,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "logprob_token_ids": [1],
    "stream_interval": 2,
    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    "structured_outputs": {"choice": CHOICES},
    "guided_json": SCHEMA,
    "guided_regex": "a+b",
    "guided_choice": CHOICES,
    "guided_grammar": 'root ::= "x" | "y"',
    "truncation_side": "right",
}
CHAT_FIELDS: dict[str, Any] = {
    "max_completion_tokens": 2,
    "logprobs": True,
    "top_logprobs": {"top_logprobs": 2, "logprobs": True},
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": {"continue_final_message": True, "add_generation_prompt": False},
    "add_special_tokens": True,
    "chat_template_kwargs": {"flag": {"nested": [1, 2]}},
    "reasoning_effort": "low",
    "parallel_tool_calls": True,
    "store": False,
    "metadata": {"k": "v"},
    "service_tier": "auto",
    "modalities": ["text"],
    "include_reasoning": True,
    "tools": [TOOL],
    "tool_choice": {
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    "tool_choice_required": {"tools": [TOOL], "tool_choice": "required"},
    "functions": [TOOL["function"]],
    "function_call": "auto",
    "chat_template": "{{ 1 }}",
    "documents": [{"text": "d"}],
    "audio": {"voice": "a"},
    "prediction": {"type": "content"},
    "web_search_options": {"size": "low"},
}
COMPLETION_FIELDS: dict[str, Any] = {
    "logprobs": 2,
    "echo": True,
    "add_special_tokens": False,
    "suffix": "end",
    "best_of": 2,
    "prompt_embeds": "AAAA",  # refused the same either way: the server does not enable them
}
SPLIT = {
    "stream_options",
    "top_logprobs",
    "continue_final_message",
    "tool_choice",
    "tool_choice_required",
}
"""Fields sent together with the others they need (their value is those fields)."""
CHAT = {
    "messages": [
        {"role": "user", "content": "Say yes or no."},
        {"role": "assistant", "content": "I say"},
    ],
    "max_tokens": 1,
}
COMPLETION = {"prompt": "Say yes or no:", "max_tokens": 1}


@dataclasses.dataclass
class Built:
    """What the server built for one request."""

    requests: list[Any] = dataclasses.field(default_factory=list)
    tool_plans: list[Any] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        # Dumped now, after the answer: a field emptied once validated shows here.
        return {
            "requests": [req.model_dump(exclude={"user"}) for req in self.requests],
            "plans": self.tool_plans,
        }


class Recorder:
    """Records, per HTTP request, the validated request, the engine requests and the tool
    plan the routes build (the routes run one request at a time here). The engine requests
    are then refused (503): generating adds nothing to the comparison."""

    def __init__(self, server: RunningServer) -> None:
        self.built = Built()
        self.engine_requests: list[Any] = []
        self._lock = threading.Lock()
        self._admission = server.state.admission

    def install(self, patch: pytest.MonkeyPatch) -> None:
        parse_model, tool_plan = app.routes_chat.parse_model, app.routes_chat.tool_plan

        def recording_parse(model: Any, data: dict[str, Any]) -> Any:
            req = parse_model(model, data)
            with self._lock:
                self.built.requests.append(req)
            return req

        def recording_plan(*args: Any) -> Any:
            plan = tool_plan(*args)
            with self._lock:
                self.built.tool_plans.append(
                    (plan.tools, plan.mode, plan.structured_output, plan.needs_special_tokens)
                )
            return plan

        async def recording_admit(requests: Any, params: Any) -> Any:
            self.engine_requests.extend(
                (r.prompt_token_ids, r.sampling_params, r.eos_token_ids, r.priority, r.cache_salt)
                for r in requests
            )
            raise AdmissionRefused(503, "recorded", retry_after_s=1)

        patch.setattr(app.routes_chat, "parse_model", recording_parse)
        patch.setattr(app.routes_completions, "parse_model", recording_parse)
        patch.setattr(app.routes_chat, "tool_plan", recording_plan)
        patch.setattr(self._admission, "admit", recording_admit)

    def send(self, http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.built, self.engine_requests = Built(), []
        response = http.post(path, json=body)
        return {
            "status": response.status_code,
            "error": response.json()["error"],
            "engine_requests": self.engine_requests,
            **self.built.summary(),
        }


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with RunningServer(tool_call_parser="hermes") as running:  # tools with tool_choice auto
        yield running


@pytest.fixture
def recorder(server: RunningServer) -> Iterator[Recorder]:
    recorder = Recorder(server)
    with pytest.MonkeyPatch.context() as patch:
        recorder.install(patch)
        yield recorder


def _cases(fields: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, value if name in SPLIT else {name: value}) for name, value in fields.items()]


def test_every_field_has_a_case() -> None:
    for model, own in (
        (ChatCompletionRequest, CHAT_FIELDS),
        (CompletionRequest, COMPLETION_FIELDS),
    ):
        covered = {*COMMON_FIELDS, *own, "user", "messages", "prompt"}
        assert set(model.model_fields) <= covered, set(model.model_fields) - covered


@pytest.mark.parametrize(
    "path,base,fields",
    [
        pytest.param("/v1/chat/completions", CHAT, {**COMMON_FIELDS, **CHAT_FIELDS}, id="chat"),
        pytest.param(
            "/v1/completions", COMPLETION, {**COMMON_FIELDS, **COMPLETION_FIELDS}, id="completions"
        ),
    ],
)
def test_a_large_body_builds_what_a_small_body_builds(
    server: RunningServer,
    http: httpx.Client,
    recorder: Recorder,
    path: str,
    base: dict[str, Any],
    fields: dict[str, Any],
) -> None:
    model_name = server.state.model_names[0]
    differences = []
    for name, extra in _cases(fields):
        if name == "model":
            extra = {"model": model_name}
        body = {**base, **extra}
        small = recorder.send(http, path, {**body, "user": "u"})
        large = recorder.send(http, path, {**body, "user": "u" * PAD_CHARS})
        if small != large:
            differences.append((name, small, large))
    assert not differences, (
        "differ: "
        + ", ".join(name for name, _, _ in differences)
        + "".join(
            f"\n{name}:\n  small {small}\n  large {large}" for name, small, large in differences
        )
    )


@pytest.mark.parametrize(
    "constraint",
    [{"guided_choice": CHOICES}, {"guided_json": {"enum": CHOICES}}],
    ids=["guided_choice", "guided_json"],
)
def test_a_large_body_constrains_the_output(http: httpx.Client, constraint: dict[str, Any]) -> None:
    """The issue's case: a constraint in a 2 MiB body (the output was left free)."""
    body = {**COMPLETION, **constraint, "max_tokens": 10, "temperature": 0, "user": "u" * PAD_CHARS}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert text in CHOICES or text in [f'"{choice}"' for choice in CHOICES], text
