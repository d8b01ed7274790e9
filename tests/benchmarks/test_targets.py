"""benchmarks/targets.py: a target's status follows the figure, the bound and the card."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks.recording import RESULTS_DIR
from benchmarks.target_list import TARGETS
from benchmarks.targets import (
    BeforeCommit,
    Detail,
    Figure,
    Ratio,
    Results,
    Target,
    describe,
    main,
    status,
)

H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
REPO = Path(__file__).resolve().parents[2]


def _entry(figures: dict[str, Any], gpu: str, commit: str = "abc1234", **extra: Any) -> dict:
    return {
        "commit": commit,
        "date": "2026-12-07T00:00:00Z",
        "hardware": {"gpus": [gpu]},
        "workload": {"model": "m"},
        "figures": figures,
        "details": extra.pop("details", {}),
        **extra,
    }


def _write(folder: Path, name: str, current: dict, history: list[dict] | None = None) -> None:
    result = {"result": name, "benchmark": "b", "current": current, "history": history or []}
    (folder / f"{name}.json").write_text(json.dumps(result))


def _status(target: Target, folder: Path) -> str:
    return status(target, target.read(Results(folder)))


def test_a_bound_holds_only_on_the_issues_card(tmp_path: Path) -> None:
    tpot = Target(1, "tpot", Figure("b1", "tpot_ms"), 3.5, at_most=True, unit=" ms")
    _write(tmp_path, "b1", _entry({"tpot_ms": 3.4}, H200))
    assert _status(tpot, tmp_path) == "met"
    _write(tmp_path, "b1", _entry({"tpot_ms": 3.6}, H200))
    assert _status(tpot, tmp_path) == "not met"
    _write(tmp_path, "b1", _entry({"tpot_ms": 3.4}, H100))
    assert _status(tpot, tmp_path) == f"met on {H100} only"
    assert _status(Target(1, "x", Figure("absent", "tpot_ms"), 1.0), tmp_path) == "not measured"
    assert _status(Target(1, "x", Figure("b1", "no_such_key"), 1.0), tmp_path) == "not measured"


def test_at_least_bounds_and_reported_rows(tmp_path: Path) -> None:
    _write(tmp_path, "w", _entry({"tok_s": 25_000.0}, H200))
    assert _status(Target(1, "w", Figure("w", "tok_s"), 25_000), tmp_path) == "met"
    assert _status(Target(1, "w", Figure("w", "tok_s"), 25_001), tmp_path) == "not met"
    assert _status(Target(1, "w", Figure("w", "tok_s")), tmp_path) == "reported"


def test_a_ratio_takes_the_card_only_where_both_results_ran_on_it(tmp_path: Path) -> None:
    _write(tmp_path, "tandem", _entry({"tok_s": 300.0}, H200))
    _write(tmp_path, "hf", _entry({"tok_s": 20.0}, H100))
    speedup = Target(1, "vs", Ratio(Figure("tandem", "tok_s"), Figure("hf", "tok_s")), 10)
    reading = speedup.read(Results(tmp_path))
    assert reading is not None and reading.value == 15.0
    assert status(speedup, reading) == f"met on {H100} + {H200} only"
    assert speedup.read.names == ("tandem", "hf")
    _write(tmp_path, "hf", _entry({"tok_s": 0.0}, H200))
    assert _status(speedup, tmp_path) == "not measured"  # nothing to divide by


def test_details_and_the_run_before_a_change(tmp_path: Path) -> None:
    runs = {"runs": [{"num_preemptions": 0}, {"num_preemptions": 3}]}
    _write(tmp_path, "kv", _entry({}, H200, details=runs))
    preemptions = Detail("kv", lambda d: max(r["num_preemptions"] for r in d["runs"]))
    assert _status(Target(1, "p", preemptions, 0, at_most=True), tmp_path) == "not met"
    assert Detail("kv", lambda d: d["startup"]["kv_cache_tokens"])(Results(tmp_path)) is None

    before = _entry({"prefill": 500.0}, H200, commit="95c77a7dead")
    other_card = _entry({"prefill": 900.0}, H100, commit="95c77a7dead")
    _write(tmp_path, "mt", _entry({"prefill": 240.0}, H200), [before, other_card])
    halved = Ratio(Figure("mt", "prefill"), BeforeCommit("mt", "prefill", "95c77a7"))
    target = Target(1, "reuse", halved, 0.5, at_most=True)
    reading = target.read(Results(tmp_path))
    assert reading is not None and reading.value == pytest.approx(0.48)
    assert "0.48x" in describe(Target(1, "reuse", halved, 0.5, True, "x"), reading)
    assert BeforeCommit("mt", "prefill", "0000000")(Results(tmp_path)) is None


def test_every_target_reads_a_result_that_a_benchmark_writes() -> None:
    """A result name misspelt in the list would read as "not measured" for ever."""
    plan = (REPO / "benchmarks" / "device_plan.sh").read_text()
    planned = set(re.findall(r"--result[= ]\"?([\w-]+)", plan))
    # tier_arms and serve_moe build their names from parts
    planned |= {
        f"multi_turn_{p}_{a}"
        for p in ("qwen3_tiers", "llama8b_tiers")
        for a in ("unlimited", "limited", "host", "noreuse")
    }
    planned |= {"serve_chat_w4", "serve_chat_w5"}
    committed = {p.stem for p in RESULTS_DIR.glob("*.json")}
    for target in TARGETS:
        unknown = [n for n in target.read.names if n not in planned | committed]
        assert not unknown, f"{target.what}: no benchmark writes {unknown}"


def test_the_command_prints_one_line_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--issue", "26"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == sum(1 for t in TARGETS if t.issue == 26)
    assert all(line.startswith("#26 ") for line in lines)
