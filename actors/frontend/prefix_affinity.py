"""Which engine cores each prompt prefix was sent to: what keeps a conversation on the core
whose prefix cache holds its earlier turns (`--data-parallel-size N`).

A prefix is named by the chained hash of its full blocks of `block_size` tokens (block k's
hash covers every token before its end, and the request's cache salt, like the core's
prefix cache keys, actors/core/prefix_hash.py). Only the first MAX_AFFINITY_TOKENS tokens
are hashed, so the cost per request stays bounded (about 0.3 ms at the cap).

The table is direct-mapped: NUM_SLOTS slots of two 64-bit words (the prefix's hash, the
bitmask of cores it was sent to), the slot chosen by the hash; a new prefix takes its slot
from whatever was there. So memory is fixed (1 MiB) and old prefixes fade as new ones
arrive, much as a core's cache evicts them. The words live in a buffer that every API
server of the server maps (`tandem serve --api-server-count M`, a file the supervisor
creates), so a conversation whose turns reach different API servers still finds its core;
with one API server the buffer is private. Reads and writes are single aligned words, and
the table only steers a heuristic: a torn or overwritten entry costs at most one request
sent where its prefix is not cached.

Hashes use Python's `hash` of ints and tuples of ints, which (unlike str and bytes) is not
randomised per process, so every API server computes the same ones; the salt, a string,
goes through blake2b first.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Sequence

NUM_SLOTS = 1 << 16
_WORDS_PER_SLOT = 2
TABLE_BYTES = NUM_SLOTS * _WORDS_PER_SLOT * 8
MAX_AFFINITY_TOKENS = 8192
"""Tokens of a prompt that take part in its affinity: prompts that agree this far are one
prefix as far as the balancer can tell."""
MAX_CORES = 64
"""Cores a bitmask word holds."""
_MASK64 = (1 << 64) - 1


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[int]:
    """The chained hashes of the prompt's full blocks (of at most MAX_AFFINITY_TOKENS
    tokens), as unsigned 64-bit ints, never 0 (an empty slot's tag)."""
    tokens = tuple(token_ids[: MAX_AFFINITY_TOKENS - MAX_AFFINITY_TOKENS % block_size])
    parent = 0 if cache_salt is None else _salt_hash(cache_salt)
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tokens[start : start + block_size])) & _MASK64 or 1
        hashes.append(parent)
    return hashes


def _salt_hash(salt: str) -> int:
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


class PrefixAffinity:
    """The table, over `buffer` (TABLE_BYTES, zeroed when new) or a private one."""

    def __init__(self, buffer: bytearray | mmap.mmap | None = None) -> None:
        self._raw = memoryview(bytearray(TABLE_BYTES) if buffer is None else buffer)
        if self._raw.nbytes != TABLE_BYTES:
            raise ValueError(
                f"the affinity table takes {TABLE_BYTES} bytes, got {self._raw.nbytes}"
            )
        self._words = self._raw.cast("B").cast("Q")
        self._map: mmap.mmap | None = None

    @classmethod
    def open(cls, path: str) -> PrefixAffinity:
        """The table in the file at `path` (see `create`), shared with every process that
        maps it."""
        with open(path, "r+b") as file:
            mapped = mmap.mmap(file.fileno(), TABLE_BYTES)
        table = cls(mapped)
        table._map = mapped
        return table

    @staticmethod
    def create(path: str) -> None:
        """A zeroed table file (the supervisor's side), readable by its owner only."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, TABLE_BYTES)
        finally:
            os.close(fd)

    def cores(self, prefix_hash: int) -> int:
        """The bitmask of cores this prefix was sent to (0: none known)."""
        slot = (prefix_hash % NUM_SLOTS) * _WORDS_PER_SLOT
        if self._words[slot] != prefix_hash:
            return 0
        return int(self._words[slot + 1])

    def record(self, prefix_hashes: Sequence[int], core: int) -> None:
        """These prefixes were just sent to `core`."""
        bit = 1 << core
        words = self._words
        for prefix_hash in prefix_hashes:
            slot = (prefix_hash % NUM_SLOTS) * _WORDS_PER_SLOT
            if words[slot] == prefix_hash:
                mask = int(words[slot + 1])
                if not mask & bit:
                    words[slot + 1] = mask | bit
            else:
                words[slot + 1] = bit
                words[slot] = prefix_hash

    def matched_blocks(self, prefix_hashes: Sequence[int], num_cores: int) -> list[int]:
        """For each core, how many leading blocks of the prompt were sent to it."""
        matched = [0] * num_cores
        alive = (1 << num_cores) - 1
        for block, prefix_hash in enumerate(prefix_hashes):
            still = alive & self.cores(prefix_hash)
            if still != alive:
                _set_for_bits(matched, alive & ~still, block)
                alive = still
                if not alive:
                    return matched
        _set_for_bits(matched, alive, len(prefix_hashes))
        return matched

    def close(self) -> None:
        self._words.release()
        self._raw.release()
        if self._map is not None:
            self._map.close()


def _set_for_bits(values: list[int], mask: int, value: int) -> None:
    while mask:
        low = mask & -mask
        values[low.bit_length() - 1] = value
        mask ^= low
