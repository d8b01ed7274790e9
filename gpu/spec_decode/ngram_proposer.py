"""Prompt-lookup drafting on the CPU, for the V1 runner.

The V1 runner keeps its batch state on the host, so its proposer does too: a numpy token
history per runner row ([max_num_reqs, max_model_len] int32) plus the row lengths,
updated as requests arrive and tokens are accepted. `propose` runs the torch reference
of kernels/ngram_propose.py on zero-copy views of those arrays, so V1 and the V2 device
kernel draft exactly the same tokens (see that module for the matching rule).

Integration round: the V1 runner calls `add_request` when a request takes a row (prompt
plus any tokens generated before a preemption), `append` with each step's accepted
tokens, and `propose` for the decode rows it schedules next; the drafts go into the
step's input ids after the last sampled token, and kernels/rejection_sample.py verifies
them on the step's logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from actors.protocol.speculative_config import SpeculativeConfig
from kernels.ngram_propose import ngram_propose_ref


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_num_reqs: int, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.token_ids_np = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.total_len_np = np.zeros(max_num_reqs, dtype=np.int32)

    def add_request(self, row: int, token_ids: Sequence[int]) -> None:
        """A request takes `row` with these known tokens (prompt, then earlier outputs)."""
        self._check_fits(row, 0, len(token_ids))
        self.token_ids_np[row, : len(token_ids)] = token_ids
        self.total_len_np[row] = len(token_ids)

    def append(self, row: int, token_ids: Sequence[int]) -> None:
        """Tokens accepted for the request in `row` this step."""
        start = int(self.total_len_np[row])
        self._check_fits(row, start, len(token_ids))
        self.token_ids_np[row, start : start + len(token_ids)] = token_ids
        self.total_len_np[row] = start + len(token_ids)

    def propose(
        self,
        rows_np: np.ndarray,  # [num_reqs] int32, runner rows of the scheduled decode requests
    ) -> tuple[np.ndarray, np.ndarray]:  # [num_reqs, K] int32 (-1 padded), [num_reqs] int32
        """Drafts for each row in `rows_np`, in that order."""
        k = self.config.num_speculative_tokens
        rows_np = np.ascontiguousarray(rows_np, dtype=np.int32)
        if rows_np.size == 0:
            return np.empty((0, k), dtype=np.int32), np.empty(0, dtype=np.int32)
        # Columns past the longest row plus K never hold a match nor a draft, and below the
        # context length the `max_model_len - T` cap does not bind (width - T > K), so
        # narrowing the view changes nothing but the work.
        width = min(self.max_model_len, int(self.total_len_np[rows_np].max()) + k + 1)
        drafts, num_drafts = ngram_propose_ref(
            torch.from_numpy(self.token_ids_np[:, :width]),
            torch.from_numpy(self.total_len_np),
            torch.from_numpy(rows_np),
            k,
            self.config.prompt_lookup_min,
            self.config.prompt_lookup_max,
        )
        return drafts.numpy(), num_drafts.numpy()

    def _check_fits(self, row: int, start: int, num_tokens: int) -> None:
        if start + num_tokens > self.max_model_len:
            raise ValueError(
                f"row {row} would hold {start + num_tokens} tokens, more than "
                f"max_model_len {self.max_model_len}"
            )
