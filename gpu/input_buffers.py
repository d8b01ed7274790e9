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


class InputBuffers:
    """Persistent device buffers every step writes into.

    `step_meta` packs the two arrays the CPU sends each step, so that one copy carries both:
    `idx_mapping` (batch position -> request row) in its first max_num_reqs entries and
    `query_start_loc` (max_num_reqs + 1 entries) after them.
    """

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32,
                                       device=device)
        self.step_meta = torch.zeros(2 * max_num_reqs + 1, dtype=torch.int32, device=device)
        self.idx_mapping = self.step_meta[:max_num_reqs]
        self.query_start_loc = self.step_meta[max_num_reqs:]

    def upload_step_meta(self, idx_mapping_np: np.ndarray,  # [num_reqs] int32
                         query_start_loc_np: np.ndarray,  # [num_reqs_padded + 1] int32
                         ) -> None:
        """Send one step's idx_mapping and (padded) query_start_loc in a single copy.

        On CUDA the host side is a fresh pinned buffer from the caching host allocator,
        which hands the memory out again only once the copy reading it has run: the CPU
        never overwrites what an in-flight copy still reads.
        """
        num_reqs, num_entries = idx_mapping_np.shape[0], query_start_loc_np.shape[0]
        if num_reqs > self.max_num_reqs or num_entries > self.max_num_reqs + 1:
            raise ValueError(f"a step of {num_reqs} requests ({num_entries - 1} padded) exceeds "
                             f"the buffers' max_num_reqs {self.max_num_reqs}")
        num_meta = self.max_num_reqs + num_entries
        staging = torch.empty(num_meta, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host = staging.numpy()
        host[:num_reqs] = idx_mapping_np  # entries up to max_num_reqs are never read
        host[self.max_num_reqs:] = query_start_loc_np
        self.step_meta[:num_meta].copy_(staging, non_blocking=True)
