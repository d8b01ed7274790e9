"""Refusing text that cannot fit the context without tokenizing it.

Tokenizing megabytes of text takes seconds, only to learn that it is far beyond the
context. For the tokenizers LLMs use, one token covers a bounded piece of text:

- with a byte-level alphabet (GPT-2 style), a token covers as many UTF-8 bytes as its
  vocabulary string has characters, and every character is at least one byte;
- with SentencePiece-style byte fallback, a token covers as many characters as its string
  has (a byte token such as `<0x41>` covers one byte, less than its string's length);
- an added token covers exactly its content.

So text of more than `max_num_tokens * L * S` characters needs more than `max_num_tokens`
tokens, where L is the longest vocabulary string and S how many characters the normalizer
may merge into one (1; or, for NFC and NFKC, the longest canonical decomposition, since
every composed character stands for at most that many).

A byte-level vocabulary may lack a few bytes (SmolLM2's has no token for some ASCII
control characters); the tokenizer then drops those characters, so they are not counted.

The bound only ever refuses. It exists only where it is sound: a tokenizer that can drop
text or cover an unbounded run with one token (a whitespace pre-tokenizer, WordPiece's
[UNK] for a whole word, fused unknown runs, an added token that swallows the spaces around
it, a stripping normalizer, a configured truncation) has none, and its text is tokenized
in full.

The same bound cuts a text whose last k tokens are all that is kept (truncate_prompt_tokens
= k) before it is tokenized: those k tokens cover at most k * L * S characters of its end.
The cut changes the tokens of the word (pre-token) it falls in, so TRUNCATION_MARGIN_CHARS
more are kept before them: the last k tokens of the tail are then those of the whole text
unless a single word is longer than the margin. Without a bound the whole text is tokenized
(as much as --max-request-body-bytes lets a body hold).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.byte_level import byte_decoder

MAX_CANONICAL_DECOMPOSITION_CHARS = 4
"""The longest canonical decomposition (NFD) of one Unicode character, in characters."""

_NON_SHRINKING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})
_SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Punctuation"})
_BYTE_FALLBACK_TOKENS = tuple(f"<0x{byte:02X}>" for byte in range(256))
_COUNT_WINDOW_CHARS = 1 << 20
TRUNCATION_MARGIN_CHARS = 1 << 14
"""Characters kept before the end of a text that its last k tokens can cover, when it is
cut before tokenizing (far longer than a word of text; a few milliseconds of tokenizing)."""


@dataclass(frozen=True, slots=True)
class CharsPerToken:
    max_chars: int
    """Most characters of input text one token stands for."""
    dropped: str = ""
    """Characters the tokenizer drops (no token covers them); they are not counted."""


_bounds: weakref.WeakKeyDictionary[Any, CharsPerToken | None] = weakref.WeakKeyDictionary()


def text_cannot_fit(text: str, tokenizer: Any, max_num_tokens: int) -> bool:
    """True when `text` surely needs more than `max_num_tokens` tokens of `tokenizer`
    (an app.tokenizer.Tokenizer); False when it may fit (then only tokenizing tells)."""
    if len(text) <= max_num_tokens:  # every token covers at least one character
        return False
    bound = chars_per_token(tokenizer)
    if bound is None or len(text) <= max_num_tokens * bound.max_chars:
        return False
    limit = max_num_tokens * bound.max_chars
    num_dropped = 0
    for num_in_window in _num_dropped_per_window(text, bound.dropped, 0, len(text)):
        num_dropped += num_in_window
        if len(text) - num_dropped <= limit:
            return False
    return True


def truncation_start(text: str, tokenizer: Any, num_tokens: int) -> int:
    """Where `text` may be cut so that tokenizing `text[start:]` ends in the same
    `num_tokens` tokens as tokenizing all of it (see the module's docstring); 0 when the
    tokenizer has no bound (then all of it is tokenized)."""
    bound = chars_per_token(tokenizer)
    if bound is None:
        return 0
    num_chars = num_tokens * bound.max_chars + TRUNCATION_MARGIN_CHARS
    start = end = len(text)
    while num_chars > 0 and start > 0:  # the tail needs num_chars characters not dropped
        start, end = max(start - num_chars, 0), start
        num_chars = sum(_num_dropped_per_window(text, bound.dropped, start, end))
    return start


def _num_dropped_per_window(text: str, dropped: str, start: int, end: int) -> Iterator[int]:
    """How many of text[start:end] are `dropped` characters, one window at a time (one call
    per window: each holds the GIL shortly)."""
    for window_start in range(start, end, _COUNT_WINDOW_CHARS):
        window_end = min(window_start + _COUNT_WINDOW_CHARS, end)
        yield sum(text.count(char, window_start, window_end) for char in dropped)


def chars_per_token(tokenizer: Any) -> CharsPerToken | None:
    """The bound for `tokenizer`; None when one token can cover unbounded text or the
    tokenizer is not understood. Computed once per tokenizer (it reads the vocabulary)."""
    try:
        return _bounds[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: computed each time
        return _bound(getattr(tokenizer, "raw", None))
    bound = _bounds[tokenizer] = _bound(getattr(tokenizer, "raw", None))
    return bound


def _bound(raw: Any) -> CharsPerToken | None:
    if raw is None:
        return None
    try:  # each component's own description: serializing the whole tokenizer takes long
        normalizer = _spec(raw.normalizer)
        pre_tokenizer = _spec(raw.pre_tokenizer)
        model = {
            "type": type(raw.model).__name__,
            **{
                name: getattr(raw.model, name, None)
                for name in ("byte_fallback", "unk_token", "fuse_unk")
            },
        }
        added = list(raw.get_added_tokens_decoder().values())
        vocab: dict[str, int] = raw.get_vocab(with_added_tokens=True)
        truncation = raw.truncation
    except Exception:  # noqa: BLE001 - an unusual tokenizer simply gets no bound
        return None
    if truncation is not None or not vocab:
        return None
    shrink = _normalizer_shrink(normalizer)
    if shrink is None or not _pre_tokenizer_keeps_text(pre_tokenizer):
        return None
    if any(token.lstrip or token.rstrip for token in added):
        return None
    dropped = _dropped_chars(model, pre_tokenizer, vocab)
    if dropped is None or (dropped and normalizer is not None):
        return None
    return CharsPerToken(max(map(len, vocab)) * shrink, dropped)


def _spec(component: Any) -> dict[str, Any] | None:
    if component is None:
        return None
    spec: dict[str, Any] = json.loads(component.__getstate__())
    return spec


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    """Most input characters the normalizer turns into one; None when unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", ()):
            part_factor = _normalizer_shrink(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind in _NON_SHRINKING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return MAX_CANONICAL_DECOMPOSITION_CHARS
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        content = spec.get("content")
        if pattern and isinstance(content, str) and len(content) >= len(pattern):
            return 1
    return None


def _pre_tokenizer_keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(part) for part in spec.get("pretokenizers", ()))
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _dropped_chars(
    model: dict[str, Any], pre_tokenizer: dict[str, Any] | None, vocab: dict[str, int]
) -> str | None:
    """The characters no token covers ("" when every character ends up in a token, each
    unknown one on its own); None when an unknown run may become one token or dropped
    characters cannot be told apart."""
    kind = model.get("type")
    if kind not in ("BPE", "Unigram"):
        return None  # WordPiece and WordLevel map a whole unknown word to one token
    if model.get("byte_fallback") and all(t in vocab for t in _BYTE_FALLBACK_TOKENS):
        return ""
    if kind == "Unigram":
        return None  # unknown runs are fused into one token
    if _has_byte_level(pre_tokenizer):
        missing = [byte for char, byte in byte_decoder().items() if char not in vocab]
        # A missing lead byte leaves the character's continuation bytes; a missing
        # continuation byte could leave nothing of a character: no bound then.
        if not any(0x80 <= byte <= 0xBF for byte in missing):
            return "".join(chr(byte) for byte in missing if byte < 0x80)
    if model.get("unk_token") is not None and not model.get("fuse_unk"):
        return ""
    return None


def _has_byte_level(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(part) for part in spec.get("pretokenizers", ()))
    return spec.get("type") == "ByteLevel"
