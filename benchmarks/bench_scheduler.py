"""The scheduler's CPU time per decode step: schedule (KV allocation included) + update from
the step's tokens, for a batch of B running requests, with no device (the KV cache manager
is called in place, every request samples token 7, structured outputs on as in the engine
but unused). On the H200 a B1024 decode step of qwen3-0.6b takes ~14.7 ms on the GPU
(benchmarks/results/gpu_step/summary.json), and the engine core's GPU launcher thread shares
the GIL with the scheduler: every millisecond here is taken from it.

    python benchmarks/bench_scheduler.py --batch-sizes 256 1024 --out sched.json
    python benchmarks/bench_scheduler.py --baseline ../main --rounds 3 --out sched.json

--baseline measures another checkout's scheduler with this same script, alternating the
two in fresh processes round after round (the machine is shared: compare medians).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _code_root(argv: list[str]) -> Path:
    """The checkout whose scheduler is measured (--code-root, else this one)."""
    if "--code-root" in argv:
        return Path(argv[argv.index("--code-root") + 1]).resolve()
    return ROOT


sys.path.insert(0, str(_code_root(sys.argv)))

from actors.grammar_state import GrammarState  # noqa: E402
from actors.kv_cache_manager import KVCacheManager  # noqa: E402
from actors.messages import EngineRequest, SchedulerOutput, StepOutput, StepStats  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from actors.scheduler import Scheduler  # noqa: E402
from actors.scheduler_config import SchedulerConfig  # noqa: E402

import numpy as np  # noqa: E402

VOCAB_SIZE = 151_936


class _InPlaceKV:
    """The KV cache actor's client, calling the manager in place (never suspends)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager

    async def allocate_step(self, msg: Any) -> Any:
        return self.manager.allocate_step(msg)

    async def free(self, request_ids: Iterable[str]) -> None:
        self.manager.free(request_ids)


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("the scheduler suspended")


def _answer(out: SchedulerOutput) -> StepOutput:
    ids = tuple(r for r, samples in zip(out.scheduled_request_ids, out.samples_token) if samples)
    return StepOutput(out.step_id, ids, np.full(len(ids), 7, dtype=np.int64), None,
                      StepStats(out.step_id, len(ids), len(ids), 0))


