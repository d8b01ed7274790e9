"""Chat content parts. The models served here take text only, so a part of another type
(`image_url`, `input_audio`, `file`, `video_url`, ...) is a 400 that says so and names the
part: what a multimodal client needs to hear, where schema validation would list every
shape the content could have had instead."""

from __future__ import annotations

from typing import Any

from app.errors import bad_request

TEXT_PART = "text"
MAX_SHOWN_TYPE_CHARS = 40
"""A part's type is quoted in the error up to this length (it is the client's text)."""


def check_text_only(messages: list[Any]) -> None:
    """A 400 for the first content part that is not text, with `param` naming it
    (`messages.0.content.1`). Other malformed content is left to schema validation."""
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != TEXT_PART:
                param = f"messages.{index}.content.{part_index}"
                raise bad_request(
                    f"{param}: {_shown(kind)} content is not supported: this model takes text only",
                    param,
                )


def _shown(kind: str) -> str:
    if kind.isidentifier() and len(kind) <= MAX_SHOWN_TYPE_CHARS:
        return kind
    shown = repr(kind[:MAX_SHOWN_TYPE_CHARS])
    return shown if len(kind) <= MAX_SHOWN_TYPE_CHARS else shown + "..."
