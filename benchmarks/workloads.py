"""Benchmark workloads: fixed-length random prompts on dummy weights, vLLM-style.

Every request has the same prompt and output length (`ignore_eos`, max_tokens = output
length), so each arm does exactly the same work and output tokens/s compares directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    model: str
    num_prompts: int
    input_len: int
    output_len: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


TANDEM_ARMS = ("v2", "v1")
HF_ARMS = ("hf_static", "hf_continuous")
"""transformers `generate` on static batches, and `generate_batch` (continuous batching)."""

WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", "dummy:qwen3-0.6b", 1024, 128, 512),
    "W2": Workload("W2", "dummy:qwen3-0.6b", 1000, 1024, 128),
    "W3": Workload("W3", "dummy:llama-3.1-8b", 1024, 128, 512),
}


def workload_by_name(name: str) -> Workload:
    try:
        return WORKLOADS[name.upper()]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0
                   ) -> list[list[int]]:
    """Distinct uniformly random token-id prompts (no shared prefixes to cache)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num_prompts, input_len)).tolist()
