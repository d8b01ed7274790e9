"""The persistent device buffers a V2 step is built in, and the CUDA graphs replay on.

Allocated once per loaded model (the worker owns them), so their addresses never change:
every step writes its inputs into them and a captured graph reads them in place. Rows past
a step's real requests and tokens are padding: token id 0, position 0, sequence length 0,
slot -1 (no KV write) and an all-zero block-table row, so a padded request attends to
nothing and writes nothing.
"""

from __future__ import annotations

import numpy as np
import torch

_NUM_COUNTS = 2


class InputBuffers:
    """Persistent device buffers every step writes into.

    `step_meta` packs what the CPU sends each step, so that one copy carries it all:
    `step_counts` = [num_reqs, num_tokens] (kernels inside a CUDA graph read the real
    counts there), then `idx_mapping` (batch position -> request row; max_num_reqs
    entries, those past the step's requests name row 0) and `query_start_loc`
    (max_num_reqs + 1 entries).
    """

    def __init__(
        self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int, device: torch.device
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(
            max_num_reqs, max_blocks_per_req, dtype=torch.int32, device=device
        )
        self.step_meta = torch.zeros(
            _NUM_COUNTS + 2 * max_num_reqs + 1, dtype=torch.int32, device=device
        )
        self.step_counts = self.step_meta[:_NUM_COUNTS]
        self.idx_mapping = self.step_meta[_NUM_COUNTS : _NUM_COUNTS + max_num_reqs]
        self.query_start_loc = self.step_meta[_NUM_COUNTS + max_num_reqs :]

    def check_fits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """A runner's batch limits must fit these buffers (allocated once, at load)."""
        if max_num_seqs > self.max_num_reqs or max_num_batched_tokens > self.max_num_tokens:
            raise ValueError(
                f"the runner's max_num_seqs {max_num_seqs} / max_num_batched_tokens "
                f"{max_num_batched_tokens} exceed the loaded model's "
                f"{self.max_num_reqs} / {self.max_num_tokens}"
            )

    def upload_step_meta(
        self,
        idx_mapping_np: np.ndarray,  # [num_reqs] int32
        query_start_loc_np: np.ndarray,  # [num_reqs_padded + 1] int32
        num_tokens: int | None = None,
    ) -> None:
        """Send one step's counts, idx_mapping and (padded) query_start_loc in a single copy;
        num_tokens defaults to query_start_loc_np[num_reqs].

        On CUDA the host side is a fresh pinned buffer from the caching host allocator,
        which hands the memory out again only once the copy reading it has run: the CPU
        never overwrites what an in-flight copy still reads.
        """
        num_reqs, num_entries = idx_mapping_np.shape[0], query_start_loc_np.shape[0]
        if num_reqs > self.max_num_reqs or num_entries > self.max_num_reqs + 1:
            raise ValueError(
                f"a step of {num_reqs} requests ({num_entries - 1} padded) exceeds "
                f"the buffers' max_num_reqs {self.max_num_reqs}"
            )
        start = _NUM_COUNTS + self.max_num_reqs
        staging = torch.empty(
            start + num_entries, dtype=torch.int32, pin_memory=self.device.type == "cuda"
        )
        host = staging.numpy()
        host[0] = num_reqs
        host[1] = query_start_loc_np[num_reqs] if num_tokens is None else num_tokens
        host[_NUM_COUNTS : _NUM_COUNTS + num_reqs] = idx_mapping_np
        host[_NUM_COUNTS + num_reqs : start] = 0  # padding rows of a graph read some valid row
        host[start:] = query_start_loc_np
        self.step_meta[: start + num_entries].copy_(staging, non_blocking=True)
