"""Where the sampling-threshold search spends its time on a CUDA device: each kernel's
device time per call (torch.profiler) and per launch within a call (round by round), for
the filter cases of benchmarks/_threshold_ab.py at 256 x 151,936 float32 logits; the
whole call's time replayed as a CUDA graph, for the round launches as shipped and in the
other shapes of ARMS (interleaved); and the round kernel's registers and spills.

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
from benchmarks._threshold_ab import CASES, _filters, graph_us, make_logits, median  # noqa: E402


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


_HISTOGRAMS, _COPIES, _PIVOTS = (False, True, False), (False, False, True), (True, False, False)
ARMS = {  # name: ROUND_LAUNCHES
    "shipped": thresholds.ROUND_LAUNCHES,
    "with_pivot_launch": (_HISTOGRAMS, _COPIES, _PIVOTS),
    "merged": ((True, True, True),),
}
"""The round launches as the kernels ship them, with a launch for pivot passes too, and as
one launch running every kind of pass (merged): the same search in other launch shapes.
(Larger histogram blocks, 1024 and 2048 tokens, and 8 warps were slower:
results/gpu_step/threshold_rounds_blocks.json, threshold_rounds_split3.json.)"""


def set_arm(name: str) -> None:
    thresholds.ROUND_LAUNCHES = ARMS[name]


def compiled_registers() -> list[dict[str, object]]:
    """Registers and spills of every compiled variant of the round kernel."""
    variants = []
    for cache in getattr(thresholds._round_kernel, "device_caches", {}).values():
        for key, kernel in cache[0].items():
            variants.append({"key": str(key)[-120:], "num_regs": getattr(kernel, "n_regs", None),
                             "num_spills": getattr(kernel, "n_spills", None),
                             "num_warps": kernel.metadata.num_warps})
    return variants


def profile_case(logits: torch.Tensor, case: tuple, repeats: int) -> dict[str, object]:
    """Per arm, graph replay times interleaved `repeats` times (checked against the shipped
    arm's thresholds); the kernel table of the shipped arm."""
    filters = _filters(case, logits.shape[0])  # idx_mapping, then the request filters

    def call():
        return thresholds.sampling_thresholds(logits, *filters)

    set_arm("shipped")
    expected = call()
    entry: dict[str, object] = {f"{arm}_graph_us": [] for arm in ARMS}
    for arm in ARMS:
        set_arm(arm)
        entry[f"{arm}_equal"] = bool(torch.equal(call(), expected))
    for _ in range(repeats):
        for arm in ARMS:
            set_arm(arm)
            entry[f"{arm}_graph_us"].append(graph_us(thresholds, logits, case))
    set_arm("shipped")
    for _ in range(3):
        call()
    entry["kernels"], entry["us_by_launch"] = kernel_table(call, 10)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = {}
    for kind in ("randn3", "peaked"):
        logits = make_logits(kind, args.rows, args.vocab)
        for name, case in CASES.items():
            entry = results[f"{kind}/{name}"] = profile_case(logits, case, args.repeats)
            print(f"{kind:7s} {name:12s} " + "  ".join(
                f"{arm} {median(entry[f'{arm}_graph_us']):7.1f} us"
                f"{'' if entry[f'{arm}_equal'] else ' (DIFFERS)'}" for arm in ARMS))
            table, by_launch = entry["kernels"], entry["us_by_launch"]
            for kernel, row in list(table.items())[:8]:
                print(f"    {row['us']:8.1f} us  x{row['launches']:4.1f}  {kernel}  "
                      f"{by_launch[kernel] if len(by_launch[kernel]) > 1 else ''}")
    registers = compiled_registers()
    for variant in registers:
        print("round kernel", variant)
    args.out.write_text(json.dumps({"rows": args.rows, "vocab": args.vocab,
                                    "device": torch.cuda.get_device_name(), "arms": list(ARMS),
                                    "round_kernel_variants": registers, "cases": results},
                                   indent=1))


if __name__ == "__main__":
    main()
