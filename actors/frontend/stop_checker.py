"""Stop strings, matched on detokenized text across token boundaries.

Text goes in as it is detokenized; what comes out is safe to stream. The checker holds
back the longest suffix of the pending text that could still grow into a stop string, so
no partial stop string ever reaches a client; it releases that suffix as soon as it can no
longer match (or when the request finishes for another reason).

When several stop strings match, the one that completes first in the text wins (ties: the
one that starts first), so the outcome does not depend on how text was split into tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopCheck(NamedTuple):
    text: str
    """Text that may be streamed now."""
    stop_string: str | None = None
    """The stop string that matched; the request is finished when set."""


class StopStringChecker:
    """One request's stop-string state. `append` returns what may be streamed; after a match
    the text is cut before the stop string (or after it with `include_stop_str_in_output`)."""

    __slots__ = ("_include_stop_str", "_pending", "_stop_strings")

    def __init__(self, stop_strings: Sequence[str], include_stop_str_in_output: bool) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._stop_strings = tuple(dict.fromkeys(stop_strings))
        self._include_stop_str = include_stop_str_in_output
        self._pending = ""

    @property
    def pending_text(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._pending

    def append(self, text: str, check: bool = True) -> StopCheck:
        """Add newly detokenized text. With `check=False` (output still shorter than
        min_tokens) no stop string can fire, but partial matches are still held back, so a
        stop string that completes once checking starts is still found."""
        if not self._stop_strings:
            return StopCheck(text)
        buffer = self._pending + text
        if check:
            match = self._find_first_completed(buffer, len(self._pending))
            if match is not None:
                start, stop_string = match
                end = start + len(stop_string) if self._include_stop_str else start
                self._pending = ""
                return StopCheck(buffer[:end], stop_string)
        hold_len = self._hold_len(buffer)
        self._pending = buffer[len(buffer) - hold_len :] if hold_len else ""
        return StopCheck(buffer[: len(buffer) - hold_len])

    def flush(self) -> str:
        """Release the held-back text (the request finished for another reason)."""
        text, self._pending = self._pending, ""
        return text

    def _find_first_completed(self, buffer: str, num_old_chars: int) -> tuple[int, str] | None:
        """The earliest-ending match that ends inside the new text, as (start, stop string).
        Matches ending inside the old text were already rejected (or not checked yet)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_string in self._stop_strings:
            start = buffer.find(stop_string, max(0, num_old_chars - len(stop_string) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop_string), start, stop_string)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _hold_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        best = 0
        for stop_string in self._stop_strings:
            start = buffer.find(stop_string[0], max(0, len(buffer) - len(stop_string) + 1))
            while start >= 0 and len(buffer) - start > best:
                if stop_string.startswith(buffer[start:]):
                    best = len(buffer) - start
                    break
                start = buffer.find(stop_string[0], start + 1)
        return best
