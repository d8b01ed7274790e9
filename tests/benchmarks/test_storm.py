"""benchmarks/storm.py's summary (the storm itself is a by-hand benchmark of minutes)."""

from __future__ import annotations

from benchmarks.storm import summarize


def test_only_readers_that_completed_count_in_the_percentiles() -> None:
    outcomes = [
        ("completed", 0.5, 10.0),
        ("completed", 1.5, 30.0),
        ("hung_up", 0.2, 0.2),
        ("timeout", None, 60.0),
        ("status 503", None, 0.1),
    ]
    summary = summarize(outcomes)
    assert summary["ends"] == {"completed": 2, "hung_up": 1, "timeout": 1, "status 503": 1}
    assert summary["completed"] == 2 and summary["timeouts"] == 1
    assert summary["ttft_s"] == {"p50": 1.0, "p99": 1.5, "max": 1.5}
    assert summary["completion_s"]["max"] == 30.0


def test_a_storm_with_no_reader_left_has_no_percentiles() -> None:
    summary = summarize([("hung_up", 0.1, 0.1)])
    assert summary["ttft_s"] == {"p50": None, "p99": None, "max": None}
