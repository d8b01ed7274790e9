"""What the engine core's GPU actor asks of a model runner, V2 or V1 alike.

    step = runner.execute(sched)   # launch the step (V2: returns while the device runs it)
    out = step.result()            # wait for its outputs on the host: a StepOutput

The V2 runner keeps `max_steps_in_flight = 2`: step N+1 is launched while step N runs,
and `result()` is where the host first waits for the device. The V1 runner finishes the
step inside `execute` (`max_steps_in_flight = 1`) and hands back a `ReadyStep`.
"""

from __future__ import annotations

from typing import Protocol

from actors.protocol.messages import SchedulerOutput, StepOutput
from gpu.sampling.grammar_mask import DeferredMasks


class LaunchedStep(Protocol):
    step_id: int
    request_ids: tuple[str, ...]
    """The step's scheduled requests (they fail with it should `result()` raise)."""

    def result(self) -> StepOutput:
        """The step's outputs, once on the host (blocks until then)."""
        ...


class Runner(Protocol):
    name: str
    """'v2' or 'v1'."""
    max_steps_in_flight: int
    deferred_masks: DeferredMasks
    """Where a step launched before its grammar mask was known waits for it."""

    def execute(self, sched: SchedulerOutput) -> LaunchedStep: ...

    @property
    def num_free_rows(self) -> int | None:
        """Request rows free for new requests (None where the runner keeps no fixed rows)."""
        ...

    def close(self) -> None:
        """Give back what the runner holds of the model (its step state)."""
        ...


class ReadyStep:
    """A step whose outputs are already on the host (the V1 runner's)."""

    __slots__ = ("_out", "request_ids", "step_id")

    def __init__(self, out: StepOutput, request_ids: tuple[str, ...]) -> None:
        self._out = out
        self.step_id = out.step_id
        self.request_ids = request_ids

    def result(self) -> StepOutput:
        return self._out
