from __future__ import annotations

from collections.abc import Iterable

import prometheus_client
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from actors.protocol.messages import SchedulerStats, StepStats
from telemetry.metrics import IDLE_FRACTION_WINDOW_STEPS, EngineMetrics
from telemetry.records import RequestRecord

MODEL = "smollm2"


def scrape(metrics: EngineMetrics) -> dict[str, Metric]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def value(
    families: dict[str, Metric], family: str, sample: str | None = None, **labels: str
) -> float:
    """The one sample named `sample` (default: the family name) whose labels include
    `labels` and model_name."""
    wanted = {"model_name": MODEL, **labels}
    matches = [
        s.value
        for s in families[family].samples
        if s.name == (sample or family) and wanted.items() <= s.labels.items()
    ]
    assert len(matches) == 1, (family, sample, labels, families[family].samples)
    return matches[0]


def bucket(families: dict[str, Metric], histogram: str, le: str) -> float:
    return value(families, histogram, f"{histogram}_bucket", le=le)


def engine_stats(
    running: int,
    waiting: int,
    usage_perc: float,
    queries: int = 0,
    hits: int = 0,
    preemptions: int = 0,
) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=waiting,
        num_preemptions_total=preemptions,
        num_total_kv_blocks=100,
        num_free_kv_blocks=100 - int(usage_perc * 100),
        kv_usage_perc=usage_perc,
        prefix_cache_queries_tokens=queries,
        prefix_cache_hits_tokens=hits,
        num_free_rows=None,
    )


def record(
    request_id: str,
    reason: str,
    prompt: int,
    output: int,
    *,
    ttft: float | None,
    e2e: float,
    itl: Iterable[float] = (),
    cached: int = 0,
) -> RequestRecord:
    arrival = 1000.0
    return RequestRecord(
        request_id,
        arrival,
        arrival + e2e,
        reason,
        num_prompt_tokens=prompt,
        num_output_tokens=output,
        num_cached_tokens=cached,
        queued_time=arrival + 0.001,
        first_scheduled_time=None if ttft is None else arrival + 0.011,
        first_token_time=None if ttft is None else arrival + ttft,
        inter_token_latencies_s=tuple(itl),
    )


KNOWN_REQUESTS = [
    record("a", "stop", 10, 5, ttft=0.03, e2e=0.4, itl=[0.02, 0.02, 0.04, 0.3]),
    record("b", "stop", 20, 1, ttft=0.3, e2e=0.3),
    record("c", "length", 7, 16, ttft=0.015, e2e=1.2, itl=[0.012] * 15, cached=4),
    record("d", "abort", 30, 0, ttft=None, e2e=2.0),  # gave up while waiting
    record("e", "error", 9, 2, ttft=0.05, e2e=0.09, itl=[0.04]),
]


def test_every_name_is_exported_with_its_type_and_model_label() -> None:
    families = scrape(EngineMetrics(MODEL))
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "tandem:runner_info": "gauge",
        "tandem:engine_step_duration_seconds": "histogram",
        "tandem:gpu_idle_between_steps_seconds": "histogram",
        "tandem:gpu_idle_fraction": "gauge",
        "tandem:scheduler_cpu_time_per_step_seconds": "histogram",
        "tandem:rejected_requests": "counter",
        "tandem:client_disconnects": "counter",
        "tandem:num_requests_unsent": "gauge",
        "tandem:api_server_event_loop_lag_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL
    body = EngineMetrics(MODEL).render()[0].decode()
    for wire_name in (
        "vllm:prompt_tokens_total{",
        "vllm:request_success_total{",
        "vllm:num_preemptions_total{",
        "tandem:client_disconnects_total{",
    ):
        assert wire_name in body


