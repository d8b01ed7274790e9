"""benchmarks.multi_turn_figures: the per-turn and overall figures on hand-built records, the
server's counters and latency means, and the comparison of two results."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks import multi_turn
from benchmarks.multi_turn_chat import TurnRecord
from benchmarks.multi_turn_figures import (
    RATIO_KEYS,
    compare,
    counter_deltas,
    headline,
    overall,
    per_turn,
    ratio,
    read_counters,
)


def _record(chat: int, turn: int, ttft_ms: float, prompt: int, cached: int) -> TurnRecord:
    return TurnRecord(chat, turn, True, ttft_ms / 1e3, prompt, cached, 10)


RECORDS = [
    _record(0, 1, 100, 50, 0),
    _record(1, 1, 200, 50, 40),
    _record(2, 1, 300, 60, 40),
    _record(0, 2, 20, 100, 48),
    _record(1, 2, 40, 110, 96),
    TurnRecord(2, 2, False, error="boom"),
]


def test_per_turn_figures_are_hand_checked() -> None:
    one, two = per_turn(RECORDS, 2)
    assert (one["turn"], one["requests"], one["failed"]) == (1, 3, 0)
    # numpy's linear interpolation: p50 of 100/200/300 is 200, p90 280.
    assert one["ttft_p50_ms"] == pytest.approx(200) and one["ttft_p90_ms"] == pytest.approx(280)
    assert one["prompt_tokens_mean"] == pytest.approx(160 / 3)
    assert one["cached_tokens_mean"] == pytest.approx(80 / 3)
    assert one["computed_prefill_tokens_mean"] == pytest.approx(80 / 3)
    assert one["prior_context_tokens_mean"] is None
    assert (two["requests"], two["failed"]) == (2, 1)
    assert two["ttft_p50_ms"] == pytest.approx(30) and two["ttft_p90_ms"] == pytest.approx(38)
    assert two["computed_prefill_tokens_mean"] == pytest.approx((52 + 14) / 2)
    assert two["prior_context_tokens_mean"] == pytest.approx(60)  # 50 + 10 for both


def test_overall_figures_are_hand_checked() -> None:
    o = overall(RECORDS, 2.0, answer_len=10)
    assert (o["requests"], o["failed"], o["errors"]) == (5, 1, ["boom"])
    assert o["output_tokens"] == 50 and o["output_tok_s"] == pytest.approx(25)
    assert (o["prompt_tokens"], o["cached_tokens"], o["prefill_tokens_computed"]) == (370, 224, 146)
    assert o["hit_rate"] == pytest.approx(224 / 370) and o["answer_len_mismatches"] == 0
    assert o["turns_2_on"]["requests"] == 2 and o["turns_2_on"]["ttft_p50_ms"] == pytest.approx(30)
    assert overall([], 0.0, 10)["hit_rate"] is None


def test_counter_deltas_and_headline() -> None:
    before = {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 10.0}
    after = {
        "vllm:prefix_cache_queries_total": 300.0,
        "vllm:prefix_cache_hits_total": 160.0,
        "vllm:num_preemptions_total": 2.0,
    }
    deltas = counter_deltas(before, after)
    assert deltas["vllm:prefix_cache_queries_total"] == 200.0
    assert deltas["vllm:num_preemptions_total"] == 2.0
    assert deltas["server_hit_rate"] == pytest.approx(0.75)
    assert counter_deltas({}, {})["server_hit_rate"] is None
    assert counter_deltas({}, {})["server_time_to_first_token_mean_ms"] is None
    ttft = {
        "vllm:time_to_first_token_seconds_sum": 1.5,
        "vllm:time_to_first_token_seconds_count": 3,
    }
    queue = {"vllm:request_queue_time_seconds_sum": 0.2, "vllm:request_queue_time_seconds_count": 2}
    itl = {
        "vllm:inter_token_latency_seconds_sum": 0.06,
        "vllm:inter_token_latency_seconds_count": 4,
    }
    lag = {
        "tandem:api_server_event_loop_lag_seconds_sum": 0.03,
        "tandem:api_server_event_loop_lag_seconds_count": 10,
    }
    phases = counter_deltas({}, ttft | queue | itl | lag)
    assert phases["server_api_server_event_loop_lag_mean_ms"] == pytest.approx(3)
    assert phases["server_time_to_first_token_mean_ms"] == pytest.approx(500)
    assert phases["server_request_queue_time_mean_ms"] == pytest.approx(100)
    assert phases["server_inter_token_latency_mean_ms"] == pytest.approx(15)
    assert "vllm:time_to_first_token_seconds_sum" not in phases
    details = {"turns": per_turn(RECORDS, 2), "overall": overall(RECORDS, 2.0, 10)}
    details["server_counters"] = phases
    figures = headline(details)
    assert figures["server_itl_mean_ms"] == pytest.approx(15)
    assert figures["turn1_ttft_p50_ms"] == pytest.approx(200)
    assert figures["turns_2_on_ttft_p50_ms"] == pytest.approx(30)
    assert figures["turns_2_on_computed_prefill_mean"] == pytest.approx(33)
    assert (figures["prefill_tokens_computed"], figures["failed"]) == (146, 1)


def test_read_counters_sums_labels_and_keeps_preemptions(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 3.0\n'
        'vllm:prefix_cache_hits_created{model_name="m"} 1.7e9\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{model_name="m"} 1.0\n'
        "# TYPE tandem:rejected_requests counter\n"
        'tandem:rejected_requests_total{model_name="m",reason="a"} 4.0\n'
        "# TYPE tandem:preempted_rows counter\n"
        'tandem:preempted_rows_total{model_name="m",why="a"} 2.0\n'
        'tandem:preempted_rows_total{model_name="m",why="b"} 5.0\n'
    )
    monkeypatch.setattr(httpx, "get", lambda url, **kw: httpx.Response(200, text=text))
    assert read_counters("http://x") == {
        "vllm:prefix_cache_hits_total": 3.0,
        "vllm:num_preemptions_total": 1.0,
        "tandem:preempted_rows_total": 7.0,
    }


# ---- comparing two results ----------------------------------------------------------------


def _details(ttft: list[Any], computed: list[Any]) -> dict[str, Any]:
    keys = RATIO_KEYS
    turns = [
        {"turn": i + 1, keys[0]: t, keys[1]: c} for i, (t, c) in enumerate(zip(ttft, computed))
    ]
    later = {keys[0]: sum(ttft[1:]) / 2, keys[1]: sum(computed[1:]) / 2}
    return {"turns": turns, "overall": {"turns_2_on": later}}


def test_compare_prints_new_over_base_per_turn() -> None:
    base = {"current": {"details": _details([100, 400, 600], [1000, 1200, 1400])}}
    new = {"details": _details([100, 100, 200], [1000, 200, 200])}  # an --output record
    lines = compare(base, new)
    assert lines[1] == "   1  100.0 -> 100.0 (1.000)   1,000.0 -> 1,000.0 (1.000)"
    assert "(0.250)" in lines[2] and "(0.167)" in lines[2]
    assert lines[4].startswith("2-on") and "(0.300)" in lines[4] and "(0.154)" in lines[4]
    assert lines[-1].endswith("halved: True")
    slower = {"details": _details([100, 300, 300], [1000, 200, 200])}
    assert compare(base, slower)[-1].endswith("halved: False")  # TTFT 0.6 of before
    assert math.isnan(ratio({"k": 0}, {"k": 1}, "k")) and math.isnan(ratio({}, {"k": 1}, "k"))
    empty = {"details": {"turns": [], "overall": {"turns_2_on": {"ttft_p50_ms": None}}}}
    assert compare(base, empty)[-1].endswith("halved: False")


def test_compare_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [tmp_path / "base.json", tmp_path / "new.json"]
    for path, ttft in zip(paths, ([10, 40], [10, 10])):
        path.write_text(json.dumps({"current": {"details": _details(ttft + [40], [5, 8, 8])}}))
    assert multi_turn.main(["--compare", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "(0.250)" in out and "halved: False" in out  # prefill unchanged
