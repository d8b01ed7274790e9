"""The grammar mask's host buffers and its application to the logits."""

import time
import types

import numpy as np
import pytest
import torch

from actors.protocol.messages import GrammarBitmask
from gpu.sampling.grammar_mask import DeferredMasks, apply_grammar_bitmask, mask_buffer_allocator

VOCAB_SIZE = 100
NUM_WORDS = (VOCAB_SIZE + 31) // 32


def _mask_allowing(buffer: np.ndarray, allowed: list[set[int]]) -> None:
    bits = buffer.view(np.uint32)
    bits[:] = 0
    for row, tokens in enumerate(allowed):
        for token in tokens:
            bits[row, token // 32] |= np.uint32(1 << (token % 32))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_a_mask_in_an_allocated_buffer_masks_the_rows_it_names(device: str) -> None:
    allocate = mask_buffer_allocator(torch.device(device))
    buffer = allocate(2, NUM_WORDS)
    assert buffer.shape == (2, NUM_WORDS) and buffer.dtype == np.int32
    if device == "cuda":  # uploads without a staging copy
        assert torch.from_numpy(buffer).is_pinned()
    allowed = [{3, 31, 64}, {0, 99}]
    _mask_allowing(buffer, allowed)
    logits = torch.zeros(3, VOCAB_SIZE, device=device)
    apply_grammar_bitmask(logits, GrammarBitmask(np.array([2, 0], np.int32), buffer))
    finite = [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits.cpu()]
    assert finite == [allowed[1], set(range(VOCAB_SIZE)), allowed[0]]


def test_a_step_whose_mask_failed_fails_at_once() -> None:
    sched = types.SimpleNamespace(step_id=3, grammar_mask_deferred=True, grammar_bitmask=None)
    masks = DeferredMasks(timeout_s=60)
    masks.provide(3, RuntimeError("library failure"))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="grammar mask failed.*library failure"):
        masks.step_mask(sched)
    assert time.monotonic() - started < 5
