"""A server started without --tool-call-parser on a model whose chat template teaches the
Hermes/Qwen `<tool_call>` format: `tools` without `tool_choice` is `auto`, and the calls
are read out of the output with the parser the template names (the embedded model's own
template names none: tests/app/test_server_errors.py has its 400)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.tokenizer_export import export_tokenizer
from app.tokenizer_loader import load_tokenizer
from tests.app._server_fixtures import ENGINE, RunningServer

pytestmark = pytest.mark.slow

QWEN_STYLE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call one or more functions. Their signatures are within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""Qwen2.5's tool section, shortened: what the parser is chosen by is `<tool_call>`."""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
# The model is too small to call tools on its own: a regex makes it write one call.
ASK_WITH_TOOLS: dict[str, Any] = {
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": [WEATHER_TOOL],
    "max_tokens": 64,
    "structured_outputs": {
        "regex": CALL_TEXT.replace("{", r"\{").replace("}", r"\}"),
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tokenizer_dir = tmp_path_factory.mktemp("qwen-style-tokenizer")
    export_tokenizer(load_tokenizer("default"), str(tokenizer_dir))
    config_path = Path(tokenizer_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN_STYLE_TEMPLATE
    config_path.write_text(json.dumps(config))
    running = RunningServer(engine=ENGINE.replace(tokenizer=str(tokenizer_dir)))
    yield running
    running.stop()


def test_tools_without_tool_choice_are_parsed_by_the_templates_format(
    http: httpx.Client,
) -> None:
    response = http.post("/v1/chat/completions", json=ASK_WITH_TOOLS)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_stream_sends_the_call_as_deltas(http: httpx.Client) -> None:
    chunks = []
    with http.stream(
        "POST", "/v1/chat/completions", json={**ASK_WITH_TOOLS, "stream": True}
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(call["function"].get("arguments", "") for call in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert not any(delta.get("content") for delta in deltas)  # the call is not content
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["tool_calls"]
