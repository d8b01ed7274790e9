"""The Qwen3-like chat of the reasoning route tests: a shortened Qwen3 template (its
`<tool_call>` picks the hermes tool-call parser; `enable_thinking: false` closes an empty
think block in the prompt and `think_open: true` leaves one open, as Qwen3 Thinking-2507
templates do), a scripted engine behind the real routes, and requests to it."""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.testclient import TestClient

from actors.protocol.config import EngineConfig
from actors.protocol.structured_output import StructuredOutputSpec
from app.serve_settings import ServeSettings
from app.server_state import ServerState
from app.tokenizer import Tokenizer
from tests.app._scripted_chat import ScriptedAdmission, scripted_state, stream_chunks

MODEL = "qwen3-test"
TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
Call them as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif think_open %}<think>
{% endif %}{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class AcceptingChecker:
    async def check(self, spec: StructuredOutputSpec) -> str | None:
        return None


def qwen3_like_state(tokenizer: Any) -> ServerState:
    """A scripted server over `tokenizer` (a `tokenizers.Tokenizer`; id 0 ends a turn)."""
    settings = ServeSettings(
        engine=EngineConfig(model="dummy:qwen3-0.6b"), port=0, served_model_names=(MODEL,)
    )
    wrapped = Tokenizer(tokenizer, eos_token_id=0, chat_template=TEMPLATE)
    return scripted_state(settings, wrapped, wrapped.vocab_size, AcceptingChecker())


def serve_script(state: ServerState, parser: str, script: list[str], finish: str = "stop") -> None:
    state.settings = dataclasses.replace(state.settings, reasoning_parser=parser)
    admission: ScriptedAdmission = state.admission  # type: ignore[assignment]
    admission.script = [1000 + i for i in range(len(script))]
    admission.texts, admission.finish_reason = script, finish


def chat(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def chat_stream(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    return stream_chunks(client, MODEL, **body)
