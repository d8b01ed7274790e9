"""Which models speak harmony (gpt-oss), and the encoding that renders and parses it.

A model is gpt-oss when its config.json says so (`model_type` "gpt_oss", or the
`GptOssForCausalLM` architecture) or when it is a `dummy:gpt-oss-*` preset; as in vLLM,
this is detected, not configured. Its chat is then rendered and parsed by openai-harmony
instead of a chat template and a tool-call parser.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from openai_harmony import HarmonyEncoding, HarmonyEncodingName, load_harmony_encoding

from actors.protocol.model_source import is_dummy, resolve_model_path
from app.harmony.vocab import ENCODINGS_BASE_ENV, provide_vocab_file

GPT_OSS_MODEL_TYPE = "gpt_oss"
GPT_OSS_ARCHITECTURE = "GptOssForCausalLM"
GPT_OSS_DUMMY_PREFIX = "dummy:gpt-oss"
_LOAD_LOCK = threading.Lock()


def is_gpt_oss(model: str) -> bool:
    """Whether `model` (a --model value) is a gpt-oss model, read from its config.json
    without loading anything. A GGUF file is not recognised."""
    if model in ("", "default"):
        return False  # the embedded model
    source = resolve_model_path(model)
    if is_dummy(source):
        return source.startswith(GPT_OSS_DUMMY_PREFIX)
    path = os.path.join(source, "config.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False  # the engine core reports an unreadable config
    if not isinstance(config, dict):
        return False
    architectures = config.get("architectures")
    return config.get("model_type") == GPT_OSS_MODEL_TYPE or (
        isinstance(architectures, list) and GPT_OSS_ARCHITECTURE in architectures
    )


@dataclass(frozen=True, slots=True)
class HarmonyFormat:
    """The harmony encoding of one served model, and the tokens that end its turn."""

    encoding: HarmonyEncoding
    stop_token_ids: tuple[int, ...]
    """`<|return|>` (the final answer is done) and `<|call|>` (a tool call waits for its
    result); `<|end|>` only ends one message of the turn."""

    @classmethod
    def from_vocab(cls, vocab: Mapping[str, int], cache_dir: str | None = None) -> HarmonyFormat:
        """From the model tokenizer's vocabulary (token string -> id); the encoding's
        vocabulary file is derived from it, so no download is needed. Raises
        app.harmony.vocab.VocabMismatch when the vocabulary is not gpt-oss's, and
        openai_harmony.HarmonyError when the encoding cannot be built."""
        directory = provide_vocab_file(vocab, cache_dir)
        with _LOAD_LOCK:
            # openai-harmony reads the variable when it loads an encoding.
            os.environ[ENCODINGS_BASE_ENV] = directory
            encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        return cls(encoding, tuple(encoding.stop_tokens_for_assistant_actions()))
