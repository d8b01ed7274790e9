"""What the results say: each result's current figures beside the last earlier entry of its
history that ran the same workload on the same hardware, with the change in percent, and
the dates and commits of the entries before.

    python -m benchmarks.report                      # every result in benchmarks/results
    python -m benchmarks.report throughput_w1 serve_chat --history 10
    python -m benchmarks.report --results-dir $OUT   # what came back from the GPU machine
    python -m benchmarks.report --results-dir $OUT --against $OUT/base   # an A/B call
    python -m benchmarks.report --floors             # the H200's floors under W1-W3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.recording import RESULTS_DIR, load_result
from benchmarks.workloads import WORKLOADS, floors


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("results", nargs="*", metavar="RESULT", help="result names (default: all)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--history", type=int, default=5, help="earlier entries listed (default 5)")
    p.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="compare with the current entries of the same results in DIR (the "
        "baseline of device_run.sh's A/B) instead of each result's history",
    )
    p.add_argument(
        "--floors",
        action="store_true",
        help="print the bandwidth and compute floors of the GPU workloads instead",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.floors:
        print(floors_table())
        return 0
    names = args.results or sorted(p.stem for p in args.results_dir.glob("*.json"))
    missing = [n for n in names if not (args.results_dir / f"{n}.json").is_file()]
    if missing:
        print(f"no such result in {args.results_dir}: {', '.join(missing)}", file=sys.stderr)
        return 2
    for name in names:
        result = load_result(args.results_dir / f"{name}.json") or {}
        if not result.get("current"):
            print(f"== {name}: not a result file (no current entry)")
            continue
        baseline = None
        if args.against is not None:
            against = load_result(args.against / f"{name}.json")
            baseline = against["current"] if against else None
        print(describe(result, args.history, baseline))
    return 0


def describe(
    result: dict[str, Any], num_history: int, baseline: dict[str, Any] | None = None
) -> str:
    """The result's current figures beside `baseline`'s, or beside those of the last
    comparable entry of its history."""
    current = result["current"]
    history = result["history"]
    previous = baseline if baseline is not None else comparable(current, history)
    lines = [
        f"== {result['result']} ({result['benchmark']}): {_entry_line(current)}",
        f"   {current['command']}",
    ]
    width = max((len(k) for k in current["figures"]), default=0)
    for key, value in current["figures"].items():
        line = f"   {key:<{width}}  {_value(value):>12}"
        if previous is not None and key in previous["figures"]:
            before = previous["figures"][key]
            line += f"  was {_value(before):>12}{_change(value, before)}"
        lines.append(line)
    if previous is not None:
        lines.append(f"   (was: {_entry_line(previous)})")
    for entry in history[::-1][:num_history]:
        lines.append(f"   history: {_entry_line(entry)}")
    return "\n".join(lines)


def comparable(entry: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest earlier entry with the same workload on the same kind of hardware."""
    for earlier in reversed(history):
        if same_run(earlier, entry):
            return earlier
    return None


def same_run(entry: dict[str, Any], other: dict[str, Any]) -> bool:
    """The same workload on the same kind of hardware."""
    return (entry.get("workload"), hardware_kind(entry)) == (
        other.get("workload"),
        hardware_kind(other),
    )


def hardware_kind(entry: dict[str, Any]) -> str:
    """The entry's GPUs by name, or its CPU."""
    hardware = entry.get("hardware")
    if isinstance(hardware, dict):
        return ", ".join(hardware.get("gpus") or []) or f"cpu: {hardware.get('cpu')}"
    return str(hardware)


def _entry_line(entry: dict[str, Any]) -> str:
    commit = str(entry.get("commit") or "no commit")[:12]
    unclean = "" if entry.get("clean") else " (uncommitted changes)"
    return f"{entry.get('date', '?')} {commit}{unclean} on {hardware_kind(entry)}"


def _value(value: Any) -> str:
    return (
        f"{value:,.6g}"
        if isinstance(value, int | float) and not isinstance(value, bool)
        else str(value)
    )


def _change(value: Any, before: Any) -> str:
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (value, before))
    if not numbers or not before:
        return ""
    return f"  {100 * (value - before) / abs(before):+.1f}%"


def floors_table() -> str:
    from gpu.models.presets import PRESETS

    lines = [
        "workload | bandwidth floor (weights + KV per step) | compute floor | ideal output tok/s"
    ]
    for workload in (w for w in WORKLOADS.values() if w.device == "cuda"):
        figures = floors(PRESETS[workload.model.removeprefix("dummy:")], workload)
        lines.append(
            f"{workload.name} {workload.model} {workload.num_prompts} x "
            f"{workload.input_len}/{workload.output_len} | {figures['ideal_s']:.2f} s | "
            f"{figures['compute_floor_s']:.2f} s | "
            f"{figures['roofline_output_tok_s']:,.0f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
