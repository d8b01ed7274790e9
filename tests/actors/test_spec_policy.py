"""The draft-length policy (actors/core/spec_policy.py): per-position acceptance averages, and
a step's K from them and the batch size; speculation stops where the model says it cannot
pay. That no K changes a token is checked on the runner (tests/gpu/test_uniform_spec_step.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.core.spec_policy import (
    ACCEPT_RATE_WEIGHT,
    choose_draft_len,
    expected_accepted,
    probe_rate,
    record_acceptance,
    step_cost,
)


def test_acceptance_averages_move_only_the_positions_that_had_slots() -> None:
    rates: list[float] = []
    record_acceptance(rates, 2, 1)  # draft 1 accepted, draft 2 rejected
    w = ACCEPT_RATE_WEIGHT
    assert rates == pytest.approx(
        [probe_rate(1) + w * (1 - probe_rate(1)), probe_rate(2) * (1 - w)]
    )
    record_acceptance(rates, 1, 0)
    assert len(rates) == 2 and rates[1] == pytest.approx(probe_rate(2) * (1 - w))
    assert rates[0] < probe_rate(1) + w * (1 - probe_rate(1))
    # Positions never measured count at the probe prior.
    assert expected_accepted(rates, 3) == pytest.approx(rates[0] + rates[1] + probe_rate(3))


def test_alone_a_request_speculates_with_every_slot() -> None:
    assert choose_draft_len([(4, ())], 1, 0, 4, uniform=True) == 4
    assert choose_draft_len([(2, ())], 1, 0, 4, uniform=True) == 2  # capped by max_tokens


def test_wide_batches_run_fewer_slots_and_stop_where_nothing_is_accepted() -> None:
    # Requests with no measured acceptance probe at the prior: fewer slots as the padded
    # batch grows, none at all at 512 rows.
    assert choose_draft_len([(4, ())] * 48, 48, 0, 4, uniform=True) == 3
    assert choose_draft_len([(4, ())] * 200, 200, 0, 4, uniform=True) == 1
    assert choose_draft_len([(4, ())] * 512, 512, 0, 4, uniform=True) == 0
    accepted_first = [(4, [0.95, 0.05, 0.0, 0.0])] * 48
    assert choose_draft_len(accepted_first, 48, 0, 4, uniform=True) == 1
    nothing = [(4, [0.0, 0.0, 0.0, 0.0])] * 48
    assert choose_draft_len(nothing, 48, 0, 4, uniform=True) == 0
    assert choose_draft_len([(4, [0.0] * 4)], 1, 0, 4, uniform=True) == 0


def test_rows_that_cannot_draft_cost_more_in_a_padded_step() -> None:
    # 4 drafting rows among 64: padded, the other 60 rows' K extra tokens cost too much;
    # unpadded (a prefill chunk in the step) only the drafting rows' slots cost.
    few = [(4, [0.9, 0.8, 0.7, 0.6])] * 4
    assert choose_draft_len(few, 64, 0, 4, uniform=True) == 0
    assert choose_draft_len(few, 64, 100, 4, uniform=False) == 4


@given(
    rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4),
    num_rows=st.integers(1, 256),
    num_other=st.integers(0, 512),
    uniform=st.booleans(),
)
def test_the_chosen_length_is_predicted_to_beat_plain_steps(
    rates: list[float], num_rows: int, num_other: int, uniform: bool
) -> None:
    max_len = len(rates)
    draft_len = choose_draft_len(
        [(max_len, rates)] * num_rows, num_rows, num_other, max_len, uniform
    )
    assert 0 <= draft_len <= max_len
    if draft_len:
        tokens = num_rows * (1 + draft_len) + num_other
        rate = (num_rows + num_rows * expected_accepted(rates, draft_len)) / step_cost(tokens, True)
        assert rate > num_rows / step_cost(num_rows + num_other, False)
    if not any(rates):
        assert draft_len == 0
