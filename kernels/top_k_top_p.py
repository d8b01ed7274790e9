"""Top-k and top-p (nucleus) filtering of logits, in place.

For each logit row i with request row r = idx_mapping[i]:
- top-k (k = top_k[r], 0 = off): keep the k largest logits;
- top-p (p = top_p[r], 1 = off): of what top-k kept, keep the smallest prefix of the
  tokens sorted by descending probability whose mass reaches p (the token that crosses p
  is kept, and so is the most likely token): token j survives iff the mass of the tokens
  ranked before it is < p. The probabilities are those of the top-k survivors.
Everything else becomes -inf. Both filters reduce to one threshold per row: the smallest
kept logit. Logits equal to the threshold are kept, so ties there can let a few more
tokens through than k.

The thresholds come from torch.topk (or a full torch.sort when some top-p row has no
top-k) over the `num_candidates` largest logits; only the masking is a Triton kernel.
This sort-based op is the reference of kernels/sampling_thresholds.py, whose sort-free
search the sampler uses.
"""

import torch

from kernels._checks import check_logits, check_tensor, check_triton_device, need_triton
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 4096

if HAS_TRITON:

    @triton.jit
    def _threshold_mask_kernel(
        logits_ptr,
        logits_stride,
        thresholds_ptr,
        vocab_size,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        threshold = tl.load(thresholds_ptr + row)
        if threshold > float("-inf"):
            token_ids = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            in_vocab = token_ids < vocab_size
            ptrs = logits_ptr + row * logits_stride + token_ids
            logits = tl.load(ptrs, mask=in_vocab)
            tl.store(ptrs, tl.where(logits < threshold, float("-inf"), logits), mask=in_vocab)


def _check_args(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    num_candidates: int,
) -> None:
    num_rows, _ = check_logits(logits)
    check_tensor("idx_mapping", idx_mapping, torch.int32, 1, logits.device, (num_rows,))
    check_tensor("top_k", top_k, torch.int32, 1, logits.device)
    check_tensor("top_p", top_p, torch.float32, 1, logits.device, (top_k.shape[0],))
    if not isinstance(num_candidates, int) or num_candidates < 1:
        raise ValueError(f"num_candidates must be a positive int, got {num_candidates!r}")


def top_k_top_p_thresholds(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    idx_mapping: torch.Tensor,  # [num_rows] int32
    top_k: torch.Tensor,  # [max_num_reqs] int32, 0 = off
    top_p: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    num_candidates: int,
) -> torch.Tensor:  # [num_rows] float32, -inf where the row keeps everything
    """The smallest logit each row keeps. `num_candidates` (known on the host, so no sync)
    must cover every row that filters: >= its top_k, and the vocab size for a top-p row
    without top-k."""
    vocab_size = logits.shape[1]
    num_candidates = min(num_candidates, vocab_size)
    if num_candidates == vocab_size:
        candidates = torch.sort(logits, dim=-1, descending=True).values
    else:
        candidates = torch.topk(logits, num_candidates, dim=-1, sorted=True).values
    rows = idx_mapping.long()
    return thresholds_of_ranked(candidates, top_k[rows], top_p[rows])


def thresholds_of_ranked(
    candidates: torch.Tensor,  # [num_rows, num_candidates] float32, each row descending
    row_top_k: torch.Tensor,  # [num_rows] int32 or int64, 0 = off
    row_top_p: torch.Tensor,  # [num_rows] float32, 1 = off
) -> torch.Tensor:  # [num_rows] float32, -inf where the row keeps everything
    """`top_k_top_p_thresholds` from each row's largest logits, sorted."""
    num_candidates = candidates.shape[1]
    row_top_k = row_top_k.long()
    num_kept_by_k = torch.where(
        (row_top_k > 0) & (row_top_k < num_candidates), row_top_k, num_candidates
    )
    ranks = torch.arange(num_candidates, device=candidates.device)
    in_top_k = ranks[None, :] < num_kept_by_k[:, None]
    probs = torch.softmax(candidates.masked_fill(~in_top_k, float("-inf")), dim=-1)
    # Exclusive prefix sum (mass ranked strictly before each token), shifted rather than
    # computed as cumsum - probs so that it stays monotone and the kept set is a prefix.
    cumulative = torch.cumsum(probs, dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    is_kept = in_top_k & ((mass_before < row_top_p[:, None]) | (row_top_p[:, None] >= 1.0))
    is_kept[:, 0] = True
    # the same count as a bool sum, which runs 5x slower on the CPU
    num_kept = is_kept.view(torch.uint8).sum(dim=-1, dtype=torch.int32).long()
    thresholds = candidates.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    filters = (row_top_k > 0) | (row_top_p < 1.0)
    return torch.where(filters, thresholds, float("-inf"))


def apply_top_k_top_p_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, masked in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    top_k: torch.Tensor,  # [max_num_reqs] int32, 0 = off
    top_p: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    num_candidates: int,
) -> None:
    """Torch reference of `apply_top_k_top_p`."""
    _check_args(logits, idx_mapping, top_k, top_p, num_candidates)
    if logits.shape[0] == 0:
        return
    thresholds = top_k_top_p_thresholds(logits, idx_mapping, top_k, top_p, num_candidates)
    logits.masked_fill_(logits < thresholds[:, None], float("-inf"))


def apply_top_k_top_p_triton(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, masked in place
    idx_mapping: torch.Tensor,  # [num_rows] int32
    top_k: torch.Tensor,  # [max_num_reqs] int32
    top_p: torch.Tensor,  # [max_num_reqs] float32
    num_candidates: int,
    block_size: int = _BLOCK_SIZE,
) -> None:
    """Torch thresholds, then a Triton masking kernel: one program per (row, vocab block)."""
    need_triton("apply_top_k_top_p_triton")
    _check_args(logits, idx_mapping, top_k, top_p, num_candidates)
    check_triton_device("apply_top_k_top_p_triton", logits.device)
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    thresholds = top_k_top_p_thresholds(logits, idx_mapping, top_k, top_p, num_candidates)
    grid = (num_rows, triton.cdiv(vocab_size, block_size))
    _threshold_mask_kernel[grid](
        logits, logits.stride(0), thresholds.contiguous(), vocab_size, BLOCK_SIZE=block_size
    )


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, masked in place
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    top_k: torch.Tensor,  # [max_num_reqs] int32, 0 = off
    top_p: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    num_candidates: int,
) -> None:
    """Mask everything outside each row's top-k / top-p set (see the module doc)."""
    if HAS_TRITON and logits.is_cuda:
        apply_top_k_top_p_triton(logits, idx_mapping, top_k, top_p, num_candidates)
    else:
        apply_top_k_top_p_ref(logits, idx_mapping, top_k, top_p, num_candidates)
