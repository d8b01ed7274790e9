"""Chained block hashes for the prefix cache.

Block i's hash covers its own token ids and, through its parent's hash, every token
before it, so equal hashes mean equal prefixes. The salt is mixed into every block, so
requests with different salts never share a block. blake2b keeps the hashes stable across
processes and runs (Python's built-in `hash` is randomised per process).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
"""16-byte digest identifying a full block and everything before it."""

_DIGEST_SIZE = 16
_ROOT_PARENT = b"tandem-prefix-v1"  # 16 bytes: the parent of every request's first block
_TOKEN_BYTES = 8  # token ids are packed as int64


def hash_block(
    parent_hash: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None = None
) -> BlockHash:
    """Hash one full block given its parent block's hash (None for the first block)."""
    return _hash_packed(parent_hash, _pack_tokens(token_ids), _salt_bytes(cache_salt))


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    prefix_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`.

    `prefix_hashes` are already known hashes of the first blocks of the same tokens (for
    instance from an earlier call before more tokens were appended); only the blocks after
    them are hashed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    hashes = list(prefix_hashes[:num_full_blocks])
    start_block = len(hashes)
    if start_block == num_full_blocks:
        return hashes
    hashes += chain_block_hashes(
        hashes[-1] if hashes else None,
        token_ids[start_block * block_size : num_full_blocks * block_size],
        block_size,
        cache_salt,
    )
    return hashes


def chain_block_hashes(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, which follow the block hashed as
    `parent_hash` (None: they start the sequence): how blocks completed after admission (by
    decoding) get the same hashes as the same tokens would as a prompt."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    packed = _pack_tokens(token_ids[: num_full_blocks * block_size])
    salt = _salt_bytes(cache_salt)
    block_bytes = block_size * _TOKEN_BYTES
    hashes: list[BlockHash] = []
    parent = parent_hash
    for offset in range(0, len(packed), block_bytes):
        parent = _hash_packed(parent, packed[offset : offset + block_bytes], salt)
        hashes.append(parent)
    return hashes


def _hash_packed(parent_hash: BlockHash | None, packed_tokens: bytes, salt: bytes) -> BlockHash:
    digest = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    digest.update(_ROOT_PARENT if parent_hash is None else parent_hash)
    digest.update(salt)
    digest.update(packed_tokens)
    return digest.digest()


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return array("q", token_ids).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be 64-bit integers: {exc}") from exc


def _salt_bytes(cache_salt: str | None) -> bytes:
    # Length-prefixed so that (salt, tokens) pairs can never run into each other, and a
    # flag byte so that no salt and the empty salt differ.
    if cache_salt is None:
        return b"\x00"
    encoded = cache_salt.encode()
    return b"\x01" + len(encoded).to_bytes(4, "little") + encoded


def token_slice(
    prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], start: int, stop: int
) -> Sequence[int]:
    """Tokens [start, stop) of prompt + outputs, without copying the whole sequence (this
    runs while a long request decodes)."""
    num_prompt_tokens = len(prompt_token_ids)
    if stop <= num_prompt_tokens:
        return prompt_token_ids[start:stop]
    if start >= num_prompt_tokens:
        return output_token_ids[start - num_prompt_tokens : stop - num_prompt_tokens]
    return (*prompt_token_ids[start:], *output_token_ids[: stop - num_prompt_tokens])
