"""The device buffers a threshold search (kernels/sampling_thresholds.py) allocates per
launch and hands from pass to pass."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import _threshold_search as search
from kernels import _threshold_stats as first_pass


class SearchBuffers(NamedTuple):
    """Device buffers of one threshold search: the first pass's per-chunk statistics, each
    row's search state and pivots, the rounds' per-chunk partial sums, histograms and
    copied-out candidates (layouts: _threshold_search.py)."""

    stats: torch.Tensor  # [num_rows, num_chunks, NUM_CHUNK_STATS] float32
    state_f: torch.Tensor  # [num_rows, NUM_F] float32
    state_i: torch.Tensor  # [num_rows, NUM_I] int32
    pivots: torch.Tensor  # [num_rows, NUM_PIVOTS] float32
    partials: torch.Tensor  # [num_rows, num_chunks, NUM_PARTIALS] float32
    bin_counts: torch.Tensor  # [num_rows, num_chunks, NUM_BINS] int32
    candidates: torch.Tensor  # [num_rows, CAPACITY] float32

    @classmethod
    def allocate(cls, num_rows: int, num_chunks: int, device: torch.device) -> SearchBuffers:
        def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty((num_rows, *shape), dtype=dtype, device=device)

        return cls(
            stats=empty(num_chunks, first_pass.NUM_CHUNK_STATS),
            state_f=empty(search.NUM_F),
            state_i=empty(search.NUM_I, dtype=torch.int32),
            pivots=empty(search.NUM_PIVOTS),
            partials=empty(num_chunks, search.NUM_PARTIALS),
            bin_counts=empty(num_chunks, search.NUM_BINS, dtype=torch.int32),
            candidates=empty(search.CAPACITY),
        )

    def round_args(self) -> tuple[torch.Tensor, ...]:
        """What the round and finishing kernels take, in their order."""
        return (
            self.partials, self.bin_counts, self.candidates, self.state_f, self.state_i,
            self.pivots,
        )  # fmt: skip
