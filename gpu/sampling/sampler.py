"""The V2 runner's sampler: logits in, one token per row (plus logprobs) out, on the device.

Processing order: logit bias and min_tokens suppression -> penalties -> temperature ->
min-p -> top-k/top-p -> seeded Gumbel-max (greedy rows take the argmax of the processed
logits). Bias and penalties rewrite a copy of the logits; temperature, min-p, top-k and
top-p never write: a per-row threshold (kernels/sampling_thresholds.py, no sort) and the
temperature go into the Gumbel kernel, which skips the tokens below the threshold. Which
ops run is decided from the CPU-side numpy mirrors of the batch's rows, so deciding never
syncs the device, and an op no row needs is not launched at all. Logprobs are those of
the raw model logits (vLLM's default "raw_logprobs").

`sample_graphable` is the same sampling with no host-side decisions, for a CUDA graph: the
threshold kernels run for every row and leave the unfiltered rows at -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.sampling.state import SamplingState
from kernels.gumbel_sample import gumbel_sample
from kernels.logit_bias import apply_logit_bias
from kernels.penalties import apply_penalties
from kernels.sampling_thresholds import sampling_thresholds
from kernels.topk_logprobs import topk_logprobs


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprob_token_ids: (
        torch.Tensor | None
    )  # [num_rows, 1 + k] int64: the sampled id, then the top k
    logprobs: torch.Tensor | None  # [num_rows, 1 + k] float32, of the raw logits
    sampled_ranks: torch.Tensor | None  # [num_rows] int64, 1 = the most likely token


@dataclass(frozen=True, slots=True)
class BatchOps:
    """Which processing ops one batch needs, read from the numpy mirrors."""

    logit_bias: bool
    """Logit bias, or min_tokens suppression of stop tokens (one kernel does both)."""
    penalties: bool
    filters: bool
    """Some row uses min-p, top-k or top-p: the threshold kernels run."""

    @property
    def rewrites_logits(self) -> bool:
        return self.logit_bias or self.penalties


def batch_ops(state: SamplingState, idx_mapping_np: np.ndarray) -> BatchOps:
    """Decide the ops for the rows in `idx_mapping_np` ([num_rows] request rows)."""
    rows = idx_mapping_np
    return BatchOps(
        logit_bias=bool(
            (state.num_logit_bias_np[rows] > 0).any() or (state.min_tokens_np[rows] > 0).any()
        ),
        penalties=bool(state.uses_penalties_np[rows].any()),
        filters=bool(
            (state.top_k_np[rows] > 0).any()
            or (state.top_p_np[rows] < 1.0).any()
            or (state.min_p_np[rows] > 0.0).any()
        ),
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
        thresholds = None
        if ops.filters:
            thresholds = sampling_thresholds(
                processed,
                idx_mapping_gpu,
                state.temperature_gpu,
                state.top_k_gpu,
                state.top_p_gpu,
                state.min_p_gpu,
            )
        sampled = gumbel_sample(
            processed,
            idx_mapping_gpu,
            state.temperature_gpu,
            state.seed_gpu,
            positions_gpu,
            thresholds=thresholds,
        )
        if max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        token_ids, logprobs, ranks = topk_logprobs(logits, sampled, max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    def sample_graphable(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
        idx_mapping_gpu: torch.Tensor,  # [num_rows] int32, logit row -> request row
        positions_gpu: torch.Tensor,  # [num_rows] int64, position the sampled token takes
        filters: bool = True,
    ) -> torch.Tensor:  # [num_rows] int64
        """Temperature, min-p, top-k, top-p (unless filters=False: a batch where no row uses
        them) and the Gumbel draw for every row, with no host-side decision and no host sync
        (capturable in a CUDA graph). Logit bias, penalties and logprobs are not applied:
        batches that need them go through __call__."""
        state = self.state
        thresholds = None
        if filters:
            thresholds = sampling_thresholds(
                logits,
                idx_mapping_gpu,
                state.temperature_gpu,
                state.top_k_gpu,
                state.top_p_gpu,
                state.min_p_gpu,
            )
        return gumbel_sample(
            logits,
            idx_mapping_gpu,
            state.temperature_gpu,
            state.seed_gpu,
            positions_gpu,
            thresholds=thresholds,
        )

    def _process(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32
        idx_mapping_gpu: torch.Tensor,  # [num_rows] int32
        num_output_tokens_gpu: torch.Tensor,  # [num_rows] int32
        ops: BatchOps,
    ) -> torch.Tensor:  # [num_rows, vocab_size] float32, a copy when bias or penalties apply
        if not ops.rewrites_logits:
            return logits
        state = self.state
        processed = logits.clone()  # the raw logits stay intact for logprobs and the caller
        if ops.logit_bias:
            apply_logit_bias(
                processed,
                idx_mapping_gpu,
                num_output_tokens_gpu,
                state.num_logit_bias_gpu,
                state.logit_bias_token_ids_gpu,
                state.logit_bias_values_gpu,
                state.min_tokens_gpu,
                state.num_stop_token_ids_gpu,
                state.stop_token_ids_gpu,
            )
        if ops.penalties:
            assert state.prompt_mask_gpu is not None and state.output_counts_gpu is not None
            apply_penalties(
                processed,
                idx_mapping_gpu,
                state.repetition_penalty_gpu,
                state.frequency_penalty_gpu,
                state.presence_penalty_gpu,
                state.prompt_mask_gpu,
                state.output_counts_gpu,
            )
        return processed

    def _check_args(
        self, logits: torch.Tensor, idx_mapping_np: np.ndarray, max_num_logprobs: int | None
    ) -> None:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            raise ValueError("logits must be a [num_rows, vocab_size] tensor")
        num_rows, vocab_size = logits.shape
        if vocab_size != self.state.vocab_size:
            raise ValueError(
                f"logits have {vocab_size} columns but the sampling state was built "
                f"for vocab_size={self.state.vocab_size}"
            )
        if len(idx_mapping_np) != num_rows:
            raise ValueError(
                f"idx_mapping_np has {len(idx_mapping_np)} rows, logits have {num_rows}"
            )
        if max_num_logprobs is not None and not 0 <= max_num_logprobs <= vocab_size:
            raise ValueError(
                f"max_num_logprobs must be None or in [0, {vocab_size}], got {max_num_logprobs}"
            )
