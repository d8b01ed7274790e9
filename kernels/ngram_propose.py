"""Prompt-lookup (ngram) drafting over the persistent token history, on the device.

For scheduled request b (row r = idx_mapping[b]) with tokens t = token_ids[r, :T],
T = total_len[r]:

- match length at end position e (0 <= e <= T - 2) = the number of trailing tokens of t
  that equal the tokens ending at e, capped at prompt_lookup_max:
      L(e) = max{n <= max_n : t[e-n+1 .. e] == t[T-n .. T-1]};
- the n-gram used is the longest matched one, n* = max_e L(e); if n* < prompt_lookup_min
  there is no draft;
- among the occurrences of that n-gram, the one that drafts the most tokens wins, and of
  those the latest (largest e); the drafts are the tokens that followed it:
  t[e+1 .. e+k], k(e) = min(K, T - 1 - e, max_model_len - T).

So n runs from prompt_lookup_max down to prompt_lookup_min and the first length with an
earlier occurrence is taken, as in vLLM. The occurrence may overlap the suffix itself
(a repeated token drafts more of itself), must end before the last token, and always
leaves at least one token to draft. Tie-break: vLLM's proposers (CPU KMP and ngram_gpu)
take the earliest occurrence; tandem takes the latest that still drafts all it can: the
text nearest to where generation is, which is what the copy-heavy workloads (edit /
summarise a given text) continue from, except that a loop shorter than K (a token or a
short phrase repeating) drafts K tokens only from an occurrence at least K back (the
latest one would draft a single period). `max_model_len - T` keeps drafts (and the bonus
token after them) inside the context, as vLLM does.

Outputs per batch position: draft_token_ids [num_reqs, K] int32 (-1 past the drafts) and
num_draft_tokens [num_reqs] int32. The Triton kernel runs one program per scheduled row
and one pass over that row's history in blocks of candidate end positions, reading the
history in place (device memory, or pinned host memory through UVA): no history ever
crosses to the CPU.

How the V2 runner will use it (integration round): after `post_update` has appended the
tokens accepted in step N, `ngram_propose` over step N's idx_mapping writes each row's
drafts into a persistent [max_num_reqs, K] draft table on the device; step N+1's input
preparation reads the last sampled token and those drafts straight from it (1 + K input
tokens per decode row; rows without drafts run one token), so the async two-steps-in-flight
loop never waits for the CPU to learn a draft.
"""

from __future__ import annotations

import torch

from kernels._checks import (
    check_contiguous_rows,
    check_dtype_and_rank,
    check_token_history_device,
    check_triton_device,
    need_triton,
)
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 512

