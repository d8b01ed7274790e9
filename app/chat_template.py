"""Chat template rendering: Hugging Face-compatible jinja2 in a sandbox.

The environment matches transformers' `apply_chat_template` (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, the
`{% generation %}` tag), so a model's template renders the same prompt it was trained on.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from app.bounded_text import json_text_problem
from app.large_body import release_gradually

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Fallback for models that ship no template but use ChatML tokens."""

JOIN_SLICE = 4096
"""Rendered pieces joined per call."""
TEXT_PART_SEPARATOR = "\n"
"""Joins the text parts of a message whose content is a list of parts."""


class ChatTemplateError(ValueError):
    """The chat template is invalid, rejected the conversation, or failed to render."""


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], first_index: int = 0
) -> list[dict[str, Any]]:
    """Copy messages as templates expect them: list-of-parts content
    (`[{"type": "text", "text": ...}]`) joined into one string, null or missing content as
    "" (an assistant message that only called tools), and tool-call arguments given as JSON
    text decoded into objects (templates write them with `tojson`); arguments too long or
    nested too deeply to decode are refused (app/bounded_text.py). Errors name messages by
    their index, counted from `first_index`."""
    normalized = []
    for index, message in enumerate(messages, start=first_index):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {index} is not an object")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = _join_text_parts(content, index)
        elif content is None:
            message["content"] = ""
        if message.get("tool_calls"):
            message["tool_calls"] = [
                _decoded_call(call, index, call_index)
                for call_index, call in enumerate(message["tool_calls"])
            ]
        normalized.append(message)
    return normalized


def _decoded_call(call: Any, message_index: int, call_index: int) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if not isinstance(arguments, str):
        return call
    problem = json_text_problem(arguments)
    if problem is not None:
        raise ChatTemplateError(
            f"message {message_index}: the arguments of tool call {call_index} {problem}"
        )
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return call  # not JSON: the template gets the text as sent
    return {**call, "function": {**function, "arguments": decoded}}


def _join_text_parts(parts: list[Any], message_index: int) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(
                f"message {message_index}: unsupported content part {kind!r}; supported: text"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"message {message_index}: text part without a string 'text'")
        texts.append(text)
    return TEXT_PART_SEPARATOR.join(texts)


@dataclass(frozen=True, slots=True)
class RenderLimit:
    """Stop rendering once the text, not counting the `dropped` characters, is longer
    than `max_chars` (it can only grow)."""

    max_chars: int
    dropped: str = ""


class RenderedTooLong(Exception):
    """The rendered text passed its RenderLimit after `num_chars` characters."""

    def __init__(self, num_chars: int) -> None:
        super().__init__(num_chars)
        self.num_chars = num_chars


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    limit: RenderLimit | None = None,
    **template_kwargs: Any,
) -> str:
    """Render `messages` through `template`; extra keyword arguments (bos_token, tools,
    enable_thinking, ...) become template variables. Raises ChatTemplateError, and
    RenderedTooLong as soon as the text passes `limit`."""
    compiled = compile_chat_template(template)
    normalized = normalize_messages(messages)
    try:
        return _joined(
            compiled.generate(
                messages=normalized,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            ),
            limit,
        )
    except (ChatTemplateError, RenderedTooLong):
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc.message or exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    except RecursionError:  # a value the template walks (tools, arguments) nests too deeply
        raise ChatTemplateError(
            "chat template failed: a value it renders nests too deeply"
        ) from None
    finally:
        release_gradually(normalized)


def _joined(pieces: Iterator[str], limit: RenderLimit | None) -> str:
    """ "".join(pieces), a slice at a time: jinja's render joins all pieces (one or more per
    message) in one call, which then frees them in the same call; for a conversation of
    hundreds of thousands of messages that call holds the GIL for tens of milliseconds.
    Past `limit` the rest is never rendered."""
    parts: list[str] = []
    piece_slice: list[str] = []
    num_counted = 0
    for piece in pieces:
        piece_slice.append(piece)
        if len(piece_slice) == JOIN_SLICE:
            parts.append("".join(piece_slice))
            piece_slice.clear()
            if limit is not None:
                num_counted += _num_counted(parts[-1], limit)
                if num_counted > limit.max_chars:
                    raise RenderedTooLong(sum(map(len, parts)))
    parts.append("".join(piece_slice))
    return "".join(parts)


def _num_counted(text: str, limit: RenderLimit) -> int:
    return len(text) - sum(text.count(char) for char in limit.dropped)


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"invalid chat template (line {exc.lineno}): {exc.message}"
        ) from None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes (no path to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env
