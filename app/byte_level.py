"""GPT-2's byte-level alphabet: the printable stand-ins that byte-level BPE vocabularies
(GPT-2, Llama 3, Qwen, gpt-oss) write bytes as. A leaf module: the tokenizer and the harmony
vocabulary reader both build on it."""

from __future__ import annotations

import functools


@functools.cache
def byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping
