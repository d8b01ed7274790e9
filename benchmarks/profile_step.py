"""Where a decode step's time goes on a CUDA GPU: the real V2 runner (dummy qwen3-0.6b, bf16,
CUDA graphs on) profiled kernel by kernel, next to the floor (_step_floor.py: stock torch
kernels, dense KV, one CUDA graph) measured in the same run.

Cases (context = sequence length of the decode step):
  b1     1 request at context 640, W1 sampling (temperature 1, top_p 1)
  b1tp   1 request at context 640, temperature 0.7, top_p 0.9 (an SDK-default chat)
  b8     8 requests at context 640
  b256   256 requests at context 384
  mix256 256 decodes at context 384 plus one 128-token prefill (a serving-shaped step)
  b1024  1024 requests at context 384 (a W1 decode step)
For each: the steady-state step period with two steps in flight (as the GPU actor runs),
the runner's own device time per step (events at its first and last launch) and CPU
launch time; then a few steps under torch.profiler, each synchronised: device time per
kernel name and category, and the gaps between kernels inside a step (span - busy).

Every phase runs in a child process with its own time limit, so one failure or hang
leaves the others' results; the JSON is rewritten after each phase.

    python benchmarks/profile_step.py --out $OUT/profile_step.json \
        [--code-root DIR:LABEL[:CASES] ...] [--cases b1,b8,b1024] [--no-floor] [--deadline-s 320]

`--code-root ..:main:b1,b1024` profiles another checkout's tandem (the runner's API is the
same) on those cases: an A/B of the same script over two trees. Phases run in the order
given (the first --code-root, the floor, the other roots) within --deadline-s overall;
a phase or case that would start too late is skipped and the tables are printed anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _device_record import run_record, write_json  # noqa: E402

MODEL = "dummy:qwen3-0.6b"
ENGINE: dict[str, Any] = dict(dtype="bfloat16", max_num_seqs=1024, max_num_batched_tokens=16384,
                              gpu_memory_utilization=0.8, max_model_len=2048)
CASES: dict[str, dict[str, Any]] = {
    "b1": dict(num_reqs=1, context=640),
    "b1tp": dict(num_reqs=1, context=640, temperature=0.7, top_p=0.9),
    "b8": dict(num_reqs=8, context=640),
    "b256": dict(num_reqs=256, context=384),
    "mix256": dict(num_reqs=256, context=384, prefill_tokens=128),
    "b1024": dict(num_reqs=1024, context=384),
}
if os.environ.get("TANDEM_PROFILE_DRY_RUN") == "1":  # the script's own check, on a CPU
    MODEL = "dummy:smollm2-135m"
    ENGINE = dict(dtype="float32", device="cpu", max_num_seqs=16, max_num_batched_tokens=256,
                  max_model_len=256, num_kv_blocks=512)
    CASES = {name: {**case, "num_reqs": min(case["num_reqs"], 8), "context": 40}
             for name, case in CASES.items()}
FLOOR_SHAPES = {"b1": (1, 640), "b8": (8, 640), "b256": (256, 384), "b1024": (1024, 384)}
PROFILED_FLOOR = ("b1", "b1024")
NUM_STEADY_STEPS = 40
NUM_PROFILED_STEPS = 4
STEP_PREFIX = "tandem_step_"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "profile_step.json")
    parser.add_argument("--code-root", action="append", default=None,
                        help="DIR:LABEL of a tandem checkout to profile (repeatable; default .:branch)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument("--deadline-s", type=float, default=320.0,
                        help="seconds for the whole run; later phases get what is left")
    parser.add_argument("--child", choices=("floor", "runner"), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-root", help=argparse.SUPPRESS)
    parser.add_argument("--child-deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "floor":
        return _child_floor(args.child_out)
    if args.child == "runner":
        return _child_runner(Path(args.child_root), args.cases.split(","), args.child_out,
                             args.child_deadline)
    return _orchestrate(args)


# ---- orchestration ----------------------------------------------------------------------

def _parse_root(spec: str, default_cases: str) -> tuple[str, str, str]:
    parts = spec.split(":")
    root = parts[0]
    label = parts[1] if len(parts) > 1 and parts[1] else Path(root).resolve().name
    return root, label, parts[2] if len(parts) > 2 and parts[2] else default_cases


def _orchestrate(args: argparse.Namespace) -> int:
    deadline = time.time() + args.deadline_s
    roots = [_parse_root(spec, args.cases) for spec in (args.code_root or [".:branch"])]
    record = run_record("profile_step", {
        "model": MODEL, "engine": ENGINE, "cases": {c: CASES[c] for c in args.cases.split(",")},
        "steady_steps": NUM_STEADY_STEPS, "profiled_steps": NUM_PROFILED_STEPS,
        "code_roots": {label: {"dir": str(Path(root).resolve()), "cases": cases}
                       for root, label, cases in roots}})
    record["floor"], record["runner"] = {}, {}
    phases = [(label, ["--child", "runner", "--child-root", root, "--cases", cases])
              for root, label, cases in roots]
    if not args.no_floor:
        phases.insert(1, ("floor", ["--child", "floor"]))
    for label, child_args in phases:
        left = deadline - time.time()
        print(f"=== {label} ({time.strftime('%H:%M:%S')}, {left:.0f} s left)", flush=True)
        if left < 30:
            skipped = {"status": "skipped: no time left"}
            if label == "floor":
                record["floor"] = skipped
            else:
                record["runner"][label] = skipped
            continue
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            child_out = Path(handle.name)
        command = [sys.executable, str(Path(__file__).resolve()), *child_args, "--child-out",
                   str(child_out), "--child-deadline", str(deadline - 5)]
        try:
            completed = subprocess.run(command, timeout=left - 5, check=False)
            status = f"exit {completed.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {left - 5:.0f} s"
        result = json.loads(child_out.read_text()) if child_out.stat().st_size else {}
        result["status"] = status
        if label == "floor":
            record["floor"] = result
        else:
            record["runner"][label] = result
        write_json(args.out, record)
        print(f"--- {label}: {status}", flush=True)
    print_tables(record)
    print(f"wrote {args.out}")
    return 0


# ---- the floor ---------------------------------------------------------------------------

def _child_floor(out: Path) -> int:
    from _step_floor import floor_step_graph, roofline_ms, time_replays

    result: dict[str, Any] = {}
    for name, (batch, context) in FLOOR_SHAPES.items():
        replay, release = floor_step_graph(batch, context)
        entry = {"batch": batch, "context": context, "step_ms": round(time_replays(replay), 4),
                 "roofline_ms": round(roofline_ms(batch, context), 4)}
        if name in PROFILED_FLOOR:
            entry["profile"] = _profile(lambda i: replay())
        release()
        result[name] = entry
        print(f"floor {name}: {entry['step_ms']:.3f} ms (roofline {entry['roofline_ms']:.3f})", flush=True)
        write_json(out, result)
    return 0


# ---- the runner --------------------------------------------------------------------------

def _child_runner(root: Path, cases: list[str], out: Path, deadline: float | None) -> int:
    sys.path.insert(0, str(root.resolve()))
    from _runner_driver import RunnerDriver

    started = time.perf_counter()
    driver = RunnerDriver(MODEL, ENGINE)
    result: dict[str, Any] = {"load_s": round(time.perf_counter() - started, 2),
                              "tandem_from": driver.source_dir, "cases": {}}
    write_json(out, result)
    for name in cases:
        case = CASES[name]
        if deadline is not None and time.time() > deadline - 25:
            result["cases"][name] = {"error": "skipped: no time left"}
            continue
        try:
            result["cases"][name] = _runner_case(driver, case)
        except Exception as exc:  # noqa: BLE001 - report, go on with the next case
            result["cases"][name] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        summary = result["cases"][name]
        print(f"{name}: " + json.dumps({k: v for k, v in summary.items() if k != "profile"})[:400], flush=True)
        write_json(out, result)
    return 0


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _runner_case(driver: Any, case: dict[str, Any]) -> dict[str, Any]:
    batch = driver.start_batch(case["num_reqs"], case["context"], case.get("temperature", 1.0),
                               case.get("top_p", 1.0))
    prefill_tokens = case.get("prefill_tokens", 0)
    for _ in range(3):
        driver.step(batch, prefill_tokens).result()
    steady = driver.steady_state(batch, NUM_STEADY_STEPS, prefill_tokens)
    profile = _profile(lambda i: driver.step(batch, prefill_tokens).result())
    driver.finish_batch(batch)
    _sync()
    return {**steady, "profile": profile}


def _profile(run_step) -> dict[str, Any]:
    """Profile NUM_PROFILED_STEPS calls of run_step(i), each synchronised."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from _kernel_trace import breakdown, load_trace, step_activities

    _sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for i in range(NUM_PROFILED_STEPS):
            with record_function(f"{STEP_PREFIX}{i}"):
                run_step(i)
                _sync()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        trace_path = Path(handle.name)
    prof.export_chrome_trace(str(trace_path))
    steps = step_activities(load_trace(trace_path), STEP_PREFIX)
    trace_path.unlink(missing_ok=True)
    return breakdown(steps[1:] if len(steps) > 1 else steps)  # the first may carry lazy setup