if HAS_TRITON:

    @triton.jit
    def _ngram_propose_kernel(
        idx_mapping_ptr,
        token_ids_ptr,
        token_ids_stride,
        total_len_ptr,
        draft_token_ids_ptr,
        num_draft_tokens_ptr,
        max_model_len,
        MIN_N: tl.constexpr,
        MAX_N: tl.constexpr,
        NUM_SPEC: tl.constexpr,
        NUM_SPEC_POW2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        batch_idx = tl.program_id(0)
        row = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
        total = tl.load(total_len_ptr + row)
        history = token_ids_ptr + row * token_ids_stride
        best_len = tl.zeros((), dtype=tl.int32)
        best_score = tl.full((), -1, dtype=tl.int32)
        for block_start in range(0, total - 1, BLOCK_SIZE):
            ends = block_start + tl.arange(0, BLOCK_SIZE)
            matching = ends < total - 1
            match_len = tl.zeros((BLOCK_SIZE,), dtype=tl.int32)
            for j in tl.static_range(MAX_N):
                # Token ids are >= 0, so the two fill values never match anything: a
                # suffix shorter than j + 1 or a position before the row's start ends
                # the match without a separate (scalar) condition.
                suffix_position = total - 1 - j
                suffix_token = tl.load(
                    history + suffix_position, mask=suffix_position >= 0, other=-1
                )
                positions = ends - j
                in_row = matching & (positions >= 0)
                token = tl.load(history + positions, mask=in_row, other=-2)
                matching = in_row & (token == suffix_token)
                match_len += matching.to(tl.int32)
            block_len = tl.max(match_len, 0)
            # score = drafts it gives, then position: an int32 for any real context
            num_after = tl.minimum(tl.minimum(total - 1 - ends, max_model_len - total), NUM_SPEC)
            score = num_after * (max_model_len + 1) + ends
            block_score = tl.max(tl.where(match_len == block_len, score, -1), 0)
            take = (block_len > 0) & (
                (block_len > best_len) | ((block_len == best_len) & (block_score > best_score))
            )
            best_len = tl.where(take, block_len, best_len)
            best_score = tl.where(take, block_score, best_score)
        best_end = tl.where(best_score >= 0, best_score % (max_model_len + 1), -1)
        draft_start = best_end + 1
        num_drafts = tl.minimum(tl.minimum(total - draft_start, max_model_len - total), NUM_SPEC)
        num_drafts = tl.where(best_len >= MIN_N, tl.maximum(num_drafts, 0), 0)
        offsets = tl.arange(0, NUM_SPEC_POW2)
        drafts = tl.load(history + draft_start + offsets, mask=offsets < num_drafts, other=-1)
        tl.store(
            draft_token_ids_ptr + batch_idx * NUM_SPEC + offsets, drafts, mask=offsets < NUM_SPEC
        )
        tl.store(num_draft_tokens_ptr + batch_idx, num_drafts)


def _check_args(
    token_ids: torch.Tensor,
    total_len: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_speculative_tokens: int,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
) -> None:
    check_dtype_and_rank("token_ids", token_ids, torch.int32, 2)
    check_dtype_and_rank("total_len", total_len, torch.int32, 1)
    check_dtype_and_rank("idx_mapping", idx_mapping, torch.int32, 1)
    if total_len.shape[0] != token_ids.shape[0]:
        raise ValueError(
            f"total_len has {total_len.shape[0]} rows, token_ids "
            f"{token_ids.shape[0]}: one length per request row"
        )
    if idx_mapping.device != total_len.device:
        raise ValueError(f"idx_mapping is on {idx_mapping.device}, total_len on {total_len.device}")
    check_token_history_device(token_ids, total_len.device)
    for name, value in (
        ("num_speculative_tokens", num_speculative_tokens),
        ("prompt_lookup_min", prompt_lookup_min),
        ("prompt_lookup_max", prompt_lookup_max),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if prompt_lookup_min > prompt_lookup_max:
        raise ValueError(
            f"prompt_lookup_min ({prompt_lookup_min}) must not exceed "
            f"prompt_lookup_max ({prompt_lookup_max})"
        )


def ngram_propose_ref(
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32
    total_len: torch.Tensor,  # [max_num_reqs] int32, tokens known per row
    idx_mapping: torch.Tensor,  # [num_reqs] int32, batch position -> request row
    num_speculative_tokens: int,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, K] int32 (-1 padded), [num_reqs] int32
    """Torch reference of `ngram_propose` (see the module doc), vectorised over the batch."""
    _check_args(
        token_ids,
        total_len,
        idx_mapping,
        num_speculative_tokens,
        prompt_lookup_min,
        prompt_lookup_max,
    )
    device = total_len.device
    rows = idx_mapping.long()
    history = token_ids.to(device)[rows].long()  # [num_reqs, max_model_len]
    total = total_len[rows].long()[:, None]  # [num_reqs, 1]
    max_model_len = token_ids.shape[1]
    ends = torch.arange(max_model_len, device=device)[None, :]
    matching = ends < total - 1
    match_len = torch.zeros_like(history)
    for j in range(prompt_lookup_max):
        suffix_token = history.gather(1, (total - 1 - j).clamp(min=0))
        positions = ends - j
        token = history.gather(1, positions.clamp(min=0).expand_as(history))
        matching &= (positions >= 0) & (j < total) & (token == suffix_token)
        match_len += matching.long()
    best_len = match_len.max(dim=1, keepdim=True).values
    num_after = (total - 1 - ends).clamp(max=min(num_speculative_tokens, max_model_len))
    num_after = torch.minimum(num_after, max_model_len - total)
    score = num_after * (max_model_len + 1) + ends  # drafts it gives, then the latest
    best = torch.where((match_len == best_len) & (best_len > 0), score, -1).max(dim=1).values
    best_end = torch.where(best >= 0, best % (max_model_len + 1), -1)
    draft_start = best_end + 1
    num_drafts = torch.minimum(total[:, 0] - draft_start, max_model_len - total[:, 0])
    num_drafts = num_drafts.clamp(min=0, max=num_speculative_tokens)
    num_drafts = torch.where(best_len[:, 0] >= prompt_lookup_min, num_drafts, 0)
    offsets = torch.arange(num_speculative_tokens, device=device)[None, :]
    columns = (draft_start[:, None] + offsets).clamp(min=0, max=max_model_len - 1)
    drafts = torch.where(offsets < num_drafts[:, None], history.gather(1, columns), -1)
    return drafts.to(torch.int32), num_drafts.to(torch.int32)


def ngram_propose_triton(
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, rows contiguous
    total_len: torch.Tensor,  # [max_num_reqs] int32
    idx_mapping: torch.Tensor,  # [num_reqs] int32
    num_speculative_tokens: int,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    block_size: int = _BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, K] int32, [num_reqs] int32
    """Triton launcher of `ngram_propose`: one program per scheduled row."""
    need_triton("ngram_propose_triton")
    _check_args(
        token_ids,
        total_len,
        idx_mapping,
        num_speculative_tokens,
        prompt_lookup_min,
        prompt_lookup_max,
    )
    check_triton_device("ngram_propose_triton", total_len.device)
    check_contiguous_rows(token_ids=token_ids, total_len=total_len, idx_mapping=idx_mapping)
    num_reqs = idx_mapping.shape[0]
    device = total_len.device
    drafts = torch.empty((num_reqs, num_speculative_tokens), dtype=torch.int32, device=device)
    num_drafts = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if num_reqs == 0:
        return drafts, num_drafts
    _ngram_propose_kernel[(num_reqs,)](
        idx_mapping,
        token_ids,
        token_ids.stride(0),
        total_len,
        drafts,
        num_drafts,
        token_ids.shape[1],
        MIN_N=prompt_lookup_min,
        MAX_N=prompt_lookup_max,
        NUM_SPEC=num_speculative_tokens,
        NUM_SPEC_POW2=triton.next_power_of_2(num_speculative_tokens),
        BLOCK_SIZE=block_size,
    )
    return drafts, num_drafts


def ngram_propose(
    token_ids: torch.Tensor,  # [max_num_reqs, max_model_len] int32, device or pinned host (UVA)
    total_len: torch.Tensor,  # [max_num_reqs] int32, tokens known per row
    idx_mapping: torch.Tensor,  # [num_reqs] int32, batch position -> request row
    num_speculative_tokens: int,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, K] int32 (-1 padded), [num_reqs] int32
    """Draft up to K tokens per scheduled row by prompt lookup (see the module doc)."""
    impl = ngram_propose_triton if HAS_TRITON and total_len.is_cuda else ngram_propose_ref
    return impl(
        token_ids,
        total_len,
        idx_mapping,
        num_speculative_tokens,
        prompt_lookup_min,
        prompt_lookup_max,
    )
