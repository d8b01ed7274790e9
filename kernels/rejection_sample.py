"""Verification of ngram drafts: accept a prefix of each row's drafts, then one more token.

Scheduled request b (row r = idx_mapping[b]) ran its last token plus d_b draft tokens
in one forward, so it has d_b + 1 target logit rows, logits[cu[b] .. cu[b+1] - 1]
(cu = cu_num_logits, d_b = cu[b+1] - cu[b] - 1 <= K); logit row j predicts the token
at position positions[b] + j. For each of them, let s_j be the token the ordinary
sampler would draw there: the seeded Gumbel-max draw of kernels/gumbel_sample.py, keyed
on (seed[r], positions[b] + j, token id), or the argmax for a greedy row. Then

    num_accepted[b] = the first j < d_b with draft[b, j] != s_j, or d_b if there is none
    output[b] = s_0 .. s_{num_accepted}   (the accepted drafts, then one corrected or bonus token)

Greedy rows: accept while the draft equals the argmax, then emit the argmax.
Sampled rows: this is rejection sampling for a point-mass draft distribution, which is what
an ngram draft is (q = 1 at the draft token d): the draft is accepted with probability
min(1, p(d) / q(d)) = p(d), and on rejection the token comes from the residual
max(0, p - q) renormalised = p with d removed. The Gumbel draw realises both at once:
P(s_j == d) = p(d), and given s_j != d, s_j is distributed as p restricted to the other
tokens. Positions after a rejection are never used, and each position has its own noise,
so the output sequence has exactly the target distribution; more than that, it is
token for token what the non-speculative sampler produces with the same seed, so seeded
requests are reproducible and batch-invariant with or without speculation.

`logits` are the target logits after every other sampling op (bias, penalties, min-p,
top-k/top-p), read per logit row through the expanded request row, like the ordinary
sampler's; the temperature is applied here unless the caller already did. Outputs:
output_token_ids [num_reqs, K + 1] int64 (-1 after the emitted tokens) and num_accepted
[num_reqs] int32 (0..d_b; the row emits num_accepted + 1 tokens).

Integration round (how the V2 runner and scheduler will use this):
- the scheduler schedules 1 + K tokens per decode row (the last sampled token plus the
  row's drafts, which it does not know: it counts up to 1 + K output placeholders), and
  budgets KV slots for all of them;
- the runner's input preparation writes the last sampled token and the drafts from the
  device draft table (kernels/ngram_propose.py) into input_ids, builds cu_num_logits from
  the draft counts and computes logits at those rows only;
- post_update appends output[b, :num_accepted + 1] to the token history, sets the last
  sampled token, and advances num_computed_tokens by num_accepted + 1 only: the rejected
  drafts' KV slots hold stale entries at positions that the next step computes again and
  overwrites, so rolling num_computed_tokens back is all the reuse needs (their blocks
  stay with the request, and prefix-cache hashes cover accepted tokens only);
  ngram_propose then drafts the next step's tokens from the updated history on the device;
- the step output carries a variable number of new tokens per request (offsets plus a
  flat token array); the scheduler appends them, drops the placeholders it counted beyond
  them and sets its num_computed_tokens mirror from the accepted count; EOS / stop ids /
  max_tokens are checked token by token, so a stop inside the accepted run truncates it;
- acceptance metrics under vLLM's names: vllm:spec_decode_num_drafts (rows verified with
  >= 1 draft), vllm:spec_decode_num_draft_tokens (sum of d_b),
  vllm:spec_decode_num_accepted_tokens (sum of num_accepted) and
  vllm:spec_decode_num_accepted_tokens_per_pos (per draft position j, rows that accepted
  it), plus the per-request acceptance rate on its span;
- runner selection: ngram leaves rule 5 once V2 serves it; speculation stays on V1 only
  when combined with a V1-only feature (--compile-level, or custom logits processors,
  which would then have to see the K + 1 rows of each request: vLLM refuses that
  combination outright), V1 drafting with gpu/spec_decode/ngram_proposer.py.
"""

from __future__ import annotations

import torch

from kernels._checks import check_dtype_and_rank, check_offsets, check_triton_device, need_triton
from kernels._triton import HAS_TRITON, tl, triton
from kernels.gumbel_sample import gumbel_sample_ref, gumbel_sample_triton

