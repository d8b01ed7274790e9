"""Logprob entries as clients see them: token text and bytes per id, floored values, and
the entries built from a step's logprob arrays (LogprobEntryBuilder)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from actors.frontend.detokenizer import TokenDecoder
from actors.frontend.output_stream import LogprobEntry, TopLogprob
from actors.protocol.messages import LogprobsArrays

LOGPROB_FLOOR = -9999.0
"""OpenAI's minimum logprob; JSON has no -inf."""
_MAX_CACHED_TOKEN_TEXTS = 1 << 16


def floor_logprobs(logprobs: np.ndarray) -> np.ndarray:
    """NaN and -inf become LOGPROB_FLOOR, +inf becomes 0, everything >= LOGPROB_FLOOR."""
    finite = np.nan_to_num(
        logprobs.astype(np.float64), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0
    )
    return np.maximum(finite, LOGPROB_FLOOR)


class TokenTextCache:
    """Token id -> (token string, UTF-8 bytes) for logprobs. A token holding part of a
    multi-byte character renders its stray bytes as \\xNN escapes; `bytes` stays exact."""

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self._tokenizer = tokenizer
        self._token_bytes: Callable[[int], bytes] | None = getattr(tokenizer, "token_bytes", None)
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def get(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        cached = self._cache.get(token_id)
        if cached is None:
            if len(self._cache) >= _MAX_CACHED_TOKEN_TEXTS:
                self._cache.clear()
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        if self._token_bytes is not None:
            raw = bytes(self._token_bytes(token_id))
            return raw.decode("utf-8", errors="backslashreplace"), tuple(raw)
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text, tuple(text.encode("utf-8"))


class LogprobEntryBuilder:
    """Builds the LogprobEntry of one row of a step's LogprobsArrays: the scored token and
    its top `num_top` alternatives. With no tokenizer the entries carry ids only."""

    def __init__(self, tokenizer: TokenDecoder | None) -> None:
        self._token_texts = TokenTextCache(tokenizer) if tokenizer is not None else None

    def sampled(
        self, logprobs: LogprobsArrays | None, row: int, token_id: int, num_top: int
    ) -> tuple[LogprobEntry, ...]:
        """The entry of an output token (none when the step computed no logprobs)."""
        if logprobs is None:
            return ()
        return (self.entry(logprobs, row, token_id, num_top),)

    def prompt(
        self, logprobs: LogprobsArrays, first_row: int, num_rows: int, num_top: int
    ) -> list[LogprobEntry]:
        """The entries of `num_rows` prompt tokens from `first_row` on; each row scores the
        prompt token in its first column."""
        return [
            self.entry(logprobs, row, int(logprobs.token_ids[row, 0]), num_top)
            for row in range(first_row, first_row + num_rows)
        ]

    def entry(
        self, logprobs: LogprobsArrays, row: int, token_id: int, num_top: int
    ) -> LogprobEntry:
        ids = logprobs.token_ids[row, : num_top + 1].tolist()
        values = floor_logprobs(logprobs.logprobs[row, : num_top + 1]).tolist()
        token, token_bytes = self._token_text(token_id)
        top = tuple(
            TopLogprob(top_id, *self._token_text(top_id), value)
            for top_id, value in zip(ids[1:], values[1:])
        )
        return LogprobEntry(
            token_id, token, token_bytes, values[0], int(logprobs.sampled_rank[row]), top
        )

    def _token_text(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        if self._token_texts is None:  # no tokenizer: logprob entries carry ids only
            return "", ()
        return self._token_texts.get(token_id)
