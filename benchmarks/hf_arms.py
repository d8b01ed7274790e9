"""The transformers arms: `generate` on static batches and `generate_batch` (its continuous
batching), on a transformers model whose parameters are views of tandem's weights."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class HFRun:
    elapsed_s: float
    num_output_tokens: int
    num_prompts: int
    batch_size: int | None


def _sampling_kwargs(output_len: int) -> dict[str, Any]:
    # The same distribution as tandem's arm: T=1, no top-k/top-p cut; no EOS, so every
    # output has exactly max_new_tokens tokens.
    return dict(max_new_tokens=output_len, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                eos_token_id=None, pad_token_id=0)


@torch.inference_mode()
def run_hf_static(hf: Any, prompts: list[list[int]], output_len: int, batch_size: int) -> HFRun:
    """`generate` over consecutive batches of equal-length prompts (no padding needed)."""
    device = hf.device
    _synchronize()
    started = time.perf_counter()
    num_tokens = 0
    for start in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[start:start + batch_size], device=device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **_sampling_kwargs(output_len))
        num_tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    _synchronize()
    return HFRun(time.perf_counter() - started, num_tokens, len(prompts), batch_size)


# No inference_mode here: generate_batch runs its loop in a background thread, outside
# inference mode, on tensors it created in this one.
@torch.no_grad()
def run_hf_continuous(hf: Any, prompts: list[list[int]], output_len: int) -> HFRun:
    """`generate_batch`: transformers' continuous batching with its paged cache."""
    from transformers import GenerationConfig

    config = GenerationConfig(**_sampling_kwargs(output_len))
    _synchronize()
    started = time.perf_counter()
    outputs = hf.generate_batch(inputs=prompts, generation_config=config)
    _synchronize()
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(getattr(o, "generated_tokens", ()) or ()) for o in outputs.values())
    if num_tokens == 0:  # its loop logs errors and returns empty outputs instead of raising
        raise RuntimeError(f"generate_batch returned no tokens for {len(prompts)} prompts")
    return HFRun(elapsed, num_tokens, len(prompts), None)


def warm_up_hf(hf: Any, prompts: list[list[int]]) -> None:
    """Compile/allocate once outside the timed region: one short batch."""
    run_hf_static(hf, prompts[:8], 4, 8)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
