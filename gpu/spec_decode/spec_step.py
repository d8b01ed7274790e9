"""A speculative V2 step: verify every row's drafts in the step's one forward, accept,
write the emitted tokens.

The forward is the ordinary one (a mixed CUDA graph when one holds the step's tokens,
eager otherwise): a decoding row with s draft slots runs 1 + s tokens, its last token
and then its drafts, read from the token history (gpu/spec_decode/device_drafts.py).
What differs is the tail, run here eagerly over a variable layout of logit rows (the
steps that need logit bias, min_tokens, penalties or logprobs, and those no graph holds;
the others replay its fixed-shape twin, gpu/spec_decode/spec_graphs.py):

- head: the LM head over 1 + s logit rows per speculating row (1 for the other rows);
- sampling: the ordinary sampler over every logit row (bias, min-tokens, min-p, top-k,
  top-p, the seeded Gumbel draw keyed on the row's position; logprobs when asked), so
  the token drawn at each position is the one the non-speculative sampler would draw;
- acceptance (kernels/rejection_sample.py): drafts are accepted while they equal the
  drawn token, then one more token is emitted; for an ngram draft (a point mass) this is
  exact rejection sampling, and greedy rows accept while the draft is the argmax;
- post-update (kernels/spec_post_update.py): 1 + accepted tokens per row into the history,
  the rejected slots rolled back from the computed count.

Every array describing the logit rows is known on the CPU from the SchedulerOutput (the
slots, not the drafts), so the step needs one extra upload and no sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.runner_v2.states import RequestStates
from gpu.runner_v2.step_plan import StepPlan
from gpu.sampling.sampler import BatchOps, Sampler, SamplerOutput
from gpu.spec_decode.device_drafts import DeviceDrafts
from kernels.rejection_sample import accept_draft_prefix
from kernels.spec_post_update import spec_post_update


@dataclass(frozen=True, slots=True)
class SpecLayout:
    """Where each request's logit rows are, on the CPU and on the device."""

    num_logits: int
    cu_num_logits_np: np.ndarray  # [num_reqs + 1] int64
    logit_rows_np: np.ndarray  # [num_logits] int32, the request row of each logit row
    logits_indices_gpu: torch.Tensor  # [num_logits] int64, token index in the step
    logit_req_gpu: torch.Tensor  # [num_logits] int64, batch position of each logit row
    logit_offset_gpu: torch.Tensor  # [num_logits] int64, 0 .. slots within its request
    cu_num_logits_gpu: torch.Tensor  # [num_reqs + 1] int32
    num_draft_slots_gpu: torch.Tensor  # [num_reqs] int32


def spec_layout(
    plan: StepPlan, num_draft_slots: tuple[int, ...], device: torch.device
) -> SpecLayout:
    num_reqs = plan.num_reqs
    slots = np.asarray(num_draft_slots, dtype=np.int64)
    counts = slots + 1
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    num_logits = int(cu[-1])
    logit_req = np.repeat(np.arange(num_reqs, dtype=np.int64), counts)
    logit_offset = np.arange(num_logits, dtype=np.int64) - cu[logit_req]
    ends = plan.query_start_loc_np[1 : num_reqs + 1].astype(np.int64)
    logits_indices = ends[logit_req] - counts[logit_req] + logit_offset
    packed = np.concatenate([logits_indices, logit_req, logit_offset, cu, slots])
    staging = torch.from_numpy(packed)
    if device.type == "cuda":
        staging = staging.pin_memory()  # a fresh buffer: no in-flight copy reads it again
    on_device = staging.to(device, non_blocking=True)
    sizes = [num_logits, num_logits, num_logits, num_reqs + 1, num_reqs]
    indices, req, offset, cu_gpu, slots_gpu = on_device.split(sizes)
    return SpecLayout(
        num_logits,
        cu,
        plan.idx_mapping_np[logit_req],
        indices,
        req,
        offset,
        cu_gpu.to(torch.int32),
        slots_gpu.to(torch.int32),
    )


@dataclass(frozen=True, slots=True)
class SpecSampled:
    """A speculative step's results on the device (copied to the host by the runner)."""

    output_token_ids: torch.Tensor  # [num_reqs, K + 1] int64, emitted tokens, -1 after
    num_accepted: torch.Tensor  # [num_reqs] int32
    num_draft_tokens: torch.Tensor  # [num_reqs] int32, drafts verified
    sampler: SamplerOutput  # per logit row (logprobs when asked)


def verify_and_update(
    logits: torch.Tensor,  # [num_logits, vocab_size] float32
    layout: SpecLayout,
    idx_mapping_gpu: torch.Tensor,  # [num_reqs] int32
    query_start_loc_gpu: torch.Tensor,  # [num_reqs + 1] int32
    positions_gpu: torch.Tensor,  # [num_tokens] int64, the step's input positions
    states: RequestStates,
    sampler: Sampler,
    drafts: DeviceDrafts,
    ops: BatchOps,
    max_num_logprobs: int | None,
) -> SpecSampled:
    """Sample every logit row, accept each row's matching draft prefix, write the emitted
    tokens into the row state (see the module doc)."""
    rows = idx_mapping_gpu.long()
    logit_rows = idx_mapping_gpu[layout.logit_req_gpu]
    # Logit row j of a request reads its token at position p and predicts position p + 1.
    sample_positions = positions_gpu[layout.logits_indices_gpu] + 1
    logit_state_rows = logit_rows.long()
    num_outputs = (
        states.total_len_gpu[logit_state_rows]
        - states.prompt_len_gpu[logit_state_rows]
        + layout.logit_offset_gpu
    )
    sampled = sampler(
        logits,
        logit_rows,
        layout.logit_rows_np,
        sample_positions,
        num_outputs.to(torch.int32),
        max_num_logprobs,
        ops=ops,
    )
    draft_token_ids = drafts.draft_token_ids_gpu[rows]
    output, num_accepted = accept_draft_prefix(
        layout.cu_num_logits_gpu, draft_token_ids, sampled.sampled_token_ids
    )
    num_draft_tokens = torch.minimum(drafts.num_drafts_gpu[rows], layout.num_draft_slots_gpu)
    is_real = None
    if ops.penalties:  # penalty rows never speculate: their one token is output[:, 0]
        seq_lens = positions_gpu[query_start_loc_gpu[1:].long() - 1] + 1
        is_real = seq_lens >= states.total_len_gpu[rows]
    spec_post_update(
        idx_mapping_gpu,
        query_start_loc_gpu,
        layout.num_draft_slots_gpu,
        output,
        num_accepted,
        states.num_computed_gpu,
        states.total_len_gpu,
        states.token_ids_gpu,
        states.last_sampled_gpu,
    )
    if is_real is not None:
        sampler.state.record_sampled(idx_mapping_gpu, output[:, 0].contiguous(), is_real)
    return SpecSampled(output, num_accepted, num_draft_tokens, sampled)
