"""Decoding a large body in steps gives what json.loads gives (or refuses what it refuses),
refuses an over-long capped array before decoding the rest, validating messages in slices
names the same bad field as validating them at once, a decoded body is emptied afterwards
without touching what the request still holds, and a worker preparing a request shortens
the GIL's switch interval only while it works."""

from __future__ import annotations

import gc
import json
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from app import large_body
from app.errors import APIError, bad_request
from app.http_input import (
    LARGE_BODY_BYTES,
    OFF_LOOP_BODY_BYTES,
    decode_json_object,
    prepare_request,
)
from app.large_body import (
    GC_PAUSE,
    SHORT_SWITCH_INTERVAL_S,
    SHORT_SWITCHES,
    VALIDATION_SLICE,
    decode_in_steps,
    release_unshared,
    validate,
)
from app.schemas import ChatCompletionRequest


def _reject(name: str) -> Any:
    raise ValueError(name)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=12,
)


@settings(max_examples=120, deadline=None)
@given(
    obj=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=6),
    indent=st.sampled_from([None, 0, 2]),
    ascii_only=st.booleans(),
)
def test_decoding_in_steps_matches_json_loads(
    obj: dict[str, Any], indent: int | None, ascii_only: bool
) -> None:
    body = json.dumps(obj, indent=indent, ensure_ascii=ascii_only).encode()
    assert decode_in_steps(body, {}, _reject) == json.loads(body)


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b'{"a": [1, 2}',
        b'{"a": [1 2]}',
        b'{"a" 1}',
        b'{"a": 1,}',
        b'{"a": [1,]}',
        b'{"a": 1} x',
        b"{'a': 1}",
        b'{"a": NaN}',
        b'{"a": [{"b": 1}, ]}',
        b'{"a": [[1], [2}',
        b'{"a": [1, , 2]}',
        b'{"a": [ , 1]}',
        b'{"a": [1, Infinity]}',
        b'{"a": {"b": 1,}}',
        b'{"a": [1, 2]]}',
        b'{"a": {"b" 1}}',
    ],
)
def test_decoding_in_steps_refuses_what_json_loads_refuses(body: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(body, parse_constant=_reject)
    with pytest.raises(ValueError):
        decode_in_steps(body, {}, _reject)


def test_long_arrays_of_numbers_are_decoded_in_slices_exactly() -> None:
    numbers = [7, -1, 2.5, 1e300, True, None, 10**30] * 60_000  # several slices
    body = json.dumps({"tokens": numbers, "mixed": [1, "a,b", [2, 3], {"c": 4}]}).encode()
    assert decode_in_steps(body, {}, _reject) == json.loads(body)


def test_a_capped_array_is_refused_once_past_its_cap() -> None:
    body = b'{"prompt": [' + b",".join([b"[1]"] * 1000) + b'], "n": 2}'
    assert len(decode_in_steps(body, {"prompt": 1000}, _reject)["prompt"]) == 1000
    with pytest.raises(APIError) as refused:
        decode_in_steps(body, {"prompt": 999}, _reject)
    assert refused.value.status == 400 and refused.value.param == "prompt"
    tokens = b'{"prompt": [' + b",".join([b"7"] * 5000) + b"]}"  # token ids: never capped
    assert len(decode_in_steps(tokens, {"prompt": 10}, _reject)["prompt"]) == 5000
    bias = json.dumps({"logit_bias": {str(i): 1 for i in range(301)}}).encode()
    with pytest.raises(APIError) as refused:
        decode_in_steps(bias, {"logit_bias": 300}, _reject)
    assert refused.value.param == "logit_bias"


def test_a_lone_surrogate_is_refused_on_both_paths() -> None:
    body = b'{"messages": [{"role": "user", "content": "a\\udc00"}]}'
    for caps in (None, {}):
        with pytest.raises(APIError) as refused:
            decode_json_object(body, caps)
        assert "surrogate" in refused.value.message


def test_messages_validated_in_slices_name_the_bad_message() -> None:
    messages: list[Any] = [{"role": "user", "content": "a"}] * (3 * VALIDATION_SLICE)
    messages[2 * VALIDATION_SLICE + 7] = {"role": "", "content": "a"}
    with pytest.raises(APIError) as refused:
        validate(ChatCompletionRequest, {"messages": messages})
    assert refused.value.param == f"messages.{2 * VALIDATION_SLICE + 7}.role"
    ok = validate(
        ChatCompletionRequest,
        {"messages": messages[: 2 * VALIDATION_SLICE], "vendor_field": {"big": [1] * 1000}},
    )
    assert len(ok.messages) == 2 * VALIDATION_SLICE
    assert ok.model_extra == {"vendor_field": None}  # ignored fields keep only their name
    distinct = [{"role": "user", "content": str(i)} for i in range(2 * VALIDATION_SLICE + 1)]
    whole = validate(ChatCompletionRequest, {"messages": distinct, "max_tokens": 3})
    assert [m.content for m in whole.messages] == [str(i) for i in range(len(distinct))]
    assert whole.max_tokens == 3 and whole.model_fields_set == {"messages", "max_tokens"}


def test_a_part_that_is_not_text_is_named_in_a_long_conversation_too() -> None:
    text_parts = {"role": "user", "content": [{"type": "text", "text": "a"}]}
    messages: list[Any] = [text_parts] * (2 * VALIDATION_SLICE)
    bad = VALIDATION_SLICE + 3
    messages[bad] = {
        "role": "user",
        "content": [{"type": "text", "text": "what is this?"}, {"type": "video_url"}],
    }
    with pytest.raises(APIError) as refused:
        validate(ChatCompletionRequest, {"messages": messages})
    assert (refused.value.status, refused.value.param) == (400, f"messages.{bad}.content.1")
    assert str(refused.value) == (
        f"messages.{bad}.content.1: video_url content is not supported: this model takes text only"
    )
    assert len(validate(ChatCompletionRequest, {"messages": messages[:bad]}).messages) == bad


def test_only_what_the_body_alone_holds_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[Any] = []
    monkeypatch.setattr(
        large_body, "release_gradually", lambda items: released.append(type(items)(items))
    )  # a copy
    schema, tools = {"type": "object"}, [{"type": "function"}]
    data = {
        "messages": [{"role": "user"}] * 3,
        "guided_json": schema,
        "tools": tools,
        "pad": {"x": [1]},
        "n": 2,
    }
    release_unshared(data)
    assert data == {}
    assert schema == {"type": "object"} and tools == [{"type": "function"}]
    assert released == [{"x": [1]}, [{"role": "user"}] * 3]


def test_a_validated_request_keeps_its_loosely_typed_fields_whole() -> None:
    data = {
        "messages": [{"role": "user", "content": "hi"}],
        "guided_json": {"type": "object"},
        "tools": [{"type": "function"}],
        "chat_template_kwargs": {"a": {"b": [1]}},
        "response_format": {"type": "json_object"},
    }
    expected = json.loads(json.dumps(data))
    req = validate(ChatCompletionRequest, data)
    release_unshared(data)
    assert req.model_dump(include=set(expected), exclude_none=True) == expected


async def _prepare(body: bytes, prepare: Any) -> Any:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }
    state = SimpleNamespace(
        settings=SimpleNamespace(
            max_request_body_bytes=4 * LARGE_BODY_BYTES, request_body_timeout_s=60.0
        )
    )
    return await prepare_request(Request(scope, receive), state, prepare)  # type: ignore[arg-type]


