"""The front end's own tokenizer and generation defaults, read from the model files (or from
`--tokenizer`) without loading any weights: the engine core never hands them out.

`--tokenizer` takes a `tokenizer.json` file or a Hugging Face tokenizer directory, so any
weights (dummy ones included) can be paired with a real tokenizer, as vLLM's flag does.

A gpt-oss model's tokenizer also carries `harmony` (app.harmony.model.HarmonyFormat): its
chat is rendered and parsed in the harmony format, with the encoding built offline from
this tokenizer's vocabulary.
"""

from __future__ import annotations

import json
import os
from typing import Any

from actors.protocol.model_source import ModelLoadError, is_dummy, resolve_model_path
from app.harmony.model import HarmonyFormat, is_gpt_oss
from app.prompt_bounds import chars_per_token
from app.tokenizer import Tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"


def load_tokenizer(model: str, tokenizer: str | None = None) -> Tokenizer | None:
    """The tokenizer for `model`, or from `tokenizer` when given. None when the source has
    none (dummy weights, a directory without tokenizer.json, a GGUF without tokenizer
    metadata). Raises ModelLoadError naming the file when one exists but cannot be read."""
    source = resolve_model_path(tokenizer if tokenizer else model)
    if is_dummy(source):
        if tokenizer:
            raise ModelLoadError(
                f"--tokenizer must be a tokenizer.json file or a directory, got {tokenizer!r}"
            )
        return None
    if not os.path.exists(source):
        if tokenizer:
            raise ModelLoadError(f"tokenizer not found: {source}")
        return None  # the engine core reports the missing model
    try:
        loaded = _load(source, generation_config=load_generation_config(model))
    except ModelLoadError:
        raise
    except Exception as exc:  # tokenizers, JSON and OS errors all mean "cannot read it"
        raise ModelLoadError(
            " ".join(f"cannot load the tokenizer from {source}: {exc}".split())
        ) from exc
    if loaded is not None and is_gpt_oss(model):
        loaded.harmony = _harmony_format(loaded, source)
    return loaded


def _harmony_format(tokenizer: Tokenizer, source: str) -> HarmonyFormat:
    try:
        return HarmonyFormat.from_vocab(tokenizer.raw.get_vocab(with_added_tokens=False))
    except Exception as exc:  # a foreign vocabulary, or an encoding that cannot be built
        raise ModelLoadError(
            " ".join(
                f"this gpt-oss model's chat needs its own tokenizer (o200k_harmony), and the "
                f"one from {source} cannot serve it: {exc}".split()
            )
        ) from exc


def load_generation_config(model: str) -> dict[str, Any]:
    """A Hugging Face directory's generation_config.json; {} when absent (GGUF, dummy)."""
    source = resolve_model_path(model)
    path = os.path.join(source, GENERATION_CONFIG_FILE)
    if is_dummy(source) or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return value


def load_warm_tokenizer(model: str, tokenizer_source: str | None) -> Tokenizer | None:
    """The front end's tokenizer, with its chat template compiled, its encoder and decoder
    run once and its characters-per-token bound computed, so the first request pays for
    none of them (reading the vocabulary for the bound is one call that holds the GIL,
    tens of milliseconds for a large vocabulary)."""
    tokenizer = load_tokenizer(model, tokenizer_source)
    if tokenizer is not None:
        chars_per_token(tokenizer)
        text = "warm up"
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
        except Exception:  # noqa: BLE001 - a template that cannot render is the request's 400
            pass
        tokenizer.decode(tokenizer.encode(text))
    return tokenizer


def _load(source: str, generation_config: dict[str, Any]) -> Tokenizer | None:
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "tokenizer.json")):
            return None
        return Tokenizer.from_hf_dir(source, generation_config or None)
    if os.path.basename(source) == "tokenizer.json" or source.endswith(".json"):
        return Tokenizer.from_json_file(source, generation_config or None)
    from gpu.weights.gguf_file import GGUF_MAGIC, GGUFFile  # numpy only, no torch

    with open(source, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(
                f"cannot load the tokenizer from {source}: expected a GGUF "
                "file, a tokenizer.json or a Hugging Face directory"
            )
    metadata = GGUFFile(source).metadata
    if "tokenizer.ggml.model" not in metadata:
        return None
    return Tokenizer.from_gguf(metadata)
