"""One tool call being read out of model text: its header (id, name) as soon as the name is
complete, then its arguments as raw JSON fragments as they arrive.

The fragments are slices of the model's own text, so a client that concatenates them gets
exactly the `arguments` string of the non-streamed response (both come from this code).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from app.tool_calls.json_scan import JSONSyntaxError, ObjectScan, scan_object

ARGUMENT_KEYS = ("arguments", "parameters")
"""Hermes/Qwen write "arguments", Llama 3 "parameters"."""
EMPTY_ARGUMENTS = "{}"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """What one streamed `tool_calls` entry carries: the first for a call has id and name
    (and empty arguments), later ones an arguments fragment."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, object]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class CallReader:
    """Reads one `{"name": ..., "arguments"|"parameters": ...}` object from text that grows.
    `read(text, start)` is given the whole text each time (objects are small); the object
    starts at `text[start] == '{'`."""

    __slots__ = ("_arguments", "_num_sent", "index", "is_broken", "name", "call_id")

    def __init__(self, index: int, name: str | None = None) -> None:
        self.index = index
        self.call_id = new_call_id()
        self.name = name
        self._arguments = ""
        self._num_sent = 0
        self.is_broken = False
        """The text turned out not to be a call object."""

    @property
    def has_header(self) -> bool:
        return self.name is not None

    def read(self, text: str, start: int) -> tuple[list[ToolCallDelta], int | None]:
        """New deltas, and the end of the object once it is complete."""
        try:
            scan = scan_object(text, start)
        except JSONSyntaxError:
            self.is_broken = True
            return [], None
        deltas: list[ToolCallDelta] = []
        name = scan.member("name")
        if self.name is None and name is not None and name.value_end is not None:
            value = json.loads(text[name.value_start : name.value_end])
            if not isinstance(value, str):
                self.is_broken = True
                return [], None
            self.name = value
            deltas.append(ToolCallDelta(self.index, "", self.call_id, value))
        self._arguments = self._arguments_so_far(text, scan)
        if scan.end is not None and not self._arguments:
            self._arguments = EMPTY_ARGUMENTS
        if self.name is not None and len(self._arguments) > self._num_sent:
            deltas.append(ToolCallDelta(self.index, self._arguments[self._num_sent :]))
            self._num_sent = len(self._arguments)
        return deltas, scan.end

    def _arguments_so_far(self, text: str, scan: ObjectScan) -> str:
        member = scan.member(*ARGUMENT_KEYS)
        if member is None or member.value_start is None:
            return self._arguments
        if text[member.value_start] == '"':  # arguments as a JSON string: send it decoded
            if member.value_end is None:
                return self._arguments
            value = json.loads(text[member.value_start : member.value_end])
            return value if isinstance(value, str) else self._arguments
        return text[member.value_start : member.value_end or len(text)]

    def result(self) -> ParsedCall | None:
        if self.name is None:
            return None
        return ParsedCall(self.call_id, self.name, self._arguments or EMPTY_ARGUMENTS)