@pytest.mark.parametrize("pad_bytes", [2 * OFF_LOOP_BODY_BYTES, 2 * LARGE_BODY_BYTES])
async def test_a_worker_prepares_a_request_with_short_gil_switches(pad_bytes: int) -> None:
    """The event loop takes the GIL for each callback and waits up to a switch interval
    for a worker running Python: while a worker prepares a request that wait is short (and
    for a large body the garbage collector is off); afterwards both are as they were, also
    when the request is refused."""
    default_s = sys.getswitchinterval()
    assert default_s > SHORT_SWITCH_INTERVAL_S and gc.isenabled()
    body = json.dumps({"pad": "x" * pad_bytes}).encode()
    seen_s, gc_enabled = await _prepare(
        body, lambda data: (sys.getswitchinterval(), gc.isenabled())
    )
    assert seen_s == pytest.approx(SHORT_SWITCH_INTERVAL_S)
    assert gc_enabled is (pad_bytes <= LARGE_BODY_BYTES)
    assert sys.getswitchinterval() == default_s and gc.isenabled()

    def refuse(data: dict[str, Any]) -> None:
        raise bad_request("refused")

    with pytest.raises(APIError):
        await _prepare(body, refuse)
    assert sys.getswitchinterval() == default_s and gc.isenabled()


def test_settings_are_restored_when_the_last_user_leaves() -> None:
    default_s = sys.getswitchinterval()
    with SHORT_SWITCHES:
        with SHORT_SWITCHES:
            pass
        assert sys.getswitchinterval() == pytest.approx(SHORT_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == default_s
    gc.disable()
    try:
        with GC_PAUSE:
            pass
        assert not gc.isenabled()  # paused before: left paused
    finally:
        gc.enable()
