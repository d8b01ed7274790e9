from __future__ import annotations

import numpy as np
import pytest

from actors.core.step_health import StepFailureMonitor
from actors.protocol.messages import StepOutput, StepStats


def _step(step_id: int, error: str | None = None) -> StepOutput:
    return StepOutput(
        step_id=step_id,
        request_ids=(),
        sampled_token_ids=np.zeros(0, np.int64),
        logprobs=None,
        stats=StepStats(step_id, 0, 0, 0),
        error=error,
        failed_request_ids=("r",) if error else (),
    )


def test_dead_after_n_consecutive_failures_only() -> None:
    reasons: list[str] = []
    monitor = StepFailureMonitor(3, reasons.append)
    for step_id, error in enumerate(["boom", "boom", None, "boom", "boom"]):
        monitor.observe(_step(step_id, error))
    # Two failures, a success (resets the run), two failures: never three in a row.
    assert monitor.dead_reason is None and reasons == []
    assert monitor.num_failed_steps_total == 4
    monitor.observe(_step(5, "RuntimeError: device lost"))
    assert reasons == [monitor.dead_reason]
    assert "3 consecutive" in reasons[0] and "device lost" in reasons[0]


def test_declared_dead_once() -> None:
    reasons: list[str] = []
    monitor = StepFailureMonitor(1, reasons.append)
    for step_id in range(4):
        monitor.observe(_step(step_id, "boom"))
    monitor.observe(_step(4))  # a later success does not revive it
    assert len(reasons) == 1 and monitor.dead_reason == reasons[0]


def test_wrap_observes_then_forwards_every_output() -> None:
    forwarded: list[int] = []
    monitor = StepFailureMonitor(2)
    forward = monitor.wrap(lambda out: forwarded.append(out.step_id))
    forward(_step(0, "boom"))
    forward(_step(1, "boom"))
    assert forwarded == [0, 1] and monitor.dead_reason is not None


def test_rejects_a_threshold_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        StepFailureMonitor(0)
