"""A served model's tokenizer as a Hugging Face tokenizer directory, and as the
`tokenizer_config.json`-shaped object `GET /tokenizer_info` serves (what vLLM answers there
and lm-eval's remote tokenizer reads: special tokens, chat template, added tokens).

    tandem export-tokenizer --model model.gguf ./tok
    transformers.AutoTokenizer.from_pretrained("./tok")   # same ids, same chat template

A GGUF vocabulary has no post-processor; BOS/EOS insertion (`add_bos_token`) is written into
the exported tokenizer.json as one, so `encode(text)` matches tandem's with special tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import processors

from app.tokenizer import Tokenizer

TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    ids = {
        "bos_token": tokenizer.bos_token_id,
        "eos_token": tokenizer.eos_token_id,
        "unk_token": tokenizer.unk_token_id,
        "pad_token": tokenizer.pad_token_id,
    }
    return {name: tokenizer.id_to_token(i) for name, i in ids.items() if i is not None}


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int | None = None) -> dict[str, Any]:
    """tokenizer_config.json for `tokenizer`: class, special tokens, BOS/EOS insertion,
    added tokens and the chat template."""
    added = tokenizer.raw.get_added_tokens_decoder()
    config: dict[str, Any] = {
        "tokenizer_class": TOKENIZER_CLASS,
        **special_tokens(tokenizer),
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": tokenizer.add_eos_token,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "rstrip": t.rstrip,
                "normalized": t.normalized,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(added.items())
        },
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    return config


def tokenizer_info(tokenizer: Tokenizer, model_max_length: int) -> dict[str, Any]:
    """The body of GET /tokenizer_info: tokenizer_config.json with added tokens as their
    text, as vLLM serves it."""
    config = tokenizer_config(tokenizer, model_max_length)
    config["added_tokens_decoder"] = {
        i: t["content"] for i, t in config["added_tokens_decoder"].items()
    }
    return config


def export_tokenizer(
    tokenizer: Tokenizer, out_dir: str, generation_config: dict[str, Any] | None = None
) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    generation_config.json (the EOS ids generation stops on) into `out_dir`; returns the
    paths written."""
    os.makedirs(out_dir, exist_ok=True)
    files = {
        "tokenizer.json": _with_post_processor(tokenizer).to_str(pretty=True),
        "tokenizer_config.json": tokenizer_config(tokenizer),
        "special_tokens_map.json": special_tokens(tokenizer),
        "generation_config.json": _generation_config(tokenizer, generation_config or {}),
    }
    paths = []
    for name, content in files.items():
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                content
                if isinstance(content, str)
                else json.dumps(content, indent=2, ensure_ascii=False) + "\n"
            )
        paths.append(path)
    return paths


def _with_post_processor(tokenizer: Tokenizer) -> RawTokenizer:
    raw = RawTokenizer.from_str(tokenizer.raw.to_str())
    if raw.post_processor is not None:
        return raw
    prefix = _token_piece(tokenizer, tokenizer.bos_token_id, tokenizer.add_bos_token)
    suffix = _token_piece(tokenizer, tokenizer.eos_token_id, tokenizer.add_eos_token)
    if prefix or suffix:
        single = " ".join([*prefix, "$A", *suffix])
        pair = " ".join([*prefix, "$A", *suffix, *prefix, "$B:1", *suffix])
        specials = {
            (tokenizer.id_to_token(i), i)
            for i in (
                tokenizer.bos_token_id if prefix else None,
                tokenizer.eos_token_id if suffix else None,
            )
            if i is not None
        }
        raw.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=sorted(specials)
        )
    return raw


def _token_piece(tokenizer: Tokenizer, token_id: int | None, wanted: bool) -> list[str]:
    return [tokenizer.id_to_token(token_id)] if wanted and token_id is not None else []


def _generation_config(tokenizer: Tokenizer, generation_config: dict[str, Any]) -> dict[str, Any]:
    config = dict(generation_config)
    if tokenizer.eos_token_ids:
        ids = list(tokenizer.eos_token_ids)
        config["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    if tokenizer.bos_token_id is not None:
        config.setdefault("bos_token_id", tokenizer.bos_token_id)
    return config
