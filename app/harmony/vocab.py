"""The `o200k_base` vocabulary file that openai-harmony's encoding is built from, derived
offline from the model's own tokenizer.

openai-harmony reads `o200k_base.tiktoken` from the directory named by the environment
variable TIKTOKEN_ENCODINGS_BASE, and checks its sha256 (O200K_SHA256) wherever it comes
from; without that variable it downloads the file, which an offline server cannot. The
file is one line per ordinary token, `base64(token bytes) rank`, ranks 0..199997 in order;
gpt-oss's `tokenizer.json` holds the same tokens as byte-level BPE strings (GPT-2's
byte-to-character table), so mapping them back to bytes reproduces the file byte for
byte, and the hash proves it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from collections.abc import Mapping

from app.byte_level import byte_decoder

ENCODINGS_BASE_ENV = "TIKTOKEN_ENCODINGS_BASE"
VOCAB_FILE_NAME = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""The hash openai-harmony expects of the file."""
NUM_ORDINARY_TOKENS = 199_998
"""Ranks below this are BPE tokens; the special tokens of o200k_harmony follow them."""
CACHE_DIR_ENV = "TANDEM_CACHE_DIR"


class VocabMismatch(ValueError):
    """The tokenizer's vocabulary is not o200k's: it cannot serve the harmony format."""


def tiktoken_vocab_bytes(vocab: Mapping[str, int]) -> bytes:
    """The `o200k_base.tiktoken` file's bytes from a byte-level BPE vocabulary
    (token string -> id, as `tokenizers.Tokenizer.get_vocab()` gives it). Raises
    VocabMismatch when it does not hold o200k's ordinary tokens."""
    decoder = byte_decoder()
    by_rank: list[str | None] = [None] * NUM_ORDINARY_TOKENS
    for token_text, rank in vocab.items():
        if rank < NUM_ORDINARY_TOKENS:
            by_rank[rank] = token_text
    lines = []
    for rank, token in enumerate(by_rank):
        if token is None:
            raise VocabMismatch(f"the vocabulary has no token of id {rank}")
        try:
            token_bytes = bytes(decoder[ch] for ch in token)
        except KeyError:
            raise VocabMismatch(f"token {rank} ({token!r}) is not a byte-level token") from None
        lines.append(base64.b64encode(token_bytes) + b" %d\n" % rank)
    data = b"".join(lines)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise VocabMismatch(
            f"the vocabulary is not o200k_base (sha256 {digest[:12]}..., "
            f"expected {O200K_SHA256[:12]}...)"
        )
    return data


def provide_vocab_file(vocab: Mapping[str, int], cache_dir: str | None = None) -> str:
    """A directory holding a verified `o200k_base.tiktoken`, for TIKTOKEN_ENCODINGS_BASE:
    the variable's own directory when it already holds the right file, else a cache
    directory (`cache_dir`, $TANDEM_CACHE_DIR/harmony, ~/.cache/tandem/harmony, or a new
    temporary one when none is writable) where the file is written from `vocab`. Raises
    VocabMismatch when `vocab` is not o200k's, wherever the file is found."""
    data = tiktoken_vocab_bytes(vocab)
    given = os.environ.get(ENCODINGS_BASE_ENV)
    if given and _holds_verified_file(given):
        return given
    for directory in _cache_dirs(cache_dir):
        if _holds_verified_file(directory):
            return directory
        try:
            os.makedirs(directory, exist_ok=True)
            _write_atomically(directory, data)
        except OSError:
            continue
        return directory
    directory = tempfile.mkdtemp(prefix="tandem-harmony-")
    _write_atomically(directory, data)
    return directory


def _cache_dirs(cache_dir: str | None) -> list[str]:
    if cache_dir is not None:
        return [cache_dir]
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem"
    )
    return [os.path.join(base, "harmony")]


def _holds_verified_file(directory: str) -> bool:
    path = os.path.join(directory, VOCAB_FILE_NAME)
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest() == O200K_SHA256
    except OSError:
        return False


def _write_atomically(directory: str, data: bytes) -> None:
    """Written beside its final name and renamed, so that front-end processes starting
    together never read a half-written file."""
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=".o200k-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp_path, os.path.join(directory, VOCAB_FILE_NAME))
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
