"""The front end's judgement of a silent engine core: silence beyond the bound is a stall,
reported once; silence beyond twice the bound makes it unresponsive, reported once per
silence; any message ends both; a tick of the front end's own blocked loop (the core's
heartbeats waiting unread) is no evidence."""

from __future__ import annotations

import time

import anyio
import pytest

from app.engine_watchdog import EngineWatchdog


def _watchdog(stall_timeout_s: float, heard: list[float]) -> tuple[EngineWatchdog, list[object]]:
    events: list[object] = []
    watchdog = EngineWatchdog(
        stall_timeout_s,
        lambda: heard[0],
        lambda silent_s: events.append(("stalled", silent_s)),
        lambda: events.append("resumed"),
        lambda silent_s: events.append(("unresponsive", silent_s)),
    )
    return watchdog, events


def test_silence_beyond_the_bound_is_a_stall_until_the_core_is_heard() -> None:
    heard = [100.0]
    watchdog, events = _watchdog(2.0, heard)
    watchdog.check(102.0)
    assert events == [] and not watchdog.is_stalled
    watchdog.check(102.5)
    watchdog.check(103.5)
    assert events == [("stalled", 2.5)] and watchdog.is_stalled
    heard[0] = 103.6
    watchdog.check(103.7)
    assert events[1:] == ["resumed"] and not watchdog.is_stalled


def test_silence_beyond_twice_the_bound_is_unresponsive_once_per_silence() -> None:
    heard = [100.0]
    watchdog, events = _watchdog(2.0, heard)
    watchdog.check(103.0)
    watchdog.check(104.0)
    assert events == [("stalled", 3.0)] and not watchdog.is_unresponsive
    watchdog.check(104.5)
    watchdog.check(120.0)
    assert events[1:] == [("unresponsive", 4.5)] and watchdog.is_unresponsive
    heard[0] = 120.0
    watchdog.check(120.1)
    assert events[2:] == ["resumed"] and not watchdog.is_unresponsive
    watchdog.check(125.0)  # silent again: a new stall, and unresponsive again
    assert events[3:] == [("stalled", 5.0), ("unresponsive", 5.0)]


def test_a_bound_shorter_than_two_heartbeats_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        _watchdog(0.5, [0.0])


async def test_a_late_tick_of_its_own_loop_is_not_judged() -> None:
    heard = [time.monotonic()]
    watchdog, events = _watchdog(1.0, heard)
    async with anyio.create_task_group() as tg:
        tg.start_soon(watchdog.run)
        await anyio.sleep(0.3)
        time.sleep(1.5)  # this loop is blocked: the core's heartbeats wait unread
        await anyio.sleep(0.05)  # the watchdog's late tick runs first
        heard[0] = time.monotonic()  # then the receive loop reads them
        await anyio.sleep(0.6)
        watchdog.stop()
    assert events == []
