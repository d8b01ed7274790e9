"""What benchmarks.multi_turn reports: per-turn and overall figures from the turns' records,
the server's counters read before and after the run and their deltas, the headline figures,
the printed table, and the comparison of two results (--compare)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

import httpx

from benchmarks.multi_turn_chat import TurnRecord
from benchmarks.serve_metrics import distribution_ms
from benchmarks.stream_client import auth_headers

COUNTERS = ("vllm:prefix_cache_", "vllm:prompt_tokens_", "tandem:kv_offload_hits")
"""/metrics counters read before and after the run, with every one about preemption."""
PHASES = (
    "vllm:time_to_first_token",
    "vllm:request_queue_time",
    "vllm:request_prefill_time",
    "vllm:inter_token_latency",
    "tandem:api_server_event_loop_lag",
)
"""The server's own latency histograms (seconds), whose means over the run split the
client's TTFT into waiting, prefill and the rest (the front end and the client itself);
the inter-token latency's mean is the running requests' decode period, which copies from
the KV tiers must not stretch (the same run with and without a tier compares them); the
event loop's lag is how long the front end's one thread kept everything else waiting."""
RATIO_KEYS = ("ttft_p50_ms", "computed_prefill_tokens_mean")


def per_turn(records: list[TurnRecord], turns: int) -> list[dict[str, Any]]:
    """Each turn's figures over the conversations whose turn succeeded."""
    by_key = {(r.conversation, r.turn): r for r in records if r.success}
    rows = []
    for turn in range(1, turns + 1):
        done = [r for r in records if r.turn == turn and r.success]
        failed = sum(1 for r in records if r.turn == turn and not r.success)
        prior = [by_key.get((r.conversation, turn - 1)) for r in done]
        context = _mean([p.prompt_tokens + p.output_tokens for p in prior if p is not None])
        rows.append({"turn": turn, "requests": len(done), "failed": failed, **_figures(done)})
        rows[-1]["prior_context_tokens_mean"] = context
    return rows


def _figures(done: list[TurnRecord]) -> dict[str, Any]:
    ttft = distribution_ms([r.ttft_s for r in done], (50.0, 90.0))
    return {
        "ttft_p50_ms": ttft["p50_ms"],
        "ttft_p90_ms": ttft["p90_ms"],
        "prompt_tokens_mean": _mean([r.prompt_tokens for r in done]),
        "cached_tokens_mean": _mean([r.cached_tokens for r in done]),
        "computed_prefill_tokens_mean": _mean([r.prompt_tokens - r.cached_tokens for r in done]),
    }


def overall(records: list[TurnRecord], duration_s: float, answer_len: int) -> dict[str, Any]:
    done = [r for r in records if r.success]
    prompt, cached = sum(r.prompt_tokens for r in done), sum(r.cached_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    later = [r for r in done if r.turn > 1]
    return {
        "requests": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "output_tokens": output,
        "output_tok_s": output / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens_computed": prompt - cached,
        "hit_rate": cached / prompt if prompt else None,
        "answer_len_mismatches": sum(1 for r in done if r.output_tokens != answer_len),
        "turns_2_on": {"requests": len(later), **_figures(later)},
        "errors": sorted({r.error for r in records if not r.success})[:10],
    }


def read_counters(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's COUNTERS and preemption counters (vllm: and tandem:), summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", headers=auth_headers(api_key), timeout=30).text
    found: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            ours = s.name.startswith(COUNTERS) or "preempt" in s.name
            if ours and s.name.startswith(("vllm:", "tandem:")) and s.name.endswith("_total"):
                found[s.name] += s.value
            if s.name.removesuffix("_seconds_sum") in PHASES:
                found[s.name] += s.value
            if s.name.removesuffix("_seconds_count") in PHASES:
                found[s.name] += s.value
    return dict(found)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    deltas: dict[str, Any] = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}
    q, h = (deltas.get(f"vllm:prefix_cache_{k}_total") for k in ("queries", "hits"))
    means_ms = {}
    for phase in PHASES:
        total_s, count = (deltas.pop(f"{phase}_seconds_{k}", 0.0) for k in ("sum", "count"))
        name = phase.split(":")[1]
        means_ms[f"server_{name}_mean_ms"] = 1000 * total_s / count if count else None
    return deltas | {"server_hit_rate": h / q if q and h is not None else None} | means_ms


def headline(details: dict[str, Any]) -> dict[str, Any]:
    """The figures benchmarks.report compares."""
    o, later = details["overall"], details["overall"]["turns_2_on"]
    figures = {k: o[k] for k in ("output_tok_s", "prefill_tokens_computed", "hit_rate", "failed")}
    figures["turn1_ttft_p50_ms"] = details["turns"][0]["ttft_p50_ms"]
    figures["turns_2_on_ttft_p50_ms"] = later["ttft_p50_ms"]
    figures["turns_2_on_computed_prefill_mean"] = later["computed_prefill_tokens_mean"]
    counters = details.get("server_counters") or {}
    figures["server_itl_mean_ms"] = counters.get("server_inter_token_latency_mean_ms")
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}


def compare(base: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """NEW/BASE per turn and over turns 2 on (pooled) of TTFT p50 and computed prefill
    tokens; the issue asks for both at most 0.5 on turns 2 on. `base` and `new` are result
    files (their current entry) or --output records."""
    b, n = (r.get("current", r)["details"] for r in (base, new))
    rows = [(str(x["turn"]), x, y) for x, y in zip(b["turns"], n["turns"], strict=False)]
    rows.append(("2-on", b["overall"]["turns_2_on"], n["overall"]["turns_2_on"]))
    lines = ["turn  TTFT p50 ms: base -> new (new/base)   computed prefill: base -> new (new/base)"]
    for name, x, y in rows:
        cells = (f"{_num(x.get(k))} -> {_num(y.get(k))} ({ratio(x, y, k):.3f})" for k in RATIO_KEYS)
        lines.append(f"{name:>4}  " + "   ".join(cells))
    halved = all(ratio(rows[-1][1], rows[-1][2], k) <= 0.5 for k in RATIO_KEYS)
    return [*lines, f"turns 2 on: TTFT p50 and computed prefill halved: {halved}"]


def ratio(base: dict[str, Any], new: dict[str, Any], key: str) -> float:
    b, n = base.get(key), new.get(key)
    return math.nan if b is None or n is None or b == 0 else n / b


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def describe(details: dict[str, Any]) -> list[str]:
    keys = "ttft_p50_ms ttft_p90_ms prompt_tokens_mean cached_tokens_mean".split()
    keys += ["computed_prefill_tokens_mean", "prior_context_tokens_mean"]
    lines = ["turn  reqs  fail  TTFT p50 ms  TTFT p90 ms   prompt   cached  computed  prior ctx"]
    for t in details["turns"]:
        figures = "".join(f"{_num(t[k]):>{w}}" for k, w in zip(keys, (13, 13, 9, 9, 10, 11)))
        lines.append(f"{t['turn']:>4}  {t['requests']:>4}  {t['failed']:>4}{figures}")
    o = details["overall"]
    hit = "-" if o["hit_rate"] is None else f"{o['hit_rate']:.3f}"
    lines.append(
        f"overall: {o['requests']} ok, {o['failed']} failed, {o['output_tok_s']:.1f} output "
        f"tok/s, {o['prefill_tokens_computed']:,} prefill tokens computed of "
        f"{o['prompt_tokens']:,}, hit rate {hit}, {o['duration_s']:.1f} s"
    )
    lines.append(f"server counters over the run: {json.dumps(details['server_counters'])}")
    return lines + [f"first error: {e}" for e in o["errors"][:1]]
