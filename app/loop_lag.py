"""The event loop's lag, as the metric tandem:api_server_event_loop_lag_seconds.

An API server runs every request's validation, every stream's chunks and every scrape on
one thread; work that holds it (a long prompt's preparation, a burst of chunks) delays all
the rest, and no request's own timings show it. A task that sleeps INTERVAL_S and measures
how much later than that it woke sees it directly, at twenty wake-ups a second.
"""

from __future__ import annotations

import time

import anyio

from telemetry.metrics import EngineMetrics

INTERVAL_S = 0.05


async def watch_loop_lag(metrics: EngineMetrics, interval_s: float = INTERVAL_S) -> None:
    """Observe the loop's lag every `interval_s` until cancelled."""
    while True:
        due = time.monotonic() + interval_s
        await anyio.sleep(interval_s)
        metrics.observe_loop_lag(max(0.0, time.monotonic() - due))
