"""The fixed-shape tail of a speculative step (the function its CUDA graphs capture: the
tail graphs, gpu/spec_decode/spec_graphs.py, whose module doc describes the layout, and
the uniform steps', gpu/spec_decode/uniform_graphs.py)."""

from __future__ import annotations

import torch

from gpu.input_buffers import InputBuffers
from gpu.runner_v2.states import RequestStates
from gpu.sampling.sampler import Sampler
from gpu.spec_decode.device_drafts import DeviceDrafts
from kernels.rejection_sample import accept_draft_prefix
from kernels.spec_post_update import spec_post_update


def fixed_logits_indices(
    query_start_loc: torch.Tensor,  # [P + 1] int32, padding entries at the token count
    num_draft_slots: torch.Tensor,  # [P] int32, 0 for padding requests
    num_speculative_tokens: int,
) -> torch.Tensor:  # [P, K + 1] int64, token index of each logit row
    """Token index of each fixed logit row (see the module doc). A padding request reads
    the step's last token (index 0 in a step of none), a valid row of the hidden states."""
    ends = query_start_loc[1:].long()[:, None]
    slots = num_draft_slots.long()[:, None]
    offsets = torch.arange(num_speculative_tokens + 1, device=ends.device)[None, :]
    return (ends - 1 - slots + torch.minimum(offsets, slots)).clamp(min=0)


def padded_rows(
    buffers: InputBuffers, num_reqs_padded: int
) -> torch.Tensor:  # [P] int32, padding requests naming the first row
    """The step's request rows, padded to P with its first row (see the module doc)."""
    is_real = torch.arange(num_reqs_padded, device=buffers.device) < buffers.step_counts[0]
    batch_rows = buffers.idx_mapping[:num_reqs_padded]
    return torch.where(is_real, batch_rows, batch_rows[0])


def spec_tail(
    model: torch.nn.Module,
    hidden: torch.Tensor,  # [>= num_tokens, hidden_size], the step's final hidden states
    buffers: InputBuffers,
    num_draft_slots: torch.Tensor,  # [P] int32
    states: RequestStates,
    sampler: Sampler,
    drafts: DeviceDrafts,
    filters: bool,
    *,
    draft_len: int | None = None,
    uniform: bool = False,
    propose: bool = True,
) -> torch.Tensor:  # [P, K + 3] int64: emitted tokens (-1 after), accepted, drafts verified
    """The fixed-shape tail of a speculative step over P padded requests: sample every
    logit row, accept each request's matching draft prefix, write the emitted tokens,
    propose the next drafts (unless propose=False). No host sync and no host-side
    decision: capturable.

    draft_len: the step's K (default the configured one). uniform: every real request ran
    K + 1 tokens (a uniform step, gpu/spec_decode/uniform_graphs.py), of which its
    num_draft_slots slots and the last token are real: its logit rows are its K + 1
    tokens and its post-update rolls back every slot it did not accept, padded or not."""
    num_reqs_padded = num_draft_slots.shape[0]
    num_spec = drafts.num_speculative_tokens if draft_len is None else draft_len
    query_start_loc = buffers.query_start_loc[: num_reqs_padded + 1]
    rows = padded_rows(buffers, num_reqs_padded)
    layout_slots = num_draft_slots
    if uniform:
        is_real = torch.arange(num_reqs_padded, device=hidden.device) < buffers.step_counts[0]
        layout_slots = (is_real * num_spec).to(torch.int32)
    indices = fixed_logits_indices(query_start_loc, layout_slots, num_spec).view(-1)
    logits = model.compute_logits(hidden.index_select(0, indices))
    # contiguous(): for one request the reshape would be a stride-0 view.
    logit_rows = rows[:, None].expand(num_reqs_padded, num_spec + 1).contiguous().view(-1)
    # Logit row j of a request reads its token at position p and predicts position p + 1.
    sampled = sampler.sample_graphable(logits, logit_rows, buffers.positions[indices] + 1, filters)
    state_rows = rows.long()
    slots = num_draft_slots[:, None]
    draft_columns = torch.arange(num_spec, device=hidden.device)[None, :]
    table = drafts.draft_token_ids_gpu[state_rows][:, :num_spec]
    masked_drafts = torch.where(draft_columns < slots, table, -1)
    cu_num_logits = torch.arange(
        0,
        (num_reqs_padded + 1) * (num_spec + 1),
        num_spec + 1,
        dtype=torch.int32,
        device=hidden.device,
    )
    output, num_accepted = accept_draft_prefix(cu_num_logits, masked_drafts, sampled)
    num_draft_tokens = torch.minimum(drafts.num_drafts_gpu[state_rows], num_draft_slots)
    spec_post_update(
        rows,
        query_start_loc,
        layout_slots,
        output,
        num_accepted,
        states.num_computed_gpu,
        states.total_len_gpu,
        states.token_ids_gpu,
        states.last_sampled_gpu,
        step_counts=buffers.step_counts,
    )
    if propose:
        drafts.propose(states, rows)
    return torch.cat(
        [output, num_accepted[:, None].long(), num_draft_tokens[:, None].long()], dim=1
    )
