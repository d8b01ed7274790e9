"""Step faults for tests: wrap a runner's `execute` so chosen steps raise."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from actors.protocol.messages import SchedulerOutput

INJECTED_FAULT = (
    'Traceback (most recent call last):\n  File "/work/main/gpu/fake_kernel.py", '
    "line 7, in launch\nRuntimeError: injected device fault"
)
"""The injected exception's text: a response that leaked it would carry a stack trace and
a filesystem path, which the tests look for."""
LEAK_MARKERS = ("Traceback", "/work", "site-packages", '.py"', "fake_kernel", "injected")


class StepFaults:
    """Makes the next `num_steps` steps that `match` raise in the runner's `execute`
    (called on the GPU actor's launcher thread), before the step touches the device."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self._execute = runner.execute
        self._lock = threading.Lock()
        self._num_left = 0
        self._match: Callable[[SchedulerOutput], bool] = lambda sched: True
        self.failed_steps: list[SchedulerOutput] = []
        runner.execute = self._execute_or_fail

    def arm(self, num_steps: int, match: Callable[[SchedulerOutput], bool] | None = None) -> None:
        with self._lock:
            self._num_left = num_steps
            self._match = match or (lambda sched: True)

    def restore(self) -> None:
        del self._runner.execute  # the class's method again

    def _execute_or_fail(self, sched: SchedulerOutput) -> Any:
        with self._lock:
            fail = self._num_left > 0 and self._match(sched)
            if fail:
                self._num_left -= 1
                self.failed_steps.append(sched)
        if fail:
            raise RuntimeError(INJECTED_FAULT)
        return self._execute(sched)


def leaked_markers(text: str, request_text: str = "") -> list[str]:
    """Markers of internals found in `text` that the client did not send itself."""
    return [m for m in LEAK_MARKERS if m in text and m not in request_text]
