"""Find where JSON values and object members start and end in text that may still be
arriving, without building the values: enough to stream a tool call's arguments as the
model writes them. Complete values are decoded with `json` by the caller."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WHITESPACE = " \t\r\n"
_OPENERS = {"{": "}", "[": "]"}
_SCALAR_END = _WHITESPACE + ",]}:"


class JSONSyntaxError(ValueError):
    """The text cannot be the start of a JSON value."""


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int | None:
    """End (exclusive) of the JSON string starting at `text[pos] == '"'`; None if the
    closing quote has not arrived."""
    pos += 1
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == '"':
            return pos + 1
        pos += 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """End (exclusive) of the JSON value starting at `pos` (no leading whitespace); None if
    it is not complete yet. Nesting and strings are tracked; the value itself is checked
    only by decoding it."""
    if pos >= len(text):
        return None
    char = text[pos]
    if char == '"':
        return string_end(text, pos)
    if char in _OPENERS:
        return _container_end(text, pos)
    if char in "}],:":
        raise JSONSyntaxError(f"unexpected {char!r} where a value should start")
    end = pos
    while end < len(text) and text[end] not in _SCALAR_END:
        end += 1
    return end if end < len(text) else None  # a number may go on


def _container_end(text: str, pos: int) -> int | None:
    closers = [_OPENERS[text[pos]]]
    pos += 1
    while pos < len(text):
        char = text[pos]
        if char == '"':
            end = string_end(text, pos)
            if end is None:
                return None
            pos = end
            continue
        if char in _OPENERS:
            closers.append(_OPENERS[char])
        elif char in "]}":
            if char != closers.pop():
                raise JSONSyntaxError(f"mismatched {char!r}")
            if not closers:
                return pos + 1
        pos += 1
    return None


@dataclass(slots=True)
class Member:
    key: str
    value_start: int | None
    """None until the value's first character has arrived."""
    value_end: int | None
    """None until the value is complete."""


@dataclass(slots=True)
class ObjectScan:
    members: list[Member] = field(default_factory=list)
    end: int | None = None
    """End (exclusive) of the object once its closing brace has arrived."""

    def member(self, *keys: str) -> Member | None:
        return next((m for m in self.members if m.key in keys), None)


def scan_object(text: str, pos: int) -> ObjectScan:
    """The members of the object starting at `text[pos] == '{'` as far as they have arrived.
    Raises JSONSyntaxError when the text cannot be such an object."""
    scan = ObjectScan()
    pos += 1
    while True:
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            return scan
        char = text[pos]
        if char == "}":
            scan.end = pos + 1
            return scan
        if char == ",":
            pos += 1
            continue
        if char != '"':
            raise JSONSyntaxError(f"unexpected {char!r} where a key should start")
        key_end = string_end(text, pos)
        if key_end is None:
            return scan
        key = json.loads(text[pos:key_end])
        pos = skip_whitespace(text, key_end)
        if pos >= len(text):
            return scan
        if text[pos] != ":":
            raise JSONSyntaxError(f"expected ':' after key {key!r}")
        pos = skip_whitespace(text, pos + 1)
        member = Member(key, pos if pos < len(text) else None, None)
        scan.members.append(member)
        if member.value_start is None:
            return scan
        member.value_end = value_end(text, pos)
        if member.value_end is None:
            return scan
        pos = member.value_end
