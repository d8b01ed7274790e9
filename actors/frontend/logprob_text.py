"""Logprob entries as clients see them: token text and bytes per id, floored values."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from actors.frontend.detokenizer import TokenDecoder

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
