"""`python -m benchmarks.spec_decode`: a real run on a small dummy model on the CPU (the token
check, both arms interleaved, the record's fields), and its figures on hand-built steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from actors.protocol.messages import SpecDecodeStats, StepStats
from benchmarks.spec_decode import acceptance, headline, main, step_profile, summarise


@pytest.mark.slow
def test_a_cpu_run_checks_tokens_and_records_both_arms(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    argv = [
        "--model",
        "dummy:smollm2-135m",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--concurrency",
        "2",
        "--max-tokens",
        "5",
        "--input-len",
        "12",
        "--repeats",
        "1",
        "--max-model-len",
        "64",
        "--not-a-result",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    details = record["details"]
    assert set(details["checks"]) == {"greedy_c2", "temperature_1_c2"}
    for check in details["checks"].values():
        assert check["num_equal"] == check["num_requests"]
    assert record["figures"]["tokens_equal"] is True
    # Each repeat runs off on on off per concurrency and sampling arm.
    runs = details["runs"]
    assert [r["arm"] for r in runs[:4]] == ["off", "on", "on", "off"]
    assert len(runs) == 2 * 4
    # TPOT is the difference of two timed batches (n tokens and 1), so on a busy CPU only
    # its presence is certain, not its sign
    assert all(r["total_s"] > 0 and r["first_token_s"] > 0 for r in runs)
    assert all(math.isfinite(r["tpot_ms"]) and "prefill" in r["steps"] for r in runs)
    # Whether an 'on' step finds a draft depends on the tokens so far, so only the 'off'
    # arm's kinds are fixed: it never speculates.
    assert all(set(r["steps"]) == {"prefill", "plain"} for r in runs if r["arm"] == "off")
    assert all(set(r["steps"]) & {"plain", "spec"} for r in runs if r["arm"] == "on")
    assert set(details["summary"]) == set(details["checks"])
    assert "launches" not in details  # counted on CUDA only
    assert "greedy_c2_tpot_change" in record["figures"]


def _step(step_id: int, num_reqs: int, accepted: int | None, prefill: int = 0) -> StepStats:
    spec = None
    num_tokens = num_reqs + prefill
    if accepted is not None:
        spec = SpecDecodeStats(num_reqs, 2 * num_reqs, accepted, (accepted,))
        num_tokens = 3 * num_reqs  # K = 2 slots per row
    return StepStats(step_id, num_reqs, num_tokens, prefill, step_time_s=0.002, spec=spec)


def test_step_profile_counts_emitted_tokens_per_kind_of_step() -> None:
    steps = (_step(0, 4, None, prefill=40), _step(1, 4, 6), _step(2, 4, None), _step(3, 4, 2))
    profile = step_profile(steps)
    assert profile["spec"]["num_steps"] == 2
    assert profile["spec"]["output_tokens_per_step"] == pytest.approx((10 + 6) / 2)
    assert (
        profile["spec"]["query_tokens_per_step"]
        == 12
        == 3 * profile["plain"]["query_tokens_per_step"]
    )
    assert profile["spec"]["device_ms_per_output_token"] == pytest.approx(4.0 / 16)
    assert profile["plain"]["device_ms_per_output_token"] == pytest.approx(2.0 / 4)
    assert profile["prefill"]["num_steps"] == 1
    figures = acceptance(steps)
    assert figures["acceptance_rate"] == pytest.approx(8 / 16)
    assert figures["mean_acceptance_length"] == pytest.approx(1 + 8 / 8)


def test_summary_compares_medians_of_each_arm() -> None:
    def run(arm: str, tpot: float) -> dict:
        return {
            "arm": arm,
            "sampling": "greedy",
            "concurrency": 32,
            "tpot_ms": tpot,
            "acceptance_rate": 0.9 if arm == "on" else 0.0,
            "mean_acceptance_length": 1.9,
            "num_spec_steps": 3,
            "num_steps": 4,
            "steps": {},
        }

    runs = [run("off", 2.0), run("on", 1.5), run("on", 1.7), run("off", 2.2)]
    summary = summarise(runs, [32])
    row = summary["greedy_c32"]
    assert row["tpot_ms_off"] == pytest.approx(2.1) and row["tpot_ms_on"] == pytest.approx(1.6)
    assert row["tpot_change"] == pytest.approx(1.6 / 2.1 - 1)
    assert row["spec_step_share"] == pytest.approx(0.75)
    assert headline(summary)["greedy_c32_tpot_change"] == pytest.approx(1.6 / 2.1 - 1, abs=1e-4)
