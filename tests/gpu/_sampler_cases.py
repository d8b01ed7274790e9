"""What test_sampler.py and test_sampler_cuda.py share: a Sampler over requests with given
sampling params (and output tokens so far), one sampler call over a batch of rows, and
seeded random logits."""

from __future__ import annotations

import numpy as np
import torch

from actors.protocol.sampling_params import SamplingParams
from gpu.sampling.sampler import Sampler, SamplerOutput
from gpu.sampling.state import SamplingState

VOCAB = 64
EOS = 7


def _sampler(
    params_by_row: dict[int, SamplingParams],
    vocab_size: int = VOCAB,
    device: str = "cpu",
    outputs: dict[int, list[int]] | None = None,
) -> Sampler:
    state = SamplingState(max_num_reqs=32, vocab_size=vocab_size, device=device)
    for row, params in params_by_row.items():
        state.add_request(
            row,
            params,
            prompt_token_ids=[1, 2, 3],
            output_token_ids=(outputs or {}).get(row, []),
            eos_token_ids=[EOS],
            default_seed=1000 + row,
        )
    return Sampler(state)


def _run(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[int] | np.ndarray,
    positions: list[int] | np.ndarray,
    num_output_tokens: list[int] | None = None,
    max_num_logprobs: int | None = None,
) -> SamplerOutput:
    device = sampler.state.device
    idx_np = np.asarray(rows, dtype=np.int32)
    num_output = np.zeros(len(idx_np)) if num_output_tokens is None else num_output_tokens
    return sampler(
        logits.to(device),
        torch.from_numpy(idx_np).to(device),
        idx_np,
        torch.as_tensor(np.asarray(positions), dtype=torch.int64, device=device),
        torch.as_tensor(np.asarray(num_output), dtype=torch.int32, device=device),
        max_num_logprobs,
    )


def _logits(
    num_rows: int, vocab_size: int = VOCAB, seed: int = 0, scale: float = 1.0
) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale
