"""Decoding and validating a large request body in a worker thread without stalling the
event loop.

A worker thread only helps where it gives the GIL back: Python code does so once the
event loop's thread has waited for it a switch interval, one C call (the JSON decoder on a
whole body, pydantic on a whole list) not until it returns. The event loop takes the GIL
anew for every I/O callback, so it waits up to a switch interval per callback: CPython's
default of 5 ms made a /health answered through a few dozen callbacks, with other uploads'
callbacks queued among them, wait hundreds of milliseconds behind the worker. So while a
worker prepares a request the switch interval is SHORT_SWITCH_INTERVAL_S (SHORT_SWITCHES),
and for a large body:

- the top-level object is decoded member by member, and its arrays and objects item by
  item (a long array of small items is what a body of many messages or prompts is made
  of); an array of numbers (token ids) in slices; an array or object with a known cap
  (more prompts than the server holds, more logit_bias entries than allowed) is refused as
  soon as it passes it, before the rest is decoded;
- a long `messages` list is validated in slices;
- the cyclic garbage collector is paused meanwhile: the body may decode to millions of
  objects, none in a reference cycle, which it would otherwise walk again and again (the
  model's objects too), holding the GIL for seconds;
- large lists are emptied a slice at a time once done with (release_gradually): freeing
  them whole is one call too. Only those that nothing but the decoded body holds
  (release_unshared): a field the schema keeps as it is (typed Any or holding Any, such as
  guided_json, tools or response_format) is the very object decoded, and the request
  still uses it.

What remains in one C call is one item of those (a message, a prompt, a value nested
deeper): its cost is bounded by --max-request-body-bytes.
"""

from __future__ import annotations

import functools
import gc
import json
import re
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from app.content_parts import check_text_only
from app.errors import bad_request, validation_error
from app.schemas import ChatMessage

ModelT = TypeVar("ModelT", bound=BaseModel)

VALIDATION_SLICE = 512
"""Messages validated per pydantic call."""
RELEASE_SLICE = 4096
"""Objects freed per step by release_gradually."""
NUMBERS_SLICE_CHARS = 1 << 18
"""An array of numbers is decoded about this many characters at a time."""
SHORT_SWITCH_INTERVAL_S = 0.0005
"""The GIL's switch interval while a worker prepares a request: about the longest the event
loop's thread then waits for the GIL per callback (a switch costs microseconds)."""
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_AFTER_KEY = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")
_AFTER_MEMBER = re.compile(r"[ \t\n\r]*([,}])[ \t\n\r]*")
_AFTER_ITEM = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")
_MESSAGES = TypeAdapter(list[ChatMessage])


def release_gradually(items: list[Any] | dict[Any, Any]) -> None:
    """Empty `items` a slice at a time. Dropping the last reference to a container of many
    objects frees them all in one call, which holds the GIL as long (400,000 messages: a
    few hundred milliseconds)."""
    if isinstance(items, dict):
        while items:
            for _ in range(min(RELEASE_SLICE, len(items))):
                items.popitem()
        return
    while items:
        del items[-RELEASE_SLICE:]


def release_unshared(data: dict[str, Any]) -> None:
    """Empty `data` (a decoded body, done with), each list or dict of it that nothing else
    holds a slice at a time (release_gradually); those something else holds stay whole."""
    while data:
        _, value = data.popitem()
        if isinstance(value, (list, dict)) and sys.getrefcount(value) <= _ONLY_LOCAL_REFCOUNT:
            release_gradually(value)


def _only_local_refcount() -> int:
    """What sys.getrefcount says of an object that one local variable alone holds (the
    call's own references differ between Python versions)."""
    value: list[Any] = []
    return sys.getrefcount(value)


_ONLY_LOCAL_REFCOUNT = _only_local_refcount()


class _WhileInside:
    """Applies a process-wide setting while any thread is inside; the last thread out
    restores it. `apply` makes the change and returns what undoes it."""

    def __init__(self, apply: Callable[[], Callable[[], None]]) -> None:
        self._apply = apply
        self._lock = threading.Lock()
        self._num_inside = 0
        self._restore: Callable[[], None] = _nothing

    def __enter__(self) -> None:
        with self._lock:
            if self._num_inside == 0:
                self._restore = self._apply()
            self._num_inside += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._num_inside -= 1
            if self._num_inside == 0:
                self._restore()
                self._restore = _nothing


def _nothing() -> None:
    pass


def _pause_gc() -> Callable[[], None]:
    if not gc.isenabled():
        return _nothing
    gc.disable()
    return gc.enable


def _shorten_switch_interval() -> Callable[[], None]:
    previous_s = sys.getswitchinterval()
    sys.setswitchinterval(min(previous_s, SHORT_SWITCH_INTERVAL_S))
    return functools.partial(sys.setswitchinterval, previous_s)


GC_PAUSE = _WhileInside(_pause_gc)
"""The cyclic garbage collector is off while any thread is inside."""
SHORT_SWITCHES = _WhileInside(_shorten_switch_interval)
"""The GIL's switch interval is at most SHORT_SWITCH_INTERVAL_S while any thread is inside."""


def decode_in_steps(body: bytes, caps: Mapping[str, int], parse_constant: Any) -> Any:
    """json.loads(body), decoded a piece at a time: the top-level object member by member,
    its arrays and objects item by item (an array of numbers in slices). A top-level array
    or object with more items than its cap in `caps` (by key) is refused with a 400 as soon
    as it passes it. Raises ValueError (json.JSONDecodeError) for invalid JSON."""
    text = body.decode(json.detect_encoding(body), "surrogatepass")
    decoder = _StepDecoder(text, json.JSONDecoder(parse_constant=parse_constant))
    idx = _WHITESPACE.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("{", idx):
        return decoder.json.decode(text)  # not an object: the caller refuses it
    obj, idx = decoder.object(idx, caps, nested=True)
    if _WHITESPACE.match(text, idx).end() != len(text):  # type: ignore[union-attr]
        raise json.JSONDecodeError("Extra data", text, idx)
    return obj


