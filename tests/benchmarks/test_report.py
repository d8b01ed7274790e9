"""`python -m benchmarks.report`: each result's figures beside the last comparable entry of
its history (or a baseline's), and the floors of the GPU workloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.recording import record_result
from benchmarks.report import main


def _entry(rate: float, workload: str = "W1", gpu: str = "NVIDIA H200") -> dict[str, object]:
    return {
        "date": "2026-12-03T00:00:00Z",
        "commit": "abc1234",
        "clean": True,
        "hardware": {"gpus": [gpu]},
        "command": "python -m benchmarks.throughput",
        "workload": {"name": workload},
        "figures": {"v2_output_tok_s": rate},
    }


def test_current_figures_beside_the_last_comparable_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for entry in (
        _entry(100.0),
        _entry(50.0, gpu="NVIDIA H100"),
        _entry(999.0, "W2"),
        _entry(110.0),
    ):
        record_result(tmp_path, "w1", "throughput", entry)
    assert main(["--results-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "== w1 (throughput)" in text
    assert "v2_output_tok_s" in text and "was" in text and "+10.0%" in text
    assert text.count("history:") == 3


def test_against_a_baseline_and_unknown_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record_result(tmp_path / "base", "w1", "throughput", _entry(200.0))
    record_result(tmp_path, "w1", "throughput", _entry(190.0))
    assert main(["--results-dir", str(tmp_path), "--against", str(tmp_path / "base")]) == 0
    assert "-5.0%" in capsys.readouterr().out
    assert main(["--results-dir", str(tmp_path), "nothing"]) == 2


def test_floors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--floors"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["W1", "W2", "W3", "W4", "W5"]
    assert "91,1" in lines[1]  # W1's ideal output tok/s