if HAS_TRITON:

    @triton.jit
    def _accept_prefix_kernel(
        cu_num_logits_ptr,
        draft_token_ids_ptr,
        draft_token_ids_stride,
        sampled_ptr,
        output_token_ids_ptr,
        num_accepted_ptr,
        MAX_NUM_DRAFTS: tl.constexpr,
        NUM_OUTPUTS_POW2: tl.constexpr,
    ):
        req = tl.program_id(0)
        first_logit = tl.load(cu_num_logits_ptr + req)
        num_drafts = tl.load(cu_num_logits_ptr + req + 1) - first_logit - 1
        num_drafts = tl.minimum(tl.maximum(num_drafts, 0), MAX_NUM_DRAFTS)
        offsets = tl.arange(0, NUM_OUTPUTS_POW2)
        sampled = tl.load(sampled_ptr + first_logit + offsets, mask=offsets <= num_drafts, other=-1)
        drafts = tl.load(
            draft_token_ids_ptr + req * draft_token_ids_stride + offsets,
            mask=offsets < num_drafts,
            other=-1,
        ).to(tl.int64)
        stops = ((offsets < num_drafts) & (drafts != sampled)) | (offsets == num_drafts)
        num_accepted = tl.min(tl.where(stops, offsets, NUM_OUTPUTS_POW2), 0)
        tl.store(
            output_token_ids_ptr + req * (MAX_NUM_DRAFTS + 1) + offsets,
            tl.where(offsets <= num_accepted, sampled, -1),
            mask=offsets < MAX_NUM_DRAFTS + 1,
        )
        tl.store(num_accepted_ptr + req, num_accepted)


