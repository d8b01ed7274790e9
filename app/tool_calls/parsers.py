"""Tool-call parsers: model text in, content text and tool-call deltas out, incrementally.

    parser = HermesParser()
    content, deltas = parser.feed(text_piece)     # as the output streams
    content, deltas = parser.finish()             # at the end: flush what was held back
    parser.calls                                  # every complete call

A non-streamed response runs the same parser over the whole text at once, so streamed and
non-streamed answers agree. Text that could still turn into a call (a partial
`<tool_call>` tag, leading whitespace) is held back until it is known to be content; text
that claimed to be a call but is not valid JSON comes back as content at the end.
"""

from __future__ import annotations

from collections.abc import Callable

from app.tool_calls.calls import CallReader, ParsedCall, ToolCallDelta
from app.tool_calls.json_scan import skip_whitespace

Parsed = tuple[str, list[ToolCallDelta]]


class ToolCallParser:
    """Shared bookkeeping: the text so far, the calls, and content held back."""

    def __init__(self) -> None:
        self.text = ""
        self._pos = 0
        """Text before this is content already decided (sent or dropped)."""
        self._readers: list[CallReader] = []
        self._open_reader: CallReader | None = None
        """A call object that has started but not ended (sequence formats)."""
        self._pending_space = ""

    @property
    def calls(self) -> list[ParsedCall]:
        return [call for r in self._readers if (call := r.result()) is not None]

    def feed(self, piece: str) -> Parsed:
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> Parsed:
        return self._advance(final=True)

    def _advance(self, final: bool) -> Parsed:
        raise NotImplementedError

    def _content(self, piece: str, final: bool = False) -> str:
        """Trailing whitespace is held until more content follows it; at the end it is
        kept only when there were no calls (plain text must come back unchanged)."""
        self._pending_space += piece
        if final and not self._readers:
            out, self._pending_space = self._pending_space, ""
            return out
        out = self._pending_space.rstrip()
        self._pending_space = self._pending_space[len(out) :]
        return out

    def _new_reader(self, name: str | None = None) -> CallReader:
        reader = CallReader(len(self._readers), name)
        self._readers.append(reader)
        return reader