def test_counters_and_histograms_match_a_known_set_of_requests() -> None:
    metrics = EngineMetrics(MODEL)
    for finished in KNOWN_REQUESTS:
        metrics.observe_request_finished(finished)
    families = scrape(metrics)
    success = "vllm:request_success"
    assert [
        value(families, success, f"{success}_total", finished_reason=reason)
        for reason in ("stop", "length", "abort", "error")
    ] == [2, 1, 1, 1]
    # Prompts count once their prefill produced a token (the aborted one never ran).
    assert value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 10 + 20 + 7 + 9
    assert (
        value(families, "vllm:generation_tokens", "vllm:generation_tokens_total")
        == 5 + 1 + 16 + 0 + 2
    )

    def count(histogram: str) -> float:
        return value(families, histogram, f"{histogram}_count")

    assert count("vllm:e2e_request_latency_seconds") == 5
    assert count("vllm:time_to_first_token_seconds") == 4
    assert count("vllm:request_queue_time_seconds") == 4
    assert count("vllm:request_prefill_time_seconds") == 4
    assert count("vllm:request_decode_time_seconds") == 4
    assert count("vllm:request_inference_time_seconds") == 4
    assert count("vllm:request_time_per_output_token_seconds") == 3  # >= 2 output tokens
    assert count("vllm:inter_token_latency_seconds") == 4 + 15 + 1

    ttft = "vllm:time_to_first_token_seconds"
    assert [
        bucket(families, ttft, le) for le in ("0.01", "0.02", "0.04", "0.06", "0.25", "0.5", "+Inf")
    ] == [0, 1, 2, 3, 3, 4, 4]
    assert value(families, ttft, f"{ttft}_sum") == pytest.approx(0.03 + 0.3 + 0.015 + 0.05)
    itl = "vllm:inter_token_latency_seconds"
    assert [bucket(families, itl, le) for le in ("0.01", "0.025", "0.05", "0.3", "+Inf")] == [
        0,
        17,
        19,
        20,
        20,
    ]
    e2e = "vllm:e2e_request_latency_seconds"
    assert [bucket(families, e2e, le) for le in ("0.3", "0.5", "1.0", "1.5", "2.0")] == [
        2,
        3,
        3,
        4,
        5,
    ]  # vLLM's latency buckets start at 0.3 s; a bound counts as inside
    tpot = "vllm:request_time_per_output_token_seconds"
    # Request c: (1.2 - 0.015) s of decode over 15 tokens after the first.
    assert value(families, tpot, f"{tpot}_sum") == pytest.approx(
        (0.4 - 0.03) / 4 + (1.2 - 0.015) / 15 + (0.09 - 0.05) / 1
    )


def test_old_vllm_names_carry_the_same_series_as_the_new_ones() -> None:
    """vllm:gpu_cache_usage_perc and vllm:time_per_output_token_seconds, which vLLM still
    exports and older dashboards query, are the KV-usage gauge and the inter-token
    histogram under their earlier names: same samples, same buckets."""
    metrics = EngineMetrics(MODEL)
    metrics.set_engine_load(engine_stats(2, 1, 0.37))
    for finished in KNOWN_REQUESTS:
        metrics.observe_request_finished(finished)
    families = scrape(metrics)

    def samples(family: str) -> dict[tuple[str, str], float]:
        return {
            (s.name.removeprefix(family), s.labels.get("le", "")): s.value
            for s in families[family].samples
        }

    assert value(families, "vllm:gpu_cache_usage_perc") == 0.37
    assert samples("vllm:gpu_cache_usage_perc") == samples("vllm:kv_cache_usage_perc")
    old_itl = samples("vllm:time_per_output_token_seconds")
    assert old_itl == samples("vllm:inter_token_latency_seconds")
    assert old_itl[("_count", "")] == 4 + 15 + 1 and old_itl[("_bucket", "0.025")] == 17
    for old in ("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"):
        assert "DEPRECATED" in families[old].documentation


def test_requests_a_predecessor_left_count_as_aborted() -> None:
    metrics = EngineMetrics(MODEL)
    metrics.record_predecessor_aborts(3)
    metrics.observe_request_finished(KNOWN_REQUESTS[0])
    families = scrape(metrics)
    success = "vllm:request_success"
    assert value(families, success, f"{success}_total", finished_reason="abort") == 3
    assert value(families, success, f"{success}_total", finished_reason="stop") == 1
    assert value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == 5


