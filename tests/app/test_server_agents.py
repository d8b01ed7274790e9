"""What agent frameworks and eval tools send, end to end against a real server: the openai
SDK's parse() and tools (streamed and not), tool-call history, LangChain and LiteLLM, and
lm-eval's remote tokenizer endpoint.

The engine core applies each request's grammar: the requests must be accepted and routed
with their constraint, the responses shaped as OpenAI shapes them, and the output must obey
the schema.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx
import openai
import pydantic
import pytest

from tests.app._server_fixtures import MAX_MODEL_LEN, RunningServer, openai_client

pytestmark = pytest.mark.slow

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = RunningServer(tool_call_parser="hermes")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture
def admitted(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The output constraint of every engine request the server admits."""
    specs: list[object] = []
    admission = server.state.admission
    admit = admission.admit

    async def recording_admit(requests: list, params: object) -> object:
        specs.extend(r.sampling_params.structured_output for r in requests)
        return await admit(requests, params)

    monkeypatch.setattr(admission, "admit", recording_admit)
    return specs


def _parse(client: openai.OpenAI) -> object:
    return client.chat.completions.parse(
        model="default",
        response_format=Person,
        max_tokens=24,
        temperature=0,
        messages=[{"role": "user", "content": "Ada is 36. Give her name and age as JSON."}],
    )


def test_parse_with_a_pydantic_model_is_routed_and_parses(
    client: openai.OpenAI, admitted: list[object]
) -> None:
    parsed = _parse(client).choices[0].message.parsed
    assert isinstance(parsed, Person)
    (spec,) = admitted
    assert spec.kind == "json" and spec.strict
    assert json.loads(spec.text) == openai.lib._pydantic.to_strict_json_schema(Person)


def test_named_tool_choice_streams_deltas_as_openai_does(
    client: openai.OpenAI, admitted: list[object]
) -> None:
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=ASK,
            tools=[WEATHER_TOOL],
            max_tokens=12,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
        )
    )
    entries = [(c.choices[0].delta.tool_calls or [None])[0] for c in chunks if c.choices]
    entries = [e for e in entries if e is not None]
    header = entries[0]
    assert (header.index, header.type, header.function.name, header.function.arguments) == (
        0,
        "function",
        "get_weather",
        "",
    )
    assert header.id.startswith("call_")
    assert all(e.id is None and e.function.name is None for e in entries[1:])
    assert len(entries) > 1  # the arguments follow in fragments
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes in (["stop"], ["length"])  # a named choice keeps "stop", as OpenAI's

    whole = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER_TOOL],
        max_tokens=12,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and whole.choices[0].message.content is None
    assert call.function.arguments == "".join(e.function.arguments for e in entries)
    # Both carried the function's parameters as the grammar to enforce.
    assert [json.loads(s.text) for s in admitted] == [WEATHER_TOOL["function"]["parameters"]] * 2


def test_named_tool_choice_arguments_match_the_parameters(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER_TOOL],
        max_tokens=24,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert isinstance(
        json.loads(whole.choices[0].message.tool_calls[0].function.arguments)["city"], str
    )


def test_tool_call_history_and_lenient_fields_are_accepted(client: openai.OpenAI) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    out = client.chat.completions.create(
        model="default",
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        temperature=0,
        extra_body={"max_tokens": 4.0, "top_k": "5", "logprobs": 1},
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].message.tool_calls is None and out.choices[0].logprobs is not None
    assert client.chat.completions.create(
        model="default", messages=ASK, tools=[], max_tokens=2
    ).choices


def test_constraints_of_every_spelling_are_accepted(server: RunningServer) -> None:
    schema = Person.model_json_schema()
    variants = [
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": schema, "strict": False},
            }
        },
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"structured_outputs": {"grammar": 'root ::= "a" [0-9]+'}},
        {"guided_regex": "[a-z]+"},
        {"guided_json": json.dumps(schema)},
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for variant in variants:
            response = http.post(
                "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **variant}
            )
            assert response.status_code == 200, (variant, response.text)


def test_tokenizer_info_is_what_lm_eval_reads(server: RunningServer) -> None:
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    tokenizer = server.state.tokenizer
    assert info["eos_token"] == tokenizer.id_to_token(tokenizer.eos_token_id)
    assert info["chat_template"] == tokenizer.chat_template
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["model_max_length"] == MAX_MODEL_LEN
    # lm-eval's remote tokenizer: eos id = /tokenize of the eos text without specials.
    tokens = httpx.post(
        server.url + "/tokenize",
        timeout=30,
        json={"prompt": info["eos_token"], "add_special_tokens": False},
    ).json()
    assert tokens["tokens"] == [tokenizer.eos_token_id]


def test_langchain_bind_tools(server: RunningServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model="default",
        max_tokens=24,
        temperature=0,
        max_retries=0,
    )
    forced = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    message = forced.invoke("Weather in Paris?")
    # The function's parameters are the grammar: the arguments parse and hold a city.
    assert message.invalid_tool_calls == []
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    with_calls = [c for c in forced.stream("Weather in Paris?") if c.tool_call_chunks]
    assert with_calls[0].tool_call_chunks[0]["name"] == "get_weather"
    assert all(c.tool_call_chunks[0]["name"] is None for c in with_calls[1:])


def test_langchain_structured_output_parses(server: RunningServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model="default",
        max_tokens=24,
        temperature=0,
        max_retries=0,
    )
    for method in ("function_calling", "json_schema"):
        assert isinstance(
            llm.with_structured_output(Person, method=method).invoke("Ada is 36."), Person
        )
    # json_mode sends no schema (response_format json_object): any JSON object obeys it.
    out = llm.with_structured_output(Person, method="json_mode", include_raw=True).invoke(
        "Ada is 36."
    )
    assert isinstance(json.loads(out["raw"].content), dict)


def test_litellm_tools_and_response_format(server: RunningServer) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    litellm = pytest.importorskip("litellm")
    common = {
        "model": "openai/default",
        "api_base": server.url + "/v1",
        "api_key": "unused",
        "messages": ASK,
        "max_tokens": 8,
        "temperature": 0,
    }
    out = litellm.completion(
        tools=[WEATHER_TOOL],
        **common,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    out = litellm.completion(response_format={"type": "json_object"}, **common)
    assert out.choices[0].finish_reason in ("stop", "length")
