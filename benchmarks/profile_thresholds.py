"""Where the sampling-threshold search spends its time on a CUDA device: each kernel's
device time per call (torch.profiler) and per launch within a call (round by round), for
the filter cases of benchmarks/_threshold_ab.py at 256 x 151,936 float32 logits, plus the
whole call's time replayed as a CUDA graph.

    python3 benchmarks/profile_thresholds.py --out $OUT/threshold_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels.sampling_thresholds as thresholds  # noqa: E402
from benchmarks._threshold_ab import CASES, _filters, graph_us, make_logits  # noqa: E402


def kernel_table(call, num_calls: int) -> tuple[dict[str, dict[str, float]], dict[str, list[float]]]:
    """Per kernel name: launches and device microseconds per call of `call`; and per kernel
    name, the microseconds of its i-th launch within a call (the rounds one by one: a
    round whose rows are all done exits at once, a working one makes a full pass)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_calls):
            call()
        torch.cuda.synchronize()
    table: dict[str, dict[str, float]] = defaultdict(lambda: {"launches": 0.0, "us": 0.0})
    launches: dict[str, list[float]] = defaultdict(list)
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    for event in kernels:
        name = event.name[:60]
        table[name]["launches"] += 1 / num_calls
        table[name]["us"] += event.device_time_total / num_calls
        launches[name].append(event.device_time_total)
    by_launch = {}
    for name, times in launches.items():
        per_call = len(times) // num_calls
        by_launch[name] = [round(sum(times[i::per_call]) / num_calls, 1) for i in range(per_call)]
    return dict(sorted(table.items(), key=lambda item: -item[1]["us"])), by_launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    results = {}
    for kind in ("randn3", "peaked"):
        logits = make_logits(kind, args.rows, args.vocab)
        for name, case in CASES.items():
            filters = _filters(case, args.rows)  # idx_mapping, then the request filters

            def call():
                return thresholds.sampling_thresholds(logits, *filters)
            for _ in range(3):
                call()
            table, by_launch = kernel_table(call, 10)
            results[f"{kind}/{name}"] = {"graph_us": graph_us(thresholds, logits, case),
                                         "kernels": table,
                                         "us_by_launch": by_launch}
            print(f"{kind:7s} {name:12s} graph {results[f'{kind}/{name}']['graph_us']:7.1f} us")
            for kernel, row in list(table.items())[:8]:
                print(f"    {row['us']:8.1f} us  x{row['launches']:4.1f}  {kernel}  "
                      f"{by_launch[kernel] if len(by_launch[kernel]) > 1 else ''}")
    args.out.write_text(json.dumps({"rows": args.rows, "vocab": args.vocab,
                                    "device": torch.cuda.get_device_name(),
                                    "cases": results}, indent=1))


if __name__ == "__main__":
    main()
