"""What a V2 step looks like to the device, decided on the CPU from the SchedulerOutput.

A step runs as up to three parts: the forward (input prep + model), the head (the rows
that sample, through the LM head) and sampling (+ post_update). Each part replays a CUDA
graph when one of its shape holds the step, and runs eagerly otherwise:

- forward, decode steps (every request one token): the decode graph of the smallest
  captured request count >= num_reqs; its padding rows are one-token requests with no
  context (query_start_loc continues one token per row).
- forward, mixed steps (prefill chunks next to decodes): the mixed graph of the smallest
  captured token count T >= num_tokens; it covers min(T, max_num_reqs) request rows, the
  padding ones with no tokens (query_start_loc stays at num_tokens), and the attention
  reads every length from the device, so one graph serves any split of T tokens.
- head and sampling: graphs per padded request count (the decode sizes).

The kernels inside a graph read the real counts from `InputBuffers.step_counts`, so only
`idx_mapping`, `query_start_loc` and the two counts cross from the CPU each step.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from actors.protocol.messages import SchedulerOutput


def padded_batch_size(sizes: Sequence[int], count: int) -> int | None:
    """The smallest captured size that holds `count`, or None (run eagerly)."""
    index = bisect.bisect_left(sizes, count)
    return sizes[index] if index < len(sizes) else None


@dataclass(frozen=True, slots=True)
class GraphSizes:
    decode: tuple[int, ...]
    """Request counts of the decode forward graphs and of the head and sampling graphs."""
    mixed: tuple[int, ...]
    """Token counts of the mixed forward graphs."""
    max_num_reqs: int

    def mixed_num_reqs(self, num_tokens: int) -> int:
        """Request rows a mixed graph of num_tokens covers (each request has >= 1 token)."""
        return min(num_tokens, self.max_num_reqs)


@dataclass(frozen=True, slots=True)
class ForwardShape:
    is_decode: bool
    num_tokens: int
    num_reqs: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    num_reqs: int
    num_tokens: int
    max_query_len: int
    idx_mapping_np: np.ndarray  # [num_reqs] int32 rows
    query_start_loc_np: np.ndarray  # [bound + 1] int32: the real prefix sums, then padding
    seq_lens_np: np.ndarray  # [num_reqs] int32: computed + scheduled tokens
    forward: ForwardShape | None
    """The forward graph to replay; None: the forward runs eagerly."""
    num_rows_padded: int
    """Rows the head and sampling graphs run (num_reqs when no graph holds the step)."""
    tail_graphed: bool


def plan_step(sched: SchedulerOutput, row_of: dict[str, int], sizes: GraphSizes | None) -> StepPlan:
    num_reqs = sched.num_reqs
    num_scheduled = np.asarray(sched.num_scheduled_tokens, dtype=np.int32)
    idx_mapping_np = np.fromiter(
        (row_of[r] for r in sched.scheduled_request_ids), dtype=np.int32, count=num_reqs
    )
    exact = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_scheduled, out=exact[1:])
    num_tokens = int(exact[-1])
    max_query_len = int(num_scheduled.max())
    seq_lens_np = np.asarray(sched.num_computed_tokens, dtype=np.int32) + num_scheduled
    forward, rows_padded = _graph_shapes(sizes, num_reqs, num_tokens, max_query_len)
    if forward is not None and forward.is_decode:
        query_start_loc_np = np.arange(forward.num_reqs + 1, dtype=np.int32)
    else:
        bound = max(rows_padded or num_reqs, forward.num_reqs if forward is not None else 0)
        query_start_loc_np = np.full(bound + 1, num_tokens, dtype=np.int32)
        query_start_loc_np[: num_reqs + 1] = exact
    return StepPlan(
        num_reqs,
        num_tokens,
        max_query_len,
        idx_mapping_np,
        query_start_loc_np,
        seq_lens_np,
        forward,
        rows_padded or num_reqs,
        rows_padded is not None,
    )


def _graph_shapes(
    sizes: GraphSizes | None, num_reqs: int, num_tokens: int, max_query_len: int
) -> tuple[ForwardShape | None, int | None]:
    if sizes is None:
        return None, None
    rows_padded = padded_batch_size(sizes.decode, num_reqs)
    if rows_padded is None:
        return None, None
    if max_query_len == 1:
        return ForwardShape(True, rows_padded, rows_padded), rows_padded
    mixed_tokens = padded_batch_size(sizes.mixed, num_tokens)
    if mixed_tokens is not None and rows_padded <= sizes.mixed_num_reqs(mixed_tokens):
        return ForwardShape(False, mixed_tokens, sizes.mixed_num_reqs(mixed_tokens)), rows_padded
    return None, rows_padded