# ---- printing ------------------------------------------------------------------------------

def print_tables(record: dict[str, Any]) -> None:
    floor = record.get("floor", {})
    print("\nstep times (ms): period = steady state with 2 steps in flight; device = runner's "
          "first-to-last launch events; kernels = profiled kernel sum; gaps = idle inside a step")
    print(f"{'case':8} {'tree':8} {'period':>7} {'device':>7} {'cpu':>6} {'kernels':>8} {'span':>7} "
          f"{'gaps':>6} {'launches':>8} {'floor':>6}")
    for label, runner in record.get("runner", {}).items():
        for name, case in runner.get("cases", {}).items():
            if "error" in case:
                print(f"{name:8} {label:8} ERROR {case['error'][:100]}")
                continue
            mean = case["profile"]["mean_step"]
            floor_ms = floor.get(name, {}).get("step_ms")
            print(f"{name:8} {label:8} {case['period_ms']:7.3f} {case['device_ms']:7.3f} "
                  f"{case['cpu_launch_ms']:6.3f} {mean['sum_us'] / 1e3:8.3f} {mean['span_us'] / 1e3:7.3f} "
                  f"{mean['gaps_us'] / 1e3:6.3f} {mean['num_activities']:8.0f} "
                  f"{'' if floor_ms is None else f'{floor_ms:6.3f}'}")
    for name in ("b1", "b1024"):
        _print_categories(record, name)


def _print_categories(record: dict[str, Any], name: str) -> None:
    columns: dict[str, dict[str, Any]] = {}
    for label, runner in record.get("runner", {}).items():
        case = runner.get("cases", {}).get(name, {})
        if "profile" in case:
            columns[label] = case["profile"]["categories"]
    floor_profile = record.get("floor", {}).get(name, {}).get("profile")
    if floor_profile:
        columns["floor"] = floor_profile["categories"]
    if not columns:
        return
    categories = sorted({c for cats in columns.values() for c in cats},
                        key=lambda c: -max(cats.get(c, {}).get("total_us", 0) for cats in columns.values()))
    print(f"\n{name}: us per step (launches) by kernel category")
    print(f"{'category':18}" + "".join(f"{label:>18}" for label in columns))
    for category in categories:
        cells = []
        for cats in columns.values():
            entry = cats.get(category)
            cells.append(f"{entry['total_us']:10.1f} ({entry['count']:4.0f})" if entry else f"{'-':>17}")
        print(f"{category:18}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
