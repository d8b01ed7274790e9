"""The V2 runner's sampler: logits in, one token per row (plus logprobs) out, on the device.

Processing order: logit bias and min_tokens suppression -> penalties -> temperature ->
min-p -> top-k/top-p -> seeded Gumbel-max (greedy rows take the argmax of the processed
logits). Which ops run is decided from the CPU-side numpy mirrors of the batch's rows, so
deciding never syncs the device, and an op no row needs is not launched at all. Logprobs
are those of the raw model logits (vLLM's default "raw_logprobs").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.sampling.state import SamplingState
from kernels.gumbel_sample import gumbel_sample
from kernels.logit_bias import apply_logit_bias
from kernels.min_p import apply_min_p
from kernels.penalties import apply_penalties
from kernels.temperature import apply_temperature
from kernels.top_k_top_p import apply_top_k_top_p
from kernels.topk_logprobs import topk_logprobs


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprob_token_ids: torch.Tensor | None  # [num_rows, 1 + k] int64: the sampled id, then the top k
    logprobs: torch.Tensor | None  # [num_rows, 1 + k] float32, of the raw logits
    sampled_ranks: torch.Tensor | None  # [num_rows] int64, 1 = the most likely token


@dataclass(frozen=True, slots=True)
class BatchOps:
    """Which processing ops one batch needs, read from the numpy mirrors."""

    logit_bias: bool
    """Logit bias, or min_tokens suppression of stop tokens (one kernel does both)."""
    penalties: bool
    temperature: bool
    """Scale the logits before min-p/top-p need them; otherwise the Gumbel kernel does it."""
    min_p: bool
    top_k_top_p: bool
    num_top_k_top_p_candidates: int
    """How many of the largest logits per row top-k/top-p must look at (vocab = full sort)."""

    @property
    def any(self) -> bool:
        return self.logit_bias or self.penalties or self.min_p or self.top_k_top_p


def batch_ops(state: SamplingState, idx_mapping_np: np.ndarray) -> BatchOps:
    """Decide the ops for the rows in `idx_mapping_np` ([num_rows] request rows)."""
    rows = idx_mapping_np
    top_k = state.top_k_np[rows]
    has_top_p = state.top_p_np[rows] < 1.0
    logit_bias = bool((state.num_logit_bias_np[rows] > 0).any()
                      or (state.min_tokens_np[rows] > 0).any())
    min_p = bool((state.min_p_np[rows] > 0.0).any())
    any_top_p = bool(has_top_p.any())
    top_k_top_p = bool((top_k > 0).any()) or any_top_p
    if (has_top_p & (top_k == 0)).any():
        num_candidates = state.vocab_size
    else:
        num_candidates = int(top_k.max(initial=1))
    temperature = state.temperature_np[rows]
    scales = bool(((temperature != 0.0) & (temperature != 1.0)).any())
    return BatchOps(
        logit_bias=logit_bias,
        penalties=bool(state.uses_penalties_np[rows].any()),
        # Top-k alone is indifferent to scaling, so the scaling can wait for the Gumbel kernel.
        temperature=scales and (min_p or any_top_p),
        min_p=min_p,
        top_k_top_p=top_k_top_p,
        num_top_k_top_p_candidates=num_candidates,
    )


class Sampler:
    """Samples with the parameters held in a SamplingState (see the module doc)."""

    def __init__(self, state: SamplingState) -> None:
        self.state = state

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
        idx_mapping_gpu: torch.Tensor,  # [num_rows] int32, logit row -> request row
        idx_mapping_np: np.ndarray,  # [num_rows] the same rows, on the CPU
        positions_gpu: torch.Tensor,  # [num_rows] int64, position the sampled token takes
        num_output_tokens_gpu: torch.Tensor,  # [num_rows] int32, outputs generated so far
        max_num_logprobs: int | None,
        ops: BatchOps | None = None,
    ) -> SamplerOutput:
        """Sample one token per row; with max_num_logprobs = k, also return the raw
        logprobs of the sampled token and of each row's top k tokens. `ops` defaults to
        those these rows need; a caller sampling part of a batch passes the whole batch's,
        so each row takes the path it would take in the whole batch."""
        self._check_args(logits, idx_mapping_np, max_num_logprobs)
        state = self.state
        state.flush_to_device()
        if ops is None:
            ops = batch_ops(state, np.asarray(idx_mapping_np))
        processed = self._process(logits, idx_mapping_gpu, num_output_tokens_gpu, ops)
        sampled = gumbel_sample(processed, idx_mapping_gpu, state.temperature_gpu, state.seed_gpu,
                                positions_gpu, apply_temperature=not ops.temperature)
        if max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        token_ids, logprobs, ranks = topk_logprobs(logits, sampled, max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    def _process(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32
        idx_mapping_gpu: torch.Tensor,  # [num_rows] int32
        num_output_tokens_gpu: torch.Tensor,  # [num_rows] int32
        ops: BatchOps,
    ) -> torch.Tensor:  # [num_rows, vocab_size] float32, a copy when any op runs
        if not ops.any:
            return logits
        state = self.state
        processed = logits.clone()  # the raw logits stay intact for logprobs and the caller
        if ops.logit_bias:
            apply_logit_bias(processed, idx_mapping_gpu, num_output_tokens_gpu,
                             state.num_logit_bias_gpu, state.logit_bias_token_ids_gpu,
                             state.logit_bias_values_gpu, state.min_tokens_gpu,
                             state.num_stop_token_ids_gpu, state.stop_token_ids_gpu)
        if ops.penalties:
            assert state.prompt_mask_gpu is not None and state.output_counts_gpu is not None
            apply_penalties(processed, idx_mapping_gpu, state.repetition_penalty_gpu,
                            state.frequency_penalty_gpu, state.presence_penalty_gpu,
                            state.prompt_mask_gpu, state.output_counts_gpu)
        if ops.temperature:
            apply_temperature(processed, idx_mapping_gpu, state.temperature_gpu)
        if ops.min_p:
            apply_min_p(processed, idx_mapping_gpu, state.min_p_gpu)
        if ops.top_k_top_p:
            apply_top_k_top_p(processed, idx_mapping_gpu, state.top_k_gpu, state.top_p_gpu,
                              ops.num_top_k_top_p_candidates)
        return processed

    def _check_args(self, logits: torch.Tensor, idx_mapping_np: np.ndarray,
                    max_num_logprobs: int | None) -> None:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            raise ValueError("logits must be a [num_rows, vocab_size] tensor")
        num_rows, vocab_size = logits.shape
        if vocab_size != self.state.vocab_size:
            raise ValueError(f"logits have {vocab_size} columns but the sampling state was built "
                             f"for vocab_size={self.state.vocab_size}")
        if len(idx_mapping_np) != num_rows:
            raise ValueError(f"idx_mapping_np has {len(idx_mapping_np)} rows, logits have {num_rows}")
        if max_num_logprobs is not None and not 0 <= max_num_logprobs <= vocab_size:
            raise ValueError(f"max_num_logprobs must be None or in [0, {vocab_size}], "
                             f"got {max_num_logprobs}")
