"""The V2 runner's device drafts: written after each row's known tokens (where the next
step's input preparation reads them) and into the draft table, never past the context."""

from __future__ import annotations

import torch

from actors.protocol.messages import CachedRequestData, SchedulerOutput
from actors.protocol.speculative_config import SpeculativeConfig
from gpu.runner_v2.states import RequestStates
from gpu.spec_decode.device_drafts import DeviceDrafts


def _states(histories: list[list[int]], max_model_len: int) -> RequestStates:
    states = RequestStates(len(histories), max_model_len, 4, torch.device("cpu"))
    for row, history in enumerate(histories):
        states.token_ids_gpu[row, : len(history)] = torch.tensor(history, dtype=torch.int32)
        states.total_len_gpu[row] = len(history)
    return states


def test_drafts_follow_the_known_tokens_and_fill_the_table() -> None:
    filler = 99
    histories = [[1, 2, 3, 4, 1, 2], [5, 6, 7, 8], [1, 2, 3, 1, 2, 3, 1, 2]]
    states = _states(histories, max_model_len=8)
    states.token_ids_gpu[0, 6:] = filler
    states.token_ids_gpu[1, 4:] = filler
    drafts = DeviceDrafts(SpeculativeConfig("ngram", 3, 1, 2), 3, torch.device("cpu"))
    drafts.propose(states, torch.tensor([0, 1, 2], dtype=torch.int32))
    # row 0 matched "1 2" at 0..1 and drafts what followed: 3 4 1 (within 8 columns: 2 fit).
    assert states.token_ids_gpu[0].tolist() == [1, 2, 3, 4, 1, 2, 3, 4]
    assert drafts.draft_token_ids_gpu[0].tolist() == [3, 4, -1]
    # row 1 has no earlier match: nothing written, no drafts.
    assert states.token_ids_gpu[1].tolist() == [5, 6, 7, 8] + [filler] * 4
    assert drafts.num_drafts_gpu[1] == 0 and drafts.draft_token_ids_gpu[1].tolist() == [-1] * 3
    # row 2 fills its context: nothing is written past it.
    assert states.token_ids_gpu[2].tolist() == histories[2]
    assert drafts.num_drafts_gpu[2] == 0


def _sched(step_id: int, ids: tuple[str, ...], slots: tuple[int, ...]) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        new_requests=(),
        cached_requests=CachedRequestData(),
        scheduled_request_ids=ids,
        num_scheduled_tokens=tuple(1 + n for n in slots),
        num_computed_tokens=(10,) * len(ids),
        samples_token=(True,) * len(ids),
        finished_request_ids=frozenset(),
        num_draft_slots=slots,
    )


def test_cpu_steps_run_only_the_slots_that_hold_a_draft() -> None:
    # row 0 repeats "1 2" and drafts 3 4 (2 fit in 8 columns); row 1 repeats nothing.
    states = _states([[1, 2, 3, 4, 1, 2], [5, 6, 7, 8]], max_model_len=8)
    states.row_of.update({"a": 0, "b": 1, "c": 1})
    drafts = DeviceDrafts(SpeculativeConfig("ngram", 4, 1, 2), 2, torch.device("cpu"))
    sched = SchedulerOutput(
        step_id=0,
        new_requests=(),
        cached_requests=CachedRequestData(),
        scheduled_request_ids=("a", "b", "c"),
        num_scheduled_tokens=(5, 5, 9),
        num_computed_tokens=(10, 10, 0),
        samples_token=(True, True, False),
        finished_request_ids=frozenset(),
        num_draft_slots=(4, 4, 0),
    )
    trimmed = drafts.trim_slots(sched, states)
    assert trimmed.num_scheduled_tokens == (3, 1, 9) and trimmed.num_draft_slots == (2, 0, 0)


def test_a_speculative_step_after_a_plain_one_proposes_afresh() -> None:
    """Drafts are proposed by speculative steps only: one that follows a plain step (which
    moved the history) proposes first, one that follows a speculative step over the same
    rows reuses what that step's tail proposed."""
    states = _states([[1, 2, 3, 1, 2], [7, 7, 7]], max_model_len=12)
    states.row_of.update({"a": 0, "b": 1})
    drafts = DeviceDrafts(SpeculativeConfig("ngram", 2, 1, 2), 2, torch.device("cpu"))
    calls = []
    propose = drafts.propose
    drafts.propose = lambda *args: (calls.append(1), propose(*args))  # type: ignore[method-assign]
    drafts.trim_slots(_sched(0, ("a", "b"), (2, 2)), states)
    assert len(calls) == 1 and drafts.draft_token_ids_gpu[0].tolist() == [3, 1]
    drafts.trim_slots(_sched(1, ("a",), (2,)), states)  # "a" ran in the speculative step
    assert len(calls) == 1
    drafts.mark_stale()  # a plain step appends a token to row 0: "1 2 3 1 2 3"
    states.token_ids_gpu[0, 5] = 3
    states.total_len_gpu[0] = 6
    drafts.trim_slots(_sched(2, ("a", "b"), (2, 2)), states)
    assert len(calls) == 2 and drafts.draft_token_ids_gpu[0].tolist() == [1, 2]
    assert states.token_ids_gpu[0, 6:8].tolist() == [1, 2]  # the history carries the same drafts