def measure(batch_size: int, num_steps: int, prompt_len: int) -> dict[str, Any]:
    """Per decode step: the schedule and update times (the device's stand-in excluded)."""
    config = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=16384,
                             max_model_len=4096, block_size=16, max_steps_in_flight=1)
    scheduler = Scheduler(config, _InPlaceKV(KVCacheManager(num_blocks=batch_size * 64,
                                                            block_size=16)),
                          GrammarState(VOCAB_SIZE, config.max_steps_in_flight))
    for i in range(batch_size):
        scheduler.add_request(EngineRequest(
            f"r{i}", tuple(range(1, prompt_len + 1)),
            SamplingParams(max_tokens=num_steps + 64, ignore_eos=True), 0.0, eos_token_ids=(2,)))

    def step() -> tuple[float, float]:
        started = time.perf_counter()
        out = _run(scheduler.schedule())
        scheduled = time.perf_counter()
        answer = _answer(out)
        answered = time.perf_counter()
        scheduler.update_from_step(answer)
        return scheduled - started, time.perf_counter() - answered

    for _ in range(-(-batch_size * prompt_len // config.max_num_batched_tokens) + 1):
        step()  # the prefills, then the first decode step
    schedule_ms, update_ms = [], []
    for _ in range(num_steps):
        schedule_s, update_s = step()
        schedule_ms.append(schedule_s * 1e3)
        update_ms.append(update_s * 1e3)
    step_ms = [a + b for a, b in zip(schedule_ms, update_ms)]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(8):
        step()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(8)
    return {"batch_size": batch_size, "num_steps": num_steps,
            "scheduler_file": sys.modules[Scheduler.__module__].__file__,
            "step_ms_p50": statistics.median(step_ms), "step_ms_mean": statistics.fmean(step_ms),
            "schedule_ms_p50": statistics.median(schedule_ms),
            "update_ms_p50": statistics.median(update_ms),
            "per_request_us": statistics.median(step_ms) * 1e3 / batch_size,
            "profile_top_tottime": text.getvalue().splitlines()[-12:]}


def _git_commit(root: Path) -> str | None:
    """HEAD of the checkout at `root`, plus '-dirty' when tracked files differ."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                  "--untracked-files=no"], check=True, capture_output=True,
                                 text=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if changed else "")


def _measure_in_child(code_root: Path, batch_size: int, args: argparse.Namespace
                      ) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", "--code-root", str(code_root),
               "--batch-sizes", str(batch_size), "--num-steps", str(args.num_steps),
               "--prompt-len", str(args.prompt_len)]
    return json.loads(subprocess.run(command, check=True, capture_output=True,
                                     text=True).stdout)[0]


def _compare(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both checkouts, alternating in fresh processes; medians over the rounds."""
    arms = {"before": args.baseline.resolve(), "after": _code_root(sys.argv)}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        arm: {b: [] for b in args.batch_sizes} for arm in arms}
    for _ in range(args.rounds):
        for batch_size in args.batch_sizes:
            for arm, root in arms.items():
                runs[arm][batch_size].append(_measure_in_child(root, batch_size, args))
    report = {}
    for arm, root in arms.items():
        results = []
        for batch_size, rounds in runs[arm].items():
            results.append({
                "batch_size": batch_size,
                **{f"{key}_median": statistics.median(r[key] for r in rounds)
                   for key in ("step_ms_p50", "schedule_ms_p50", "update_ms_p50")},
                "step_ms_p50_rounds": [r["step_ms_p50"] for r in rounds],
                "profile_top_tottime": rounds[-1]["profile_top_tottime"]})
        report[arm] = {"code_root": str(root), "commit": _git_commit(root),
                       "scheduler_file": runs[arm][args.batch_sizes[0]][0]["scheduler_file"],
                       "results": results}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--num-steps", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout to compare with (its scheduler, this script)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --baseline: alternations of the two checkouts")
    parser.add_argument("--code-root", type=Path, default=None,
                        help="the checkout to measure (default: this script's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps([measure(b, args.num_steps, args.prompt_len)
                          for b in args.batch_sizes]))
        return 0
    from benchmarks.run_info import run_header

    header = run_header("python " + " ".join(sys.argv))
    header["commit"] = _git_commit(_code_root(sys.argv))
    workload = {"prompt_len": args.prompt_len, "num_steps": args.num_steps, "block_size": 16,
                "max_steps_in_flight": 1, "tokens": "every request samples token 7",
                "grammars": "GrammarState present, no constrained request"}
    if args.baseline is not None:
        report = {**header, "workload": workload, **_compare(args)}
        for before, after in zip(report["before"]["results"], report["after"]["results"]):
            # Rounds are pairs run back to back: their ratios shrug off the machine's swings.
            after["speedup_per_round"] = [b / a for b, a in zip(
                before["step_ms_p50_rounds"], after["step_ms_p50_rounds"])]
            after["speedup_median"] = statistics.median(after["speedup_per_round"])
            print(f"B{after['batch_size']:5d}: {before['step_ms_p50_median']:6.2f} -> "
                  f"{after['step_ms_p50_median']:6.2f} ms per decode step (median of the "
                  f"rounds' speedups {after['speedup_median']:.2f}x)")
    else:
        results = [measure(b, args.num_steps, args.prompt_len) for b in args.batch_sizes]
        report = {**header, "workload": workload, "results": results}
        for r in results:
            print(f"B{r['batch_size']:5d}: {r['step_ms_p50']:6.2f} ms per decode step "
                  f"({r['per_request_us']:.1f} us per request; schedule "
                  f"{r['schedule_ms_p50']:.2f}, update {r['update_ms_p50']:.2f})")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
