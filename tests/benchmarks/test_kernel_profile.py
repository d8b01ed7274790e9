"""benchmarks.kernel_profile: the per-step kernel table (its summary is pure; the profiler
itself needs CUDA kernels to report anything)."""

from __future__ import annotations

import pytest

from benchmarks.kernel_profile import NAME_CHARS, format_kernels, summarise_kernels


def test_kernels_are_ranked_by_device_time_per_step() -> None:
    events = [("gemv", 30.0), ("attn", 10.0), ("gemv", 30.0), ("norm", 2.0), ("attn", 10.0)]
    summary = summarise_kernels(events, num_steps=2, top=2)
    names = [row["name"] for row in summary["kernels"]]
    assert names == ["gemv", "attn", "(1 other kernels)"]
    gemv = summary["kernels"][0]
    assert gemv["ms_per_step"] == pytest.approx(0.030)
    assert gemv["calls_per_step"] == 1.0
    assert gemv["share"] == pytest.approx(60 / 82)
    assert summary["device_ms_per_step"] == pytest.approx(0.041)
    assert summary["num_kernel_launches"] == 5
    assert sum(row["share"] for row in summary["kernels"]) == pytest.approx(1.0)


def test_long_names_are_cut_and_grouped_by_their_cut() -> None:
    long_a, long_b = "k" * NAME_CHARS + "a", "k" * NAME_CHARS + "b"
    summary = summarise_kernels([(long_a, 1.0), (long_b, 1.0)], num_steps=1)
    assert [row["name"] for row in summary["kernels"]] == ["k" * NAME_CHARS]
    assert summary["kernels"][0]["calls_per_step"] == 2


def test_a_run_without_kernels_reads_as_zero_not_an_error() -> None:
    summary = summarise_kernels([], num_steps=0)
    assert summary["kernels"] == [] and summary["device_ms_per_step"] == 0.0
    assert "0 kernels" in format_kernels(summary)


def test_the_table_shows_each_rows_time_and_share() -> None:
    text = format_kernels(summarise_kernels([("gemv", 500.0), ("attn", 500.0)], num_steps=1))
    assert "1.000 ms per step" in text
    assert "0.500 ms" in text and "50.0%" in text and "gemv" in text
