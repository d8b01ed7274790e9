"""Prompt logprobs, computed in the prefill from the hidden states the forward already
produced: the hidden state at position p gives the logprob of prompt token p + 1.

Only the rows of requests that asked for them go through the LM head, in chunks of
HEAD_CHUNK_ROWS, and each chunk's logits give the target token's logprob and the top k
through one log-sum-exp pass and a top-k (kernels/topk_logprobs.py): no log-softmax table
is built. Both runners call this once per step that holds such a request; the result
reaches the CPU with the step (a blocking copy, in those steps only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from actors.protocol.messages import LogprobsArrays, PromptLogprobs
from kernels.topk_logprobs import topk_logprobs

HEAD_CHUNK_ROWS = 1024
"""Prompt positions per LM-head call: bounds the float32 logits to 1024 x vocab."""


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """What the runner keeps of a request that asked for prompt logprobs."""

    num_logprobs: int
    prompt_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PromptRows:
    """The step's prompt positions to score."""

    request_ids: tuple[str, ...]
    start_positions: np.ndarray  # [num_requests] int32: the first target position
    num_rows: np.ndarray  # [num_requests] int32
    hidden_rows: np.ndarray  # [total_rows] int64: the flat token index predicting each target
    target_ids: np.ndarray  # [total_rows] int64: the prompt token at each target position
    num_logprobs: int
    """The largest top k among the requests (each front end keeps its own k)."""


def plan_prompt_rows(
    request_ids: Sequence[str],
    num_computed: Sequence[int],
    num_scheduled: Sequence[int],
    wanted: dict[str, PromptRequest],
) -> PromptRows | None:
    """The positions this step scores: for each batch entry (in order) that wants prompt
    logprobs, its chunk [computed, computed + scheduled) predicts the targets up to the
    prompt's last token."""
    if not wanted:
        return None
    ids, starts, counts, hidden, targets, max_k = [], [], [], [], [], 0
    token_offset = 0
    for request_id, computed, scheduled in zip(request_ids, num_computed, num_scheduled):
        request = wanted.get(request_id)
        prompt_len = 0 if request is None else len(request.prompt_token_ids)
        end = min(computed + scheduled, prompt_len - 1)  # position p predicts p + 1
        if request is not None and end > computed:
            ids.append(request_id)
            starts.append(computed + 1)
            counts.append(end - computed)
            hidden.append(np.arange(token_offset, token_offset + end - computed))
            targets.append(np.asarray(request.prompt_token_ids[computed + 1 : end + 1]))
            max_k = max(max_k, request.num_logprobs)
        token_offset += scheduled
    if not ids:
        return None
    return PromptRows(
        tuple(ids),
        np.asarray(starts, np.int32),
        np.asarray(counts, np.int32),
        np.concatenate(hidden).astype(np.int64),
        np.concatenate(targets).astype(np.int64),
        max_k,
    )


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # [num_tokens, hidden_size], the step's flat tokens
    rows: PromptRows,
) -> PromptLogprobs:
    """Score the planned positions; `compute_logits` is the model's LM head (float32)."""
    device = hidden.device
    hidden_rows = torch.from_numpy(rows.hidden_rows).to(device)
    target_ids = torch.from_numpy(rows.target_ids).to(device)
    parts = []
    for start in range(0, len(rows.hidden_rows), HEAD_CHUNK_ROWS):
        chunk = slice(start, start + HEAD_CHUNK_ROWS)
        logits = compute_logits(hidden.index_select(0, hidden_rows[chunk]))
        parts.append(topk_logprobs(logits, target_ids[chunk], rows.num_logprobs))
    token_ids, logprobs, ranks = (torch.cat(column).cpu().numpy() for column in zip(*parts))
    return PromptLogprobs(
        rows.request_ids,
        rows.start_positions,
        rows.num_rows,
        LogprobsArrays(token_ids, logprobs, ranks),
    )