class _StepDecoder:
    def __init__(self, text: str, decoder: json.JSONDecoder) -> None:
        self.text = text
        self.json = decoder
        self.scan = decoder.scan_once  # type: ignore[attr-defined]

    def object(
        self,
        start: int,
        caps: Mapping[str, int],
        nested: bool = False,
        key: str = "",
        cap: int | None = None,
    ) -> tuple[dict[str, Any], int]:
        """The object at `start`; with `nested`, its arrays and objects in steps too."""
        text, obj = self.text, {}
        idx = _WHITESPACE.match(text, start + 1).end()  # type: ignore[union-attr]
        if text.startswith("}", idx):
            return obj, idx + 1
        while True:
            if not text.startswith('"', idx):
                raise json.JSONDecodeError(
                    "Expecting property name enclosed in double quotes", text, idx
                )
            if cap is not None and len(obj) >= cap:
                raise _too_many(key, cap)
            member, idx = json.decoder.scanstring(text, idx + 1)  # type: ignore[attr-defined]
            colon = _AFTER_KEY.match(text, idx)
            if colon is None:
                raise json.JSONDecodeError("Expecting ':' delimiter", text, idx)
            idx = colon.end()
            if nested and text.startswith("[", idx):
                obj[member], idx = self.array(idx, member, caps.get(member))
            elif nested and text.startswith("{", idx):
                obj[member], idx = self.object(idx, caps, key=member, cap=caps.get(member))
            else:
                obj[member], idx = self.value(idx)
            separator, idx = self.separator(_AFTER_MEMBER, idx)
            if separator == "}":
                return obj, idx

    def array(self, start: int, key: str, cap: int | None) -> tuple[list[Any], int]:
        text = self.text
        idx = _WHITESPACE.match(text, start + 1).end()  # type: ignore[union-attr]
        if text.startswith("]", idx):
            return [], idx + 1
        first, idx = self.value(idx)
        if not isinstance(first, (dict, list, str)):  # numbers (token ids): not capped here
            return self.numbers(start)
        items = [first]
        while True:
            separator, idx = self.separator(_AFTER_ITEM, idx)
            if separator == "]":
                return items, idx
            if cap is not None and len(items) >= cap:
                raise _too_many(key, cap)
            item, idx = self.value(idx)
            items.append(item)

    def numbers(self, start: int) -> tuple[list[Any], int]:
        """The array at `start` (numbers, by its first item), decoded in slices between
        commas; anything else in it (a string, a nested value) and it is decoded whole."""
        text = self.text
        end = text.find("]", start)
        if end < 0:
            return self.value(start)  # the scanner says what is wrong
        items: list[Any] = []
        piece_start = start + 1
        while True:
            piece_end = text.find(",", min(piece_start + NUMBERS_SLICE_CHARS, end), end)
            piece = text[piece_start : end if piece_end < 0 else piece_end]
            if '"' in piece or "[" in piece or "{" in piece:
                return self.value(start)
            if not piece.strip():
                raise json.JSONDecodeError("Expecting value", text, piece_start)
            items.extend(self.json.decode("[" + piece + "]"))
            if piece_end < 0:
                return items, end + 1
            piece_start = piece_end + 1

    def separator(self, pattern: re.Pattern[str], idx: int) -> tuple[str, int]:
        """The ',' or closing bracket after an item (and the whitespace around it)."""
        after = pattern.match(self.text, idx)
        if after is None:
            raise json.JSONDecodeError("Expecting ',' delimiter", self.text, idx)
        return after.group(1), after.end()

    def value(self, idx: int) -> tuple[Any, int]:
        try:
            value, end = self.scan(self.text, idx)
        except StopIteration as err:
            raise json.JSONDecodeError("Expecting value", self.text, err.value) from None
        return value, end


def _too_many(key: str, cap: int) -> Exception:
    return bad_request(
        f"'{key}' holds more than {cap} items, more than this server takes in one request", key
    )


def validate(model: type[ModelT], data: dict[str, Any]) -> ModelT:
    """`model.model_validate(data)` as a 400 on failure; a content part that is not text is
    refused first, by its own message (app/content_parts.py). Unknown fields keep their
    names (they are logged) but not their values: they are ignored, so nothing of them is
    held for the request's life. A long `messages` list is validated in slices first; the
    model is then validated with its first message and takes the whole list as it is
    (checking each validated message again is one call over all of them)."""
    known = model.model_fields
    if any(key not in known for key in data):
        data = {key: value if key in known else None for key, value in data.items()}
    messages = data.get("messages")
    if "messages" in known and isinstance(messages, list):
        check_text_only(messages)
    validated: list[ChatMessage] | None = None
    if "messages" in known and isinstance(messages, list) and len(messages) > VALIDATION_SLICE:
        validated = _validated_messages(messages)
        data = {**data, "messages": validated[:1]}
    try:
        checked = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    return checked if validated is None else checked.model_copy(update={"messages": validated})


def _validated_messages(messages: list[Any]) -> list[ChatMessage]:
    validated: list[ChatMessage] = []
    for start in range(0, len(messages), VALIDATION_SLICE):
        try:
            validated.extend(_MESSAGES.validate_python(messages[start : start + VALIDATION_SLICE]))
        except ValidationError as exc:
            raise validation_error(exc, loc_prefix=("messages",), index_offset=start) from None
    return validated
