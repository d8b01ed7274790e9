"""A float32 transformers reference of the embedded SmolLM2 GGUF, shared by tests.

transformers needs ~40 s to load the GGUF, so the first call converts it once and caches a
plain Hugging Face directory (model.safetensors + tokenizer) under the repository's
.pytest_cache, keyed by the GGUF's size and mtime; later calls (and later test sessions)
reload it in about a second. The cached tokenizer carries the `smollm` digit-split
pre-tokenizer that transformers' GGUF converter forgets, so it tokenizes like llama.cpp.

    from tests._hf_reference import hf_reference_dir, hf_reference_model
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests._embedded_model import embedded_gguf_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CACHE_ENV = "TANDEM_HF_REFERENCE_CACHE"
"""Overrides the cache root (default: <repo>/.pytest_cache/d/tandem_hf_reference)."""


def hf_reference_dir() -> str:
    """Directory with the embedded model as transformers loads it (float32 safetensors,
    config.json, generation_config.json, tokenizer.json, chat template). Skips the calling
    test where the embedded model is not installed."""
    gguf_path = embedded_gguf_path()
    stat = os.stat(gguf_path)
    target = _cache_root() / f"smollm2_{stat.st_size}_{stat.st_mtime_ns}"
    if (target / "model.safetensors").is_file():
        return str(target)
    with _exclusive_lock(_cache_root() / ".lock"):
        if not (target / "model.safetensors").is_file():
            _convert(gguf_path, target)
    return str(target)


@functools.cache
def hf_reference_model() -> Any:
    """The cached reference as a float32 `LlamaForCausalLM` in eval mode (one per process)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_reference_dir(), dtype=torch.float32).eval()


@functools.cache
def hf_reference_tokenizer() -> Any:
    """transformers' tokenizer for the reference (with the llama.cpp-compatible pre-tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_reference_dir())


def smollm_pre_tokenizer() -> Any:
    """What llama.cpp's `smollm` pre-tokenizer does: split digits apart, then GPT-2 split."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _cache_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    repo_root = Path(__file__).resolve().parents[1]
    root = Path(override) if override else repo_root / ".pytest_cache" / "d" / "tandem_hf_reference"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    # Parallel test processes wait for one conversion instead of each spending 40 s on it.
    with open(path, "a+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _convert(gguf_path: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.backend_tokenizer.pre_tokenizer = smollm_pre_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # The weights are already dequantized float32; drop the GGUF quantizer so that
    # save_pretrained accepts the model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=".staging_", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
