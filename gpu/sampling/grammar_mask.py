"""A step's grammar bitmask (built on the CPU by the engine core) applied to its logits on
the device, before sampling and logprobs: a forbidden token's logit becomes -inf, as the
grammar libraries' own samplers do, so the logprobs of a constrained row are those of the
distribution it was sampled from."""

from __future__ import annotations

import numpy as np
import torch

from actors.messages import GrammarBitmask
from kernels.token_bitmask import apply_token_bitmask


def apply_grammar_bitmask(
    logits: torch.Tensor,  # [>= num_reqs, vocab_size] float32, batch order, updated in place
    grammar: GrammarBitmask | None,
) -> None:
    """Mask the rows `grammar` names; nothing to do (no upload, no launch) when it is None.

    On CUDA the host arrays go through pinned buffers of the caching host allocator, which
    hands a buffer out again only once the copy reading it has run, so the copy never
    blocks the CPU and no in-flight copy reads memory the CPU rewrites."""
    if grammar is None:
        return
    bitmask = torch.from_numpy(np.ascontiguousarray(grammar.bitmask))
    rows = torch.from_numpy(np.ascontiguousarray(grammar.batch_indices, dtype=np.int32))
    if logits.is_cuda:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        rows = rows.pin_memory().to(logits.device, non_blocking=True)
    apply_token_bitmask(logits, bitmask, rows)
