"""Kernel-by-kernel breakdown of profiled steps, from a torch.profiler chrome trace.

Each profiled step runs inside `torch.profiler.record_function(f"{prefix}{i}")` and is
synchronised before the next one starts. A device activity (kernel, memcpy, memset)
belongs to the step whose CPU range holds the host call that launched it (matched by the
trace's correlation ids; a CUDA graph's kernels carry the correlation of the graph
launch). Per step: the sum of activity durations, the span from the first start to the
last end, and the idle gaps inside that span.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver", "runtime", "driver")

# First match wins; names are lower-cased before matching.
KERNEL_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("memcpy", r"memcpy|memset"),
    ("attention", r"paged_attention|merge_splits|flash|fmha|sdpa|attention|efficient_attention"),
    ("gemm", r"gemm|gemv|sm90_xmma|cutlass|cublas|nvjet|matmul|splitk"),
    ("sampling", r"gumbel|best_block|threshold|top_k|topk|top_p|min_p|temperature|penalt|logit_bias|sort|radix|softmax|argmax|cumsum|scan"),
    ("input_prep", r"prepare_inputs|slot_mapping|gather_block|post_update|staged_write|apply_write"),
    ("kv_write", r"kv_write"),
    ("fused_norm_rope", r"rms_norm|rope|prologue|silu_mul"),
    ("norm_elementwise", r"elementwise|vectorized|reduce|norm|pow|rsqrt|mean|cat|copy|index|embedding|silu|mul|add|unrolled"),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return "other"


@dataclass(frozen=True, slots=True)
class DeviceActivity:
    name: str
    start_us: float
    duration_us: float
    correlation: int | None


def load_trace(path: Path) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def step_activities(events: list[dict[str, Any]], prefix: str) -> list[list[DeviceActivity]]:
    """Device activities grouped by profiled step (steps in order of their index)."""
    ranges = sorted(
        (int(e["name"][len(prefix):]), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith(prefix)
        and e.get("cat") in ("user_annotation", "cpu_op", "python_function")
        and e["name"][len(prefix):].isdigit())
    launch_ts: dict[int, float] = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launch_ts[int(e["args"]["correlation"])] = float(e["ts"])
    steps: list[list[DeviceActivity]] = [[] for _ in ranges]
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATEGORIES:
            continue
        correlation = e.get("args", {}).get("correlation")
        activity = DeviceActivity(str(e.get("name", "?")), float(e["ts"]), float(e.get("dur", 0)),
                                  None if correlation is None else int(correlation))
        host_ts = launch_ts.get(activity.correlation) if activity.correlation is not None else None
        for index, (_, start, end) in enumerate(ranges):
            if host_ts is not None and start <= host_ts <= end:
                steps[index].append(activity)
                break
    return [sorted(step, key=lambda a: a.start_us) for step in steps]


def step_summary(activities: list[DeviceActivity]) -> dict[str, float]:
    """Sum of durations, first-start-to-last-end span, and idle time inside the span
    (the union of activity intervals subtracted from the span)."""
    if not activities:
        return {"num_activities": 0, "sum_us": 0.0, "span_us": 0.0, "busy_us": 0.0, "gaps_us": 0.0}
    busy = 0.0
    current_start, current_end = activities[0].start_us, activities[0].start_us
    for a in activities:
        end = a.start_us + a.duration_us
        if a.start_us > current_end:
            busy += current_end - current_start
            current_start = a.start_us
        current_end = max(current_end, end)
    busy += current_end - current_start
    span = max(a.start_us + a.duration_us for a in activities) - activities[0].start_us
    return {"num_activities": len(activities), "sum_us": sum(a.duration_us for a in activities),
            "span_us": span, "busy_us": busy, "gaps_us": max(span - busy, 0.0)}


def breakdown(steps: list[list[DeviceActivity]]) -> dict[str, Any]:
    """Per kernel name and per category: launches and microseconds per step, share of the
    summed device time; plus the step summaries and their mean."""
    num_steps = max(len(steps), 1)
    per_name: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0.0, "total_us": 0.0})
    for step in steps:
        for a in step:
            entry = per_name[a.name]
            entry["count"] += 1 / num_steps
            entry["total_us"] += a.duration_us / num_steps
    total = sum(e["total_us"] for e in per_name.values()) or 1.0
    kernels = sorted(({"name": name[:160], "category": kernel_category(name),
                       "count": round(e["count"], 2), "total_us": round(e["total_us"], 2),
                       "share": round(e["total_us"] / total, 4)}
                      for name, e in per_name.items()), key=lambda k: -k["total_us"])
    categories: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0.0, "total_us": 0.0})
    for k in kernels:
        categories[k["category"]]["count"] += k["count"]
        categories[k["category"]]["total_us"] += k["total_us"]
    summaries = [step_summary(step) for step in steps]
    mean = {key: round(sum(s[key] for s in summaries) / num_steps, 2) for key in summaries[0]} \
        if summaries else {}
    return {
        "steps": summaries, "mean_step": mean, "kernels": kernels,
        "categories": {c: {"count": round(v["count"], 2), "total_us": round(v["total_us"], 2),
                           "share": round(v["total_us"] / total, 4)}
                       for c, v in sorted(categories.items(), key=lambda kv: -kv[1]["total_us"])},
    }
