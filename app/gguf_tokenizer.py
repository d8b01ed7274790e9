"""Build a `tokenizers.Tokenizer` from GGUF tokenizer metadata, as llama.cpp tokenizes.

Supports byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) with the
pre-tokenizers llama.cpp selects through `tokenizer.ggml.pre`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class _PreTokenizerSpec:
    regexes: tuple[str, ...]
    """Applied in order, each splitting every piece into matches and the text between."""
    ignore_merges: bool = False
    """llama.cpp looks whole pieces up in the vocabulary before merging (llama3)."""
    add_bos_token: bool = False
    """llama.cpp's default when the file has no `tokenizer.ggml.add_bos_token`."""


_DIGIT_SPLIT = _PreTokenizerSpec((r"\p{N}", _GPT2_REGEX))
_GPT2 = _PreTokenizerSpec((_GPT2_REGEX,))
_LLAMA3 = _PreTokenizerSpec((_LLAMA3_REGEX,), ignore_merges=True, add_bos_token=True)
_QWEN2 = _PreTokenizerSpec((_QWEN2_REGEX,))

# llama.cpp's `tokenizer.ggml.pre` names (llama-vocab.cpp) and the regexes it uses for them.
PRE_TOKENIZERS: dict[str, _PreTokenizerSpec] = {
    "default": _PreTokenizerSpec(
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]")
    ),
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "stablelm2": _QWEN2,
    "smollm": _DIGIT_SPLIT,
    "starcoder": _DIGIT_SPLIT,
    "refact": _DIGIT_SPLIT,
    "command-r": _DIGIT_SPLIT,
    "codeshell": _DIGIT_SPLIT,
    "exaone": _DIGIT_SPLIT,
}


@dataclass(frozen=True, slots=True)
class GGUFTokenizerParts:
    raw: RawTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def build_gguf_tokenizer(metadata: dict[str, Any]) -> GGUFTokenizerParts:
    """Raises ValueError naming what is unsupported or missing."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {model!r}; supported: gpt2 (byte-level BPE)"
        )
    pre_name = str(metadata.get("tokenizer.ggml.pre", "default"))
    spec = PRE_TOKENIZERS.get(pre_name)
    if spec is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre_name!r}; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        ignore_merges=spec.ignore_merges,
    )
    raw = RawTokenizer(bpe)
    raw.pre_tokenizer = _pre_tokenizer(spec)
    raw.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(raw, tokens, metadata.get("tokenizer.ggml.token_type"))

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    extra_eos = tuple(
        i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None
    )
    template = metadata.get("tokenizer.chat_template")
    return GGUFTokenizerParts(
        raw=raw,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        extra_eos_token_ids=extra_eos,
        unk_token_id=token_id("unknown_token_id"),
        pad_token_id=token_id("padding_token_id"),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", spec.add_bos_token)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=template if isinstance(template, str) and template else None,
    )


def _pre_tokenizer(spec: _PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    byte_level_gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if spec is _GPT2:
        return byte_level_gpt2
    if spec is _DIGIT_SPLIT:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level_gpt2]
        )
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in spec.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])


def _add_gguf_added_tokens(raw: RawTokenizer, tokens: list[str], token_types: Any) -> None:
    # CONTROL tokens are special (kept whole, skippable on decode); USER_DEFINED ones are
    # kept whole but are ordinary text.
    if token_types is None:
        return
    types_np = np.asarray(token_types)[: len(tokens)]
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in np.flatnonzero(types_np == TOKEN_TYPE_CONTROL)
    ]
    user_defined = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i in np.flatnonzero(types_np == TOKEN_TYPE_USER_DEFINED)
    ]
    if special:
        raw.add_special_tokens(special)
    if user_defined:
        raw.add_tokens(user_defined)
