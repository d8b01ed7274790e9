"""The figures benchmarks.throughput computes from its runs: TTFT and TPOT with vLLM's
definitions, the GPU's idle fraction between steps, each arm's median over its repeats, and
the headline figures benchmarks.report compares."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.throughput_engine import EngineRun

IDLE_MIN_BATCH = 64


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "mean_ms": 1e3 * statistics.fmean(ordered),
        "median_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def latency_figures(run: EngineRun) -> dict[str, Any]:
    """TTFT and TPOT with vLLM's definitions (TPOT = (latency - TTFT) / (outputs - 1))."""
    tpot = [
        (r.latency_s - r.ttft_s) / (r.num_output_tokens - 1)
        for r in run.requests
        if r.num_output_tokens > 1
    ]
    return {"ttft": _percentiles([r.ttft_s for r in run.requests]), "tpot": _percentiles(tpot)}


def gpu_idle_figures(steps: tuple[Any, ...], min_batch: int = IDLE_MIN_BATCH) -> dict[str, Any]:
    """Idle fraction = idle / (idle + step time) over steps of at least `min_batch` requests
    (the first step has no predecessor and is left out)."""
    timed = [s for s in steps[1:] if s.step_time_s > 0 and s.num_reqs >= min_batch]
    if not timed:
        return {"measured": False}
    idle = sum(s.gpu_idle_s for s in timed)
    busy = sum(s.step_time_s for s in timed)
    decode = [s for s in timed if s.num_prefill_tokens == 0]
    return {
        "measured": True,
        "min_batch": min_batch,
        "num_steps": len(timed),
        "idle_fraction": idle / (idle + busy),
        "decode_idle_fraction": (
            sum(s.gpu_idle_s for s in decode)
            / max(sum(s.gpu_idle_s + s.step_time_s for s in decode), 1e-12)
        ),
        "mean_step_ms": 1e3 * busy / len(timed),
        "mean_decode_step_ms": (
            1e3 * statistics.fmean(s.step_time_s for s in decode) if decode else None
        ),
        "mean_prepare_ms": 1e3 * statistics.fmean(s.prepare_time_s for s in timed),
    }


def summarise_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: median and spread of output tokens/s over its repeats."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if "output_tok_s" in run:
            by_arm.setdefault(run["arm"], []).append(run)
    summary = {}
    for arm, arm_runs in by_arm.items():
        rates = [r["output_tok_s"] for r in arm_runs]
        summary[arm] = {
            "repeats": len(rates),
            "median_output_tok_s": statistics.median(rates),
            "min_output_tok_s": min(rates),
            "max_output_tok_s": max(rates),
            "num_prompts": arm_runs[0]["num_prompts"],
        }
    return summary


def headline(details: dict[str, Any]) -> dict[str, Any]:
    """The figures `benchmarks.report` compares between results."""
    rate = {arm: s["median_output_tok_s"] for arm, s in details["summary"].items()}
    figures: dict[str, Any] = {
        f"{arm}_output_tok_s": round(value, 1) for arm, value in rate.items()
    }
    if "v1" in rate:
        figures["v2_over_v1"] = round(rate["v2"] / rate["v1"], 3)
    v2_runs = [r for r in details["runs"] if r.get("arm") == "v2"]
    idle = [r["gpu_idle"]["idle_fraction"] for r in v2_runs if r["gpu_idle"].get("measured")]
    if idle:
        figures["v2_gpu_idle_fraction"] = round(max(idle), 4)
    for metric in ("ttft", "tpot"):
        medians = [r[metric]["median_ms"] for r in v2_runs if r[metric]]
        if medians:
            figures[f"v2_{metric}_median_ms"] = round(statistics.median(medians), 2)
    figures["ready_s"] = round(details["startup"]["ready_s"], 2)
    return figures
