"""Tool-call parsers: any split of the model text gives the same content and calls as the
whole text at once, and the streamed chunks are what the openai SDK accumulates into the
non-streamed message."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from actors.frontend.output_stream import StreamDelta
from app.responses import ChoiceState, ResponseMeta, chat_response
from app.sse_chat_chunks import ChatChunkFormatter
from app.tool_calls import request as tool_request
from app.tool_calls.output import ToolCallOutput
from app.tool_calls.parsers import (
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    NamedFunctionParser,
    ToolCallParser,
    parser_for_template,
)
from app.tool_calls.request import resolve_parser, tool_plan
from app.tool_calls.schema import required_tools_schema

HERMES = (
    'I will check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    '"Paris", "days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}'
    "\n</tool_call>"
)
LLAMA3 = (
    '<|python_tag|>{"name": "search", "parameters": {"q": "a \\"b\\" }"}}; '
    '{"name": "now", "parameters": {}}'
)
ARRAY = '[{"name": "search", "parameters": {"q": "x"}}, {"name": "now", "parameters": {}}]'


def _run(parser: ToolCallParser, text: str, cuts: list[int]) -> tuple[str, dict[int, list[str]]]:
    """Feed `text` split at `cuts`; returns content and, per call index, [name, arguments]."""
    content, calls = "", {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    for piece_content, deltas in outs:
        content += piece_content
        for delta in deltas:
            if delta.id is not None:
                assert delta.index not in calls and delta.arguments == ""
                calls[delta.index] = [delta.name, ""]
            else:
                calls[delta.index][1] += delta.arguments
    return content, calls


CASES = [
    (
        HermesParser,
        HERMES,
        "I will check.",
        {0: ["get_weather", '{"city": "Paris", "days": [1, 2]}'], 1: ["now", "{}"]},
    ),
    (Llama3JsonParser, LLAMA3, "", {0: ["search", '{"q": "a \\"b\\" }"}'], 1: ["now", "{}"]}),
    (JsonArrayParser, ARRAY, "", {0: ["search", '{"q": "x"}'], 1: ["now", "{}"]}),
    (lambda: NamedFunctionParser("f"), '{"a": 1}', "", {0: ["f", '{"a": 1}']}),
    # Plain text comes back unchanged, however it is split.
    (HermesParser, "Hello <tool and <b> bye  \n", "Hello <tool and <b> bye  \n", {}),
    (Llama3JsonParser, "  The answer is {x}.", "  The answer is {x}.", {}),
    # Something that claimed to be a call but is not: it is content.
    (
        HermesParser,
        "x <tool_call>not json</tool_call> y",
        "x <tool_call>not json</tool_call> y",
        {},
    ),
    (Llama3JsonParser, "{not json", "{not json", {}),
]


@pytest.mark.parametrize(("make", "text", "content", "calls"), CASES)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_any_split_gives_the_same_content_and_calls(make, text, content, calls, data) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    assert _run(make(), text, cuts) == (content, calls)
    parser = make()
    assert _run(parser, text, []) == (content, calls)
    assert [[c.name, c.arguments] for c in parser.calls] == list(calls.values())


# The parts of real chat templates that show a tool-call format (paraphrased).
QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}"
    "{{ tool | tojson }}{% endfor %}</tools>\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>'
    "{%- endif %}"
)
LLAMA_3_2_JSON = (
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.' }}{%- if message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA_3_1_BUILTIN = "{{- '<|python_tag|>' + tool_call.name + '.call(' }}"
QWEN3_CODER_XML = (
    "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- for name, value in args %}"
    "{{- '<parameter=' + name + '>\\n' + value + '\\n</parameter>\\n' }}{%- endfor %}"
)
MISTRAL_TOOLS = "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{{ '[TOOL_CALLS]' }}"


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (QWEN_TOOLS, "hermes"),
        (LLAMA_3_2_JSON, "llama3_json"),
        (LLAMA_3_1_BUILTIN, "llama3_json"),
        (QWEN3_CODER_XML, "none"),  # <tool_call> around XML: no parser here reads it
        (MISTRAL_TOOLS, "none"),
        ("{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}", "hermes"),
        ("<|start_header_id|>ipython<|end_header_id|> parameters", "llama3_json"),
        ("<|start_header_id|>ipython<|end_header_id|>{{ message.content }}", "none"),
        ("{{ '<|im_start|>' + message['content'] }}", "none"),
        (None, "none"),
    ],
)
def test_parser_default_comes_from_the_chat_template(template: str | None, parser: str) -> None:
    assert parser_for_template(template) == parser
    assert resolve_parser("auto", template) == parser
    assert resolve_parser("hermes", template) == "hermes"  # the flag wins


class _RecordedLog:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, str]]] = []

    def info(self, event: str, **fields: str) -> None:
        self.lines.append((event, fields))


@pytest.mark.parametrize(
    ("setting", "template", "expected"),
    [
        ("auto", QWEN_TOOLS, {"parser": "hermes", "source": "chat template"}),
        ("llama3_json", QWEN_TOOLS, {"parser": "llama3_json", "source": "--tool-call-parser"}),
        ("auto", MISTRAL_TOOLS, {"parser": "none", "source": "chat template"}),
    ],
)
def test_the_parser_in_use_and_its_source_are_logged_at_startup(
    setting: str, template: str, expected: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded = _RecordedLog()
    monkeypatch.setattr(tool_request, "log", recorded)
    tool_request.log_tool_call_parser(
        setting, SimpleNamespace(chat_template=template, harmony=None)
    )
    [(event, fields)] = recorded.lines
    assert event == "tool_call_parser"
    assert expected.items() <= fields.items()
    if expected["parser"] == "none":
        assert "400" in fields["note"] and "--tool-call-parser" in fields["note"]
    tool_request.log_tool_call_parser(setting, None)  # token ids only: no chat, no line
    assert len(recorded.lines) == 1


def test_required_schema_lists_every_tool() -> None:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in ("a", "b")
    ]
    schema = required_tools_schema(tools)
    assert schema["minItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [["a"], ["b"]]
    plan = tool_plan(tools, "required", "none")
    assert json.loads(plan.structured_output.text) == schema


def _sse_chunks(text: str, pieces: int) -> list[dict]:
    """The chunks the SSE writer sends for `text` arriving in `pieces` parts."""
    meta = ResponseMeta("chatcmpl-1", 0, "m")
    choices = [ChoiceState(index=0)]
    formatter = ChatChunkFormatter(
        meta, [3], choices, False, tool_calls=lambda: ToolCallOutput(HermesParser())
    )
    rng = random.Random(pieces)
    cuts = sorted(rng.sample(range(1, len(text)), pieces - 1))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    chunks = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        delta = StreamDelta(
            "r", (1,), part, None, "stop" if last else None, None, None, 3, 0, i + 1, None, None
        )
        chunks += formatter.chunks(choices[0], delta, first=i == 0)
    return chunks


@pytest.mark.parametrize("pieces", [1, 7, 40])
def test_stream_accumulates_into_the_non_streamed_message(pieces: int) -> None:
    state = ChatCompletionStreamState()
    chunks = _sse_chunks(HERMES, pieces)
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion().choices[0]
    choice = ChoiceState(index=0, text_parts=[HERMES], finish_reason="stop")
    whole = chat_response(
        ResponseMeta("chatcmpl-1", 0, "m"),
        [choice],
        3,
        tool_calls=lambda: ToolCallOutput(HermesParser()),
    )["choices"][0]
    assert streamed.finish_reason == whole["finish_reason"] == "tool_calls"
    assert streamed.message.content == whole["message"]["content"] == "I will check."
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]
    ]
    # OpenAI's order: a header entry (id, type, name, empty arguments), then fragments.
    entries = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in chunks
        if c["choices"][0]["delta"].get("tool_calls")
    ]
    assert entries[0]["id"].startswith("call_") and entries[0]["type"] == "function"
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all("id" not in e for e in entries[1:] if e["index"] == 0)


def test_length_cut_keeps_finish_reason_length() -> None:
    output = ToolCallOutput(HermesParser())
    message, reason = output.message('<tool_call>{"name": "f", "arguments": {"a": ', "length")
    assert reason == "length" and message["tool_calls"][0]["function"]["name"] == "f"
