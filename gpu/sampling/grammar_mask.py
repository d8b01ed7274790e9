"""A step's grammar bitmask (built on the CPU by the engine core) applied to its logits on
the device, before sampling and logprobs: a forbidden token's logit becomes -inf, as the
grammar libraries' own samplers do, so the logprobs of a constrained row are those of the
distribution it was sampled from."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from actors.protocol.messages import GrammarBitmask, SchedulerOutput
from kernels.token_bitmask import apply_token_bitmask


def mask_buffer_allocator(device: torch.device) -> Callable[[int, int], np.ndarray]:
    """Allocates the engine core's mask buffers ([num_rows, num_words] int32): page-locked
    on CUDA, so a mask filled in place uploads with no staging copy (5 MB for 256 rows of a
    150k vocabulary, a millisecond on a constrained step's critical path)."""
    if device.type != "cuda":
        return lambda num_rows, num_words: np.empty((num_rows, num_words), np.int32)

    def pinned(num_rows: int, num_words: int) -> np.ndarray:
        # The array keeps the pinned tensor (its base) alive.
        return torch.empty((num_rows, num_words), dtype=torch.int32, pin_memory=True).numpy()

    return pinned


def apply_grammar_bitmask(
    logits: torch.Tensor,  # [>= num_reqs, vocab_size] float32, batch order, updated in place
    grammar: GrammarBitmask | None,
) -> None:
    """Mask the rows `grammar` names; nothing to do (no upload, no launch) when it is None.

    On CUDA a bitmask in page-locked memory (`mask_buffer_allocator`: the engine core's
    buffers, rewritten only after the step that reads one has sampled) uploads as it is;
    other host arrays go through pinned buffers of the caching host allocator, which hands
    a buffer out again only once the copy reading it has run. Either way the copy never
    blocks the CPU and no in-flight copy reads memory the CPU rewrites."""
    if grammar is None:
        return
    bitmask = torch.from_numpy(np.ascontiguousarray(grammar.bitmask))
    rows = torch.from_numpy(np.ascontiguousarray(grammar.batch_indices, dtype=np.int32))
    if logits.is_cuda:
        if not bitmask.is_pinned():
            bitmask = bitmask.pin_memory()
        bitmask = bitmask.to(logits.device, non_blocking=True)
        rows = rows.pin_memory().to(logits.device, non_blocking=True)
    apply_token_bitmask(logits, bitmask, rows)


DEFERRED_MASK_TIMEOUT_S = 120.0
"""How long a step waits for its deferred mask before it fails (never expected: the mask
follows the previous step's result)."""


class DeferredMasks:
    """Grammar masks that the engine core delivers after their step was launched (the
    step's rows had a token in flight): the runner's thread waits for one before sampling,
    while the step's forward runs on the device."""

    def __init__(self, timeout_s: float = DEFERRED_MASK_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        self._masks: dict[int, GrammarBitmask | BaseException] = {}
        self._closed = False
        self._cond = threading.Condition()

    def provide(self, step_id: int, mask: GrammarBitmask | BaseException) -> None:
        """The step's mask, or why it could not be computed (the step then fails)."""
        with self._cond:
            self._masks[step_id] = mask
            for stale in [s for s in self._masks if s < step_id - 8]:  # of failed steps
                del self._masks[stale]
            self._cond.notify_all()

    def close(self) -> None:
        """Wake any waiter: its step fails (the engine is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def step_mask(self, sched: SchedulerOutput) -> GrammarBitmask | None:
        """The step's mask: in the message, or (deferred) once the core provides it."""
        if not sched.grammar_mask_deferred:
            return sched.grammar_bitmask
        with self._cond:
            if (
                not self._cond.wait_for(
                    lambda: sched.step_id in self._masks or self._closed, self._timeout_s
                )
                or sched.step_id not in self._masks
            ):
                raise RuntimeError(f"step {sched.step_id}: its grammar mask never came")
            mask = self._masks.pop(sched.step_id)
        if isinstance(mask, BaseException):
            raise RuntimeError(f"step {sched.step_id}: its grammar mask failed: {mask!r}") from mask
        return mask
