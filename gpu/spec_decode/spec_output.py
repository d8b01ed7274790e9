"""A speculative step's result on the CPU: a variable number of tokens per request, and
the step's acceptance counts under vLLM's spec_decode metric names."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from actors.protocol.messages import LogprobsArrays, SpecDecodeStats, StepOutput
from gpu.runner_v2.async_output import PendingStep


@dataclass(slots=True)
class SpecCopy:
    output_token_ids: torch.Tensor  # [num_reqs, K + 1] int64, host
    num_accepted: torch.Tensor  # [num_reqs] int32, host
    num_draft_tokens: torch.Tensor  # [num_reqs] int32, host
    logprob_token_ids: torch.Tensor | None  # [num_logits, 1 + k], host
    logprobs: torch.Tensor | None  # [num_logits, 1 + k] float32, host
    sampled_ranks: torch.Tensor | None  # [num_logits], host


class SpecPendingStep(PendingStep):
    """A launched speculative step; `result()` packs the emitted tokens request-major."""

    def __init__(
        self,
        *args: object,
        cu_num_logits_np: np.ndarray | None,  # [num_reqs + 1], read for logprobs
        num_speculative_tokens: int,
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._cu_num_logits_np = cu_num_logits_np
        self._num_speculative_tokens = num_speculative_tokens

    def result(self) -> StepOutput:
        if self._event is not None:
            self._event.synchronize()
        if self._timing is not None:
            self._stats = self._timing.stats(self._stats)
        copy: SpecCopy = self._copy  # type: ignore[assignment]
        keep = self._samples_token
        num_accepted = copy.num_accepted.numpy()[keep].astype(np.int64)
        num_drafts = copy.num_draft_tokens.numpy()[keep].astype(np.int32)
        output = copy.output_token_ids.numpy()[keep]
        emitted = np.arange(output.shape[1])[None, :] <= num_accepted[:, None]
        logprobs = None
        if copy.logprobs is not None:
            starts = self._cu_num_logits_np[:-1][keep]
            rows = (
                np.concatenate([np.arange(s, s + n + 1) for s, n in zip(starts, num_accepted)])
                if starts.size
                else np.zeros(0, np.int64)
            )
            logprobs = LogprobsArrays(
                copy.logprob_token_ids.numpy()[rows],
                copy.logprobs.numpy()[rows],
                copy.sampled_ranks.numpy()[rows],
            )
        stats = msgspec.structs.replace(
            self._stats, spec=spec_stats(num_drafts, num_accepted, self._num_speculative_tokens)
        )
        request_ids = tuple(r for r, k in zip(self.request_ids, keep) if k)
        return StepOutput(
            step_id=self.step_id,
            request_ids=request_ids,
            sampled_token_ids=output[emitted],
            logprobs=logprobs,
            stats=stats,
            num_sampled_tokens=(num_accepted + 1).astype(np.int32),
            num_draft_tokens=num_drafts,
        )


def spec_stats(
    num_drafts: np.ndarray, num_accepted: np.ndarray, num_speculative_tokens: int
) -> SpecDecodeStats:
    positions = np.arange(num_speculative_tokens)
    return SpecDecodeStats(
        num_drafts=int((num_drafts > 0).sum()),
        num_draft_tokens=int(num_drafts.sum()),
        num_accepted_tokens=int(num_accepted.sum()),
        num_accepted_tokens_per_pos=tuple(
            int(v) for v in (num_accepted[:, None] > positions[None, :]).sum(0)
        ),
    )