def _check_args(
    logits: torch.Tensor,
    cu_num_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    check_dtype_and_rank("logits", logits, torch.float32, 2)
    check_dtype_and_rank("cu_num_logits", cu_num_logits, torch.int32, 1)
    check_dtype_and_rank("draft_token_ids", draft_token_ids, torch.int32, 2)
    check_dtype_and_rank("idx_mapping", idx_mapping, torch.int32, 1)
    check_dtype_and_rank("positions", positions, torch.int64, 1)
    num_reqs = idx_mapping.shape[0]
    check_offsets("cu_num_logits", cu_num_logits, num_reqs, exact=True)
    if draft_token_ids.shape[0] != num_reqs or positions.shape[0] != num_reqs:
        raise ValueError(
            "draft_token_ids and positions need one row per scheduled request "
            f"({num_reqs}), got {draft_token_ids.shape[0]} and {positions.shape[0]}"
        )
    if num_reqs > logits.shape[0]:
        raise ValueError(
            f"{num_reqs} requests need at least one logit row each, got {logits.shape[0]} rows"
        )


def expand_to_logit_rows(
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    idx_mapping: torch.Tensor,  # [num_reqs] int32
    positions: torch.Tensor,  # [num_reqs] int64, position of each request's first logit row's token
    num_logits: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_logits] int32 request rows, [num_logits] int64
    """The request row and the sampled token's position of every logit row, computed on the
    device without a host sync (the output size is known)."""
    num_reqs = idx_mapping.shape[0]
    counts = (cu_num_logits[1:] - cu_num_logits[:-1]).long()
    logit_req = torch.repeat_interleave(
        torch.arange(num_reqs, device=counts.device), counts, output_size=num_logits
    )
    offsets = torch.arange(num_logits, device=counts.device) - cu_num_logits[logit_req].long()
    return idx_mapping[logit_req], positions[logit_req] + offsets


def _accept_prefix_ref(
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    draft_token_ids: torch.Tensor,  # [num_reqs, K] int32
    sampled: torch.Tensor,  # [num_logits] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, K + 1] int64, [num_reqs] int32
    max_num_drafts = draft_token_ids.shape[1]
    first = cu_num_logits[:-1].long()[:, None]
    num_drafts = (cu_num_logits[1:].long() - first[:, 0] - 1).clamp(0, max_num_drafts)[:, None]
    offsets = torch.arange(max_num_drafts + 1, device=sampled.device)[None, :]
    columns = (first + offsets.clamp(max=num_drafts)).clamp(max=max(sampled.shape[0] - 1, 0))
    per_position = sampled[columns]
    drafts = torch.nn.functional.pad(draft_token_ids.long(), (0, 1), value=-1)
    stops = ((offsets < num_drafts) & (drafts != per_position)) | (offsets == num_drafts)
    num_accepted = torch.where(stops, offsets, max_num_drafts + 1).min(dim=1).values
    output = torch.where(offsets <= num_accepted[:, None], per_position, -1)
    return output, num_accepted.to(torch.int32)


def rejection_sample_ref(
    logits: torch.Tensor,  # [num_logits, vocab_size] float32, target logits, not modified
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32, request b owns rows cu[b]..cu[b+1]-1
    draft_token_ids: torch.Tensor,  # [num_reqs, K] int32, request b uses its first cu[b+1]-cu[b]-1
    idx_mapping: torch.Tensor,  # [num_reqs] int32, batch position -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32, 0 = greedy
    seed: torch.Tensor,  # [max_num_reqs] int64
    positions: torch.Tensor,  # [num_reqs] int64, position of each request's first new token
    apply_temperature: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, K + 1] int64 (-1 padded), [num_reqs] int32
    """Torch reference of `rejection_sample` (see the module doc)."""
    _check_args(logits, cu_num_logits, draft_token_ids, idx_mapping, positions)
    if idx_mapping.shape[0] == 0:
        return (
            torch.empty((0, draft_token_ids.shape[1] + 1), dtype=torch.int64, device=logits.device),
            torch.empty(0, dtype=torch.int32, device=logits.device),
        )
    logit_rows, logit_positions = expand_to_logit_rows(
        cu_num_logits, idx_mapping, positions, logits.shape[0]
    )
    sampled = gumbel_sample_ref(
        logits, logit_rows, temperature, seed, logit_positions, apply_temperature
    )
    return _accept_prefix_ref(cu_num_logits, draft_token_ids, sampled)


def rejection_sample_triton(
    logits: torch.Tensor,  # [num_logits, vocab_size] float32
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    draft_token_ids: torch.Tensor,  # [num_reqs, K] int32, rows contiguous
    idx_mapping: torch.Tensor,  # [num_reqs] int32
    temperature: torch.Tensor,  # [max_num_reqs] float32
    seed: torch.Tensor,  # [max_num_reqs] int64
    positions: torch.Tensor,  # [num_reqs] int64
    apply_temperature: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, K + 1] int64, [num_reqs] int32
    """Triton launcher of `rejection_sample`: the Gumbel kernels over every logit row, then
    one program per request that accepts the matching prefix."""
    need_triton("rejection_sample_triton")
    _check_args(logits, cu_num_logits, draft_token_ids, idx_mapping, positions)
    check_triton_device("rejection_sample_triton", logits.device)
    if draft_token_ids.stride(1) != 1:
        raise ValueError("draft_token_ids rows must be contiguous (stride(1) == 1)")
    num_reqs, max_num_drafts = draft_token_ids.shape
    output = torch.empty((num_reqs, max_num_drafts + 1), dtype=torch.int64, device=logits.device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int32, device=logits.device)
    if num_reqs == 0:
        return output, num_accepted
    logit_rows, logit_positions = expand_to_logit_rows(
        cu_num_logits, idx_mapping, positions, logits.shape[0]
    )
    sampled = gumbel_sample_triton(
        logits, logit_rows, temperature, seed, logit_positions, apply_temperature
    )
    _accept_prefix_kernel[(num_reqs,)](
        cu_num_logits,
        draft_token_ids,
        draft_token_ids.stride(0),
        sampled,
        output,
        num_accepted,
        MAX_NUM_DRAFTS=max_num_drafts,
        NUM_OUTPUTS_POW2=triton.next_power_of_2(max_num_drafts + 1),
    )
    return output, num_accepted


def rejection_sample(
    logits: torch.Tensor,  # [num_logits, vocab_size] float32, target logits, not modified
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32, request b owns rows cu[b]..cu[b+1]-1
    draft_token_ids: torch.Tensor,  # [num_reqs, K] int32, request b uses its first cu[b+1]-cu[b]-1
    idx_mapping: torch.Tensor,  # [num_reqs] int32, batch position -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32, 0 = greedy
    seed: torch.Tensor,  # [max_num_reqs] int64
    positions: torch.Tensor,  # [num_reqs] int64, position of each request's first new token
    apply_temperature: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, K + 1] int64 (-1 padded), [num_reqs] int32
    """Verify each request's drafts against its target logits (see the module doc)."""
    impl = rejection_sample_triton if HAS_TRITON and logits.is_cuda else rejection_sample_ref
    return impl(
        logits,
        cu_num_logits,
        draft_token_ids,
        idx_mapping,
        temperature,
        seed,
        positions,
        apply_temperature,
    )


def accept_draft_prefix(
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32, request b owns rows cu[b]..cu[b+1]-1
    draft_token_ids: torch.Tensor,  # [num_reqs, K] int32, -1 where a row has no draft
    sampled: torch.Tensor,  # [num_logits] int64, the sampler's token at every logit row
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, K + 1] int64 (-1 padded), [num_reqs] int32
    """The acceptance step of `rejection_sample` on tokens the full sampler already drew
    for every logit row (bias, penalties, min-p, top-k/top-p and the seeded Gumbel draw,
    keyed on each row's position): accept drafts while they equal the sampled token, then
    emit one more. A -1 draft is never accepted, so a row with fewer drafts than logit
    rows stops at its last draft."""
    check_dtype_and_rank("cu_num_logits", cu_num_logits, torch.int32, 1)
    check_dtype_and_rank("draft_token_ids", draft_token_ids, torch.int32, 2)
    check_dtype_and_rank("sampled", sampled, torch.int64, 1)
    num_reqs, max_num_drafts = draft_token_ids.shape
    check_offsets("cu_num_logits", cu_num_logits, num_reqs, exact=True)
    if not (HAS_TRITON and sampled.is_cuda):
        return _accept_prefix_ref(cu_num_logits, draft_token_ids, sampled)
    output = torch.empty((num_reqs, max_num_drafts + 1), dtype=torch.int64, device=sampled.device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int32, device=sampled.device)
    if num_reqs:
        _accept_prefix_kernel[(num_reqs,)](
            cu_num_logits,
            draft_token_ids,
            draft_token_ids.stride(0),
            sampled,
            output,
            num_accepted,
            MAX_NUM_DRAFTS=max_num_drafts,
            NUM_OUTPUTS_POW2=triton.next_power_of_2(max_num_drafts + 1),
        )
    return output, num_accepted
