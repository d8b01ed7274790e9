from __future__ import annotations

import pytest

from telemetry.records import RequestRecord


def test_phases_follow_vllm_definitions() -> None:
    record = RequestRecord(
        "r",
        arrival_time=10.0,
        finish_time=11.0,
        finish_reason="stop",
        num_prompt_tokens=8,
        num_output_tokens=11,
        queued_time=10.25,
        first_scheduled_time=10.5,
        first_token_time=10.75,
    )
    assert record.e2e_latency_s == 1.0
    assert record.time_to_first_token_s == 0.75
    assert record.queue_time_s == 0.25
    assert record.prefill_time_s == 0.25
    assert record.decode_time_s == 0.25
    assert record.inference_time_s == 0.5
    assert record.time_per_output_token_s == 0.025  # 0.25 s over the 10 tokens after the first


def test_phases_that_never_happened_are_none() -> None:
    never_ran = RequestRecord(
        "r", 1.0, 2.0, "abort", num_prompt_tokens=4, num_output_tokens=0, queued_time=1.5
    )
    assert never_ran.time_to_first_token_s is None and never_ran.queue_time_s is None
    assert never_ran.prefill_time_s is None and never_ran.decode_time_s is None
    assert never_ran.inference_time_s is None and never_ran.time_per_output_token_s is None
    one_token = RequestRecord(
        "r", 1.0, 2.0, "length", 4, 1, first_scheduled_time=1.2, first_token_time=1.5
    )
    assert one_token.time_per_output_token_s is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"num_output_tokens": -1}, "token counts"), ({"finish_time": 0.5}, "before arrival_time")],
)
def test_impossible_records_are_refused(changes: dict[str, float], message: str) -> None:
    fields: dict[str, object] = {
        "request_id": "r",
        "arrival_time": 1.0,
        "finish_time": 2.0,
        "finish_reason": "stop",
        "num_prompt_tokens": 3,
        "num_output_tokens": 2,
    }
    with pytest.raises(ValueError, match=message):
        RequestRecord(**{**fields, **changes})  # type: ignore[arg-type]
