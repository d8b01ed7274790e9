"""A step with draft slots that the speculative path could not run is refused."""

import types

import numpy as np
import pytest

from actors.protocol.messages import GrammarBitmask
from gpu.prompt_logprobs import PromptRequest
from gpu.spec_decode.spec_runner import check_speculative_step


def _sched(**fields: object) -> types.SimpleNamespace:
    step = dict(
        step_id=7,
        scheduled_request_ids=("a", "b"),
        num_computed_tokens=(12, 40),
        num_scheduled_tokens=(3, 1),
        grammar_bitmask=None,
        grammar_mask_deferred=False,
    )
    return types.SimpleNamespace(**{**step, **fields})


def test_grammar_rows_and_prompts_to_score_are_refused_beside_draft_slots() -> None:
    decoding = {"b": PromptRequest(1, tuple(range(20)))}  # its prompt is scored already
    check_speculative_step(_sched(), decoding)
    with pytest.raises(ValueError, match="grammar"):
        check_speculative_step(_sched(grammar_mask_deferred=True), {})
    mask = GrammarBitmask(np.zeros(1, np.int32), np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match="grammar"):
        check_speculative_step(_sched(grammar_bitmask=mask), {})
    with pytest.raises(ValueError, match="prompt"):
        check_speculative_step(_sched(), {"a": PromptRequest(1, tuple(range(20)))})
