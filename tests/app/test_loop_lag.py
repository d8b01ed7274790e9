"""app.loop_lag: the event loop's lateness reaches tandem:api_server_event_loop_lag_seconds,
small while the loop is free and as long as the work that held it otherwise."""

from __future__ import annotations

import time

import anyio

from app.loop_lag import watch_loop_lag
from telemetry.metrics import EngineMetrics
from tests.telemetry.test_metrics import MODEL, scrape, value

LAG = "tandem:api_server_event_loop_lag_seconds"


def _lag(metrics: EngineMetrics) -> tuple[float, float, float]:
    """(count, sum, observations of at most 50 ms)."""
    families = scrape(metrics)
    return (
        value(families, LAG, LAG + "_count"),
        value(families, LAG, LAG + "_sum"),
        value(families, LAG, LAG + "_bucket", le="0.05"),
    )


def test_a_loop_held_by_blocking_work_shows_that_long_a_lag() -> None:
    metrics = EngineMetrics(MODEL)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_loop_lag, metrics, 0.01)
            await anyio.sleep(0.2)  # free: every wake-up is about on time
            count, _, _ = _lag(metrics)
            assert count >= 5
            time.sleep(0.3)  # what a GIL-holding prepare does to the loop, longer
            await anyio.sleep(0.05)
            tg.cancel_scope.cancel()

    anyio.run(main)
    count_after, total_after, small_after = _lag(metrics)
    late = count_after - small_after  # observations over 50 ms
    assert late >= 1 and total_after >= 0.25