class HermesParser(ToolCallParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
    with content around them."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    needs_special_tokens = True
    """The tags are special tokens in some vocabularies: decode must keep them."""

    def __init__(self) -> None:
        super().__init__()
        self._reader: CallReader | None = None
        self._call_start = 0

    def _advance(self, final: bool) -> Parsed:
        content = ""
        deltas: list[ToolCallDelta] = []
        while True:
            if self._reader is None:
                tag = self.text.find(self.OPEN, self._pos)
                if tag < 0:
                    safe = len(self.text) if final else safe_end(self.text, self.OPEN)
                    content += self._content(self.text[self._pos : safe], final)
                    self._pos = max(self._pos, safe)
                    return content, deltas
                content += self._content(self.text[self._pos : tag])
                self._reader, self._call_start = self._new_reader(), tag
                self._pos = tag + len(self.OPEN)
            close = self.text.find(self.CLOSE, self._pos)
            body = self.text[:close] if close >= 0 else self.text
            start = skip_whitespace(body, self._pos)
            if start < len(body) and body[start] == "{" and not self._reader.is_broken:
                deltas += self._reader.read(body, start)[0]
            if close < 0 and not final:
                return content, deltas
            end = len(self.text) if close < 0 else close + len(self.CLOSE)
            if not self._reader.has_header:  # not a call after all: its text is content
                self._readers.pop()
                content += self._content(self.text[self._call_start : end], final)
            self._reader, self._pos = None, end


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: the whole output is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`, several separated by `;`); any other output is plain content."""

    PYTHON_TAG = "<|python_tag|>"
    needs_special_tokens = False

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None (undecided), "content" or "calls"

    def _advance(self, final: bool) -> Parsed:
        if self._mode is None:
            self._mode = self._decide(final)
            if self._mode is None:
                return "", []
        if self._mode == "content":
            content = self.text[self._pos :]
            self._pos = len(self.text)
            return content, []
        return _read_sequence(self, ";", final)

    def _decide(self, final: bool) -> str | None:
        start = skip_whitespace(self.text, 0)
        rest = self.text[start:]
        if rest.startswith(self.PYTHON_TAG):
            self._pos = start + len(self.PYTHON_TAG)
            return "calls"
        if rest.startswith("{"):
            self._pos = start
            return "calls"
        if final or (rest and not self.PYTHON_TAG.startswith(rest)):
            return "content"
        return None


class JsonArrayParser(ToolCallParser):
    """tool_choice "required": the output is `[{"name": ..., "parameters": {...}}, ...]`, the
    shape the required-call JSON schema enforces."""

    needs_special_tokens = False

    def _advance(self, final: bool) -> Parsed:
        start = skip_whitespace(self.text, 0)
        if start >= len(self.text):
            return ("", []) if not final else (self._content(self.text, final), [])
        if self.text[start] != "[":
            content = self.text[self._pos :]
            self._pos = len(self.text)
            return content, []
        self._pos = max(self._pos, start + 1)
        return _read_sequence(self, ",", final, closer="]")


class NamedFunctionParser(ToolCallParser):
    """tool_choice naming a function: the whole output is that function's arguments."""

    needs_special_tokens = False

    def __init__(self, name: str) -> None:
        super().__init__()
        self._reader = self._new_reader(name)
        self._header_sent = False
        self._arguments_started = False

    def _advance(self, final: bool) -> Parsed:
        deltas = []
        if not self._header_sent:
            reader = self._reader
            deltas.append(ToolCallDelta(reader.index, "", reader.call_id, reader.name))
            self._header_sent = True
        if not self._arguments_started:  # the blank line a model writes after reasoning
            self._pos = skip_whitespace(self.text, self._pos)
            self._arguments_started = self._pos < len(self.text)
        if len(self.text) > self._pos:
            deltas.append(ToolCallDelta(self._reader.index, self.text[self._pos :]))
            self._pos = len(self.text)
        return "", deltas

    @property
    def calls(self) -> list[ParsedCall]:
        arguments = self.text[skip_whitespace(self.text, 0) :]
        return [ParsedCall(self._reader.call_id, self._reader.name or "", arguments)]


def _read_sequence(
    parser: ToolCallParser, separator: str, final: bool, closer: str | None = None
) -> Parsed:
    """Calls written one after another (separated by `separator`, up to `closer`); whatever
    is not a call object ends the sequence and is content."""
    text = parser.text
    deltas: list[ToolCallDelta] = []
    while True:
        reader = parser._open_reader
        if reader is None:
            pos = skip_whitespace(text, parser._pos)
            while pos < len(text) and text[pos] == separator:
                pos = skip_whitespace(text, pos + 1)
            if pos >= len(text):
                return _end_sequence(parser, "", deltas, final)
            if text[pos] != "{":
                rest = text[pos + (closer is not None and text[pos] == closer) :]
                parser._pos = len(text)
                return _end_sequence(parser, rest if rest.strip() else "", deltas, final)
            reader = parser._open_reader = parser._new_reader()
            parser._pos = pos
        new, end = reader.read(text, parser._pos)
        deltas += new
        if reader.is_broken or end is None:
            return _end_sequence(parser, "", deltas, final)
        parser._pos, parser._open_reader = end, None


def _end_sequence(
    parser: ToolCallParser, content: str, deltas: list[ToolCallDelta], final: bool
) -> Parsed:
    if final and not any(r.has_header for r in parser._readers):
        parser._readers.clear()  # never a call: the whole output is content
        return parser.text, []
    return content, deltas


def safe_end(text: str, tag: str) -> int:
    """End of the text that cannot be the start of `tag`."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}
PARSER_CHOICES = ("auto", "hermes", "llama3_json", "none")


def parser_for_template(template: str | None) -> str:
    """The tool-call format a chat template teaches its model ("none" when it shows none,
    or one that no parser here reads): `<tool_call>` tags around JSON are Hermes/Qwen;
    `<|python_tag|>` or an ipython role with "parameters" is Llama 3's JSON."""
    if not template:
        return "none"
    if "<tool_call>" in template:
        # Qwen3-Coder's calls share the tag but are XML (<function=NAME><parameter=...>):
        # read as JSON they would come back as content.
        return "none" if "<function=" in template else "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return "none"
