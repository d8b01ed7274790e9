"""Incremental detokenization: token ids in, the new text since the last call out.

A multi-byte UTF-8 character can span several byte-level tokens, and a decoder turns an
unfinished character into U+FFFD. The detokenizer therefore decodes a small window, as
vLLM does: a few tokens whose text was already emitted (the prefix, for context) plus the
tokens not emitted yet, and emits only when the window's text does not end in U+FFFD:

    window:  [ prefix tokens | unread tokens ]
    text  =  decode(window);  new text = text[len(decode(prefix)):]

After an emission the unread tokens become the next prefix. Each push therefore decodes
O(new tokens), not the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
NUM_CONTEXT_TOKENS = 4
"""Prompt tokens (and previously emitted tokens) kept as decoding context. Four bytes hold
any UTF-8 character, so four tokens always reach back to a complete character."""
MAX_UNREAD_TOKENS = 8
"""A character being assembled spans at most four tokens; a longer run of unread tokens
means invalid bytes, and the detokenizer looks for a point where earlier text is final
(again every MAX_UNREAD_TOKENS tokens while none is found: tokens that each end inside a
character are held until one ends cleanly, however long the run)."""


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (app.tokenizer.Tokenizer and
    tokenizers.Tokenizer both fit)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, piece by piece.

    The concatenation of every `push` plus the final `flush` equals
    `tokenizer.decode(output_ids, skip_special_tokens)` for byte-level BPE tokenizers, and
    for byte-fallback (SentencePiece) ones when the output is valid UTF-8: their decoder
    turns a whole run of byte tokens into U+FFFDs once any byte in it is invalid, even bytes
    already streamed. A piece never ends inside a character, so U+FFFD appears only where
    the output really holds invalid UTF-8. The prompt's last tokens give context, so a
    decoder that strips the leading space of a text (SentencePiece) keeps the space that
    follows the prompt, as vLLM does.
    """

    __slots__ = ("_num_prefix", "_prefix_text", "_skip_special_tokens", "_tokenizer", "_window")

    def __init__(
        self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._num_prefix = 0
        self._prefix_text = ""
        self._set_prefix(list(prompt_token_ids[-NUM_CONTEXT_TOKENS:]))

    def push(self, token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text that became final (possibly "")."""
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        text = self._decode(self._window)
        if not text.endswith(REPLACEMENT_CHAR):
            return self._emit(text, len(self._window))
        num_unread = len(self._window) - self._num_prefix
        if num_unread > MAX_UNREAD_TOKENS and num_unread % MAX_UNREAD_TOKENS == 1:
            return self._emit_at_final_cut(text)
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (an unfinished character decodes as U+FFFD).
        Call once the output is complete."""
        if len(self._window) == self._num_prefix:
            return ""
        text = self._decode(self._window)
        return self._emit(text, len(self._window))

    @property
    def num_unread_tokens(self) -> int:
        """Tokens pushed whose text is still held back."""
        return len(self._window) - self._num_prefix

    def _emit(self, text: str, cut: int) -> str:
        """Emit `text` (the decode of window[:cut]) beyond the prefix; window[:cut] is read."""
        if len(text) <= len(self._prefix_text):
            if text == self._prefix_text and text:
                # Tokens that add nothing after real text (skipped special tokens) add no
                # context either; dropping them keeps the window small through long runs.
                # After an empty prefix they stay: a decoder that strips a leading space
                # shows nothing for a lone "▁" that the next token turns into " ".
                del self._window[self._num_prefix : cut]
            return ""
        new_text = text[len(self._prefix_text) :]
        read = self._window[self._num_prefix : cut]
        unread = self._window[cut:]
        self._set_prefix(read[-NUM_CONTEXT_TOKENS:])
        self._window.extend(unread)
        return new_text

    def _emit_at_final_cut(self, text: str) -> str:
        """Emit up to the latest token boundary whose text can no longer change.

        At a cut j the text before it is final when decoding both sides apart gives the
        same text as decoding them together: then the bytes after j already decided how
        the bytes before it decode (as a character, or as invalid bytes).
        """
        end = len(self._window)
        for cut in range(end - 1, max(self._num_prefix, end - 2 * MAX_UNREAD_TOKENS), -1):
            head = self._decode(self._window[:cut])
            if (
                head.startswith(self._prefix_text)
                and len(head) > len(self._prefix_text)
                and head + self._decode(self._window[cut:]) == text
            ):
                return self._emit(head, cut)
        return ""

    def _set_prefix(self, prefix_ids: list[int]) -> None:
        prefix_text = self._decode(prefix_ids)
        if prefix_text.endswith(REPLACEMENT_CHAR):
            # An unfinished character in the context would swallow the first output bytes;
            # without context the output decodes exactly as it does on its own.
            prefix_ids, prefix_text = [], ""
        self._window = prefix_ids
        self._num_prefix = len(prefix_ids)
        self._prefix_text = prefix_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class NullDetokenizer:
    """Stands in for IncrementalDetokenizer when the engine has no tokenizer (token-id-only
    runs, such as dummy weights): every piece of text is empty."""

    __slots__ = ()

    def push(self, token_ids: Sequence[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""

    @property
    def num_unread_tokens(self) -> int:
        return 0
