"""Dead-engine detection: a run of failed steps means the engine cannot serve.

One failed step fails only its own requests (the engine keeps serving the rest). When
`max_consecutive_failures` steps in a row fail, the fault is not a bad request but a
broken device or runner: the monitor declares the engine dead once, so the server can
turn `/health` 503 and refuse new work instead of failing every request that arrives.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from actors.protocol.messages import StepOutput

log = structlog.get_logger("tandem.engine")

DEFAULT_MAX_CONSECUTIVE_FAILED_STEPS = 5


class StepFailureMonitor:
    """Counts consecutive failed steps. Event-loop only (the engine's output path)."""

    __slots__ = (
        "_on_dead",
        "dead_reason",
        "max_consecutive_failures",
        "num_consecutive_failures",
        "num_failed_steps_total",
    )

    def __init__(
        self,
        max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILED_STEPS,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        if max_consecutive_failures < 1:
            raise ValueError(
                f"max_consecutive_failures must be at least 1, got {max_consecutive_failures}"
            )
        self.max_consecutive_failures = max_consecutive_failures
        self.num_consecutive_failures = 0
        self.num_failed_steps_total = 0
        self.dead_reason: str | None = None
        """Set once, when the engine is declared dead."""
        self._on_dead = on_dead

    def observe(self, out: StepOutput) -> None:
        if out.error is None:
            self.num_consecutive_failures = 0
            return
        self.num_failed_steps_total += 1
        self.num_consecutive_failures += 1
        if self.num_consecutive_failures >= self.max_consecutive_failures:
            self.declare_dead(
                f"{self.num_consecutive_failures} consecutive engine steps "
                f"failed; the last one with: {out.error}"
            )

    def declare_dead(self, reason: str) -> None:
        """The engine is dead for `reason` (a failed step run, or a failure outside any
        step such as a lost tensor-parallel rank); only the first reason counts."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        log.error(
            "engine_dead", reason=reason, num_consecutive_failed_steps=self.num_consecutive_failures
        )
        if self._on_dead is not None:
            self._on_dead(reason)

    def wrap(self, forward: Callable[[StepOutput], None]) -> Callable[[StepOutput], None]:
        """`forward`, observing every step output first."""

        def observe_then_forward(out: StepOutput) -> None:
            self.observe(out)
            forward(out)

        return observe_then_forward