def test_gauges_go_back_to_zero_and_prefix_counters_follow_the_totals() -> None:
    metrics = EngineMetrics(MODEL)
    busy_stats = engine_stats(3, 2, 0.5, queries=100, hits=40)
    metrics.set_engine_load(busy_stats)
    metrics.observe_engine_totals(busy_stats)
    busy = scrape(metrics)
    assert value(busy, "vllm:num_requests_running") == 3
    assert value(busy, "vllm:num_requests_waiting") == 2
    assert value(busy, "vllm:kv_cache_usage_perc") == 0.5
    idle_stats = engine_stats(0, 0, 0.0, queries=160, hits=40)
    metrics.set_engine_load(idle_stats)
    metrics.observe_engine_totals(idle_stats)
    idle = scrape(metrics)
    assert value(idle, "vllm:num_requests_running") == 0
    assert value(idle, "vllm:num_requests_waiting") == 0
    assert value(idle, "vllm:kv_cache_usage_perc") == 0
    assert value(idle, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 160
    assert value(idle, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 40
    metrics.set_engine_load(engine_stats(1, 0, 0.1, queries=0))  # load only: totals stay
    assert (
        value(scrape(metrics), "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
        == 160
    )


def test_preemption_counter_advances_by_the_change_in_the_total() -> None:
    metrics = EngineMetrics(MODEL)
    for total in (0, 2, 2, 5):
        metrics.observe_engine_totals(engine_stats(0, 0, 0.0, preemptions=total))
    assert value(scrape(metrics), "vllm:num_preemptions", "vllm:num_preemptions_total") == 5
    metrics.observe_engine_totals(engine_stats(0, 0, 0.0, preemptions=1))  # source restarted
    assert value(scrape(metrics), "vllm:num_preemptions", "vllm:num_preemptions_total") == 6


def step(step_id: int, step_time_s: float, gpu_idle_s: float, num_tokens: int = 8) -> StepStats:
    return StepStats(
        step_id=step_id,
        num_reqs=4,
        num_tokens=num_tokens,
        num_prefill_tokens=0,
        schedule_time_s=3e-5,
        prepare_time_s=2e-4,
        step_time_s=step_time_s,
        gpu_idle_s=gpu_idle_s,
    )


def test_step_histograms_and_idle_fraction() -> None:
    metrics = EngineMetrics(MODEL)
    assert value(scrape(metrics), "tandem:gpu_idle_fraction") == 0
    for step_id in range(10):
        metrics.observe_step(step(step_id, 0.004, 0.0 if step_id % 2 else 0.002))
    metrics.observe_step(step(10, 0.0, 0.0, num_tokens=0))  # a failed step: skipped
    families = scrape(metrics)
    idle = "tandem:gpu_idle_between_steps_seconds"
    assert bucket(families, idle, "0.0") == 5  # perfectly overlapped steps
    assert bucket(families, idle, "0.0025") == 10
    assert (
        value(
            families,
            "tandem:engine_step_duration_seconds",
            "tandem:engine_step_duration_seconds_count",
        )
        == 10
    )
    assert (
        value(
            families,
            "tandem:scheduler_cpu_time_per_step_seconds",
            "tandem:scheduler_cpu_time_per_step_seconds_count",
        )
        == 10
    )
    assert value(families, "tandem:gpu_idle_fraction") == pytest.approx(0.01 / (0.01 + 0.04))
    # The fraction covers the most recent steps only.
    for step_id in range(IDLE_FRACTION_WINDOW_STEPS):
        metrics.observe_step(step(step_id, 0.004, 0.0))
    assert value(scrape(metrics), "tandem:gpu_idle_fraction") == 0


def test_runner_info_shows_only_the_current_choice() -> None:
    metrics = EngineMetrics(MODEL)
    metrics.set_runner("v1", "forced by --runner v1", "override")
    metrics.set_runner("v2", "no fallback rule applies", "default")
    [sample] = scrape(metrics)["tandem:runner_info"].samples
    assert sample.value == 1
    assert sample.labels == {
        "model_name": MODEL,
        "runner": "v2",
        "reason": "no fallback rule applies",
        "rule": "default",
    }


def test_rejections_by_reason_and_disconnects() -> None:
    metrics = EngineMetrics(MODEL)
    for reason in ("queue_full", "queue_full", "draining"):
        metrics.record_rejection(reason)
    metrics.record_disconnect()
    families = scrape(metrics)
    rejected = "tandem:rejected_requests"
    assert value(families, rejected, f"{rejected}_total", reason="queue_full") == 2
    assert value(families, rejected, f"{rejected}_total", reason="draining") == 1
    assert value(families, "tandem:client_disconnects", "tandem:client_disconnects_total") == 1


def test_unsent_requests_gauge_follows_the_admission_count() -> None:
    metrics = EngineMetrics(MODEL)
    metrics.set_unsent(3)
    assert value(scrape(metrics), "tandem:num_requests_unsent") == 3
    metrics.set_unsent(0)
    assert value(scrape(metrics), "tandem:num_requests_unsent") == 0


def test_each_server_has_a_private_registry() -> None:
    first, second = EngineMetrics(MODEL), EngineMetrics(MODEL)  # no duplicate-name clash
    first.record_disconnect()
    assert (
        value(scrape(second), "tandem:client_disconnects", "tandem:client_disconnects_total") == 0
    )
    global_body = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "vllm:" not in global_body and "tandem:" not in global_body


def test_openmetrics_is_served_when_asked_for() -> None:
    metrics = EngineMetrics(MODEL)
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.decode().rstrip().endswith("# EOF")


def test_empty_model_name_is_refused() -> None:
    with pytest.raises(ValueError, match="model_name"):
        EngineMetrics("")
