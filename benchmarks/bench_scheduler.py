"""The scheduler's CPU time per decode step: schedule (KV allocation included) + update from
the step's tokens, for a batch of B running requests, with no device (the KV cache manager
is called in place, every request samples token 7, structured outputs on as in the engine
but unused). On the H200 a B1024 decode step of qwen3-0.6b takes ~14.7 ms on the GPU
(benchmarks/results/gpu_step/summary.json), and the engine core's GPU launcher thread shares
the GIL with the scheduler: every millisecond here is taken from it.

    python benchmarks/bench_scheduler.py --batch-sizes 256 1024 --out sched.json
    python benchmarks/bench_scheduler.py --baseline ../main --num-steps 400 --out sched.json

--baseline measures another checkout's scheduler with this same script: one process per
checkout, taking turns of a few steps, so both see the same swings of a shared machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
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

from actors.core.grammar_state import GrammarState  # noqa: E402
from actors.core.kv_cache_manager import KVCacheManager  # noqa: E402
from actors.protocol.messages import EngineRequest, SchedulerOutput, StepOutput, StepStats  # noqa: E402
from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from actors.core.scheduler import Scheduler  # noqa: E402
from actors.core.scheduler_config import SchedulerConfig  # noqa: E402

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


class DecodeLoop:
    """B running requests decoding, one step at a time (prefilled on construction)."""

    def __init__(self, batch_size: int, max_steps: int, prompt_len: int) -> None:
        config = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=16384,
                                 max_model_len=4096, block_size=16, max_steps_in_flight=1)
        self.scheduler = Scheduler(
            config, _InPlaceKV(KVCacheManager(num_blocks=batch_size * 64, block_size=16)),
            GrammarState(VOCAB_SIZE, config.max_steps_in_flight))
        for i in range(batch_size):
            self.scheduler.add_request(EngineRequest(
                f"r{i}", tuple(range(1, prompt_len + 1)),
                SamplingParams(max_tokens=max_steps + 64, ignore_eos=True), 0.0,
                eos_token_ids=(2,)))
        for _ in range(-(-batch_size * prompt_len // config.max_num_batched_tokens) + 1):
            self.step()  # the prefills, then the first decode step

    def step(self) -> tuple[float, float]:
        """One step's schedule and update times in ms (the device's stand-in excluded)."""
        started = time.perf_counter()
        out = _run(self.scheduler.schedule())
        scheduled = time.perf_counter()
        answer = _answer(out)
        answered = time.perf_counter()
        self.scheduler.update_from_step(answer)
        return (scheduled - started) * 1e3, (time.perf_counter() - answered) * 1e3

    def run(self, num_steps: int) -> list[tuple[float, float]]:
        return [self.step() for _ in range(num_steps)]

    def profile(self, num_steps: int = 8) -> list[str]:
        """cProfile's top functions by own time over `num_steps` steps."""
        profile = cProfile.Profile()
        profile.enable()
        self.run(num_steps)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(8)
        return text.getvalue().splitlines()[-12:]


def summarize(batch_size: int, times_ms: list[tuple[float, float]]) -> dict[str, Any]:
    step_ms = [schedule + update for schedule, update in times_ms]
    return {"batch_size": batch_size, "num_steps": len(times_ms),
            "step_ms_p50": statistics.median(step_ms), "step_ms_mean": statistics.fmean(step_ms),
            "schedule_ms_p50": statistics.median(schedule for schedule, _ in times_ms),
            "update_ms_p50": statistics.median(update for _, update in times_ms),
            "per_request_us": statistics.median(step_ms) * 1e3 / batch_size}


def measure(batch_size: int, num_steps: int, prompt_len: int) -> dict[str, Any]:
    loop = DecodeLoop(batch_size, num_steps + 8, prompt_len)
    return {**summarize(batch_size, loop.run(num_steps)),
            "profile_top_tottime": loop.profile()}


def _serve(args: argparse.Namespace) -> None:
    """Child of --baseline: run the steps asked on stdin (a count per line), answer each
    turn's times on stdout; 'profile' answers the profile and ends."""
    (batch_size,) = args.batch_sizes
    loop = DecodeLoop(batch_size, args.num_steps + 8, args.prompt_len)
    print(json.dumps(sys.modules[Scheduler.__module__].__file__), flush=True)
    for line in sys.stdin:
        if line.strip() == "profile":
            print(json.dumps(loop.profile()), flush=True)
            return
        print(json.dumps(loop.run(int(line))), flush=True)


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


class _Child:
    """A DecodeLoop over another process's checkout, stepped on request."""

    def __init__(self, code_root: Path, batch_size: int, args: argparse.Namespace) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--child", "--code-root", str(code_root),
             "--batch-sizes", str(batch_size), "--num-steps", str(args.num_steps),
             "--prompt-len", str(args.prompt_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.scheduler_file = self._read()

    def ask(self, line: str) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> Any:
        assert self.process.stdout is not None
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the benchmark child exited with {self.process.wait()}")
        return json.loads(answer)

    def close(self) -> list[str]:
        profile = self.ask("profile")
        self.process.wait()
        return profile


def _compare(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both checkouts in two live processes taking turns of --turn-steps steps (the
    machine's speed swings within seconds, so a turn is short), the first to go alternating
    from turn to turn."""
    arms = {"before": args.baseline.resolve(), "after": _code_root(sys.argv)}
    report: dict[str, dict[str, Any]] = {
        arm: {"code_root": str(root), "commit": _git_commit(root), "results": []}
        for arm, root in arms.items()}
    for repeat, batch_size in itertools.product(range(args.repeats), args.batch_sizes):
        children = {arm: _Child(root, batch_size, args) for arm, root in arms.items()}
        times: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
        turn_ratios = []
        for turn in range(-(-args.num_steps // args.turn_steps)):
            order = list(arms) if turn % 2 == 0 else list(reversed(arms))
            turn_ms = {arm: children[arm].ask(str(args.turn_steps)) for arm in order}
            for arm in arms:
                times[arm] += [tuple(t) for t in turn_ms[arm]]
            turn_ratios.append(statistics.median(a + b for a, b in turn_ms["before"])
                               / statistics.median(a + b for a, b in turn_ms["after"]))
        for arm, child in children.items():
            report[arm]["scheduler_file"] = child.scheduler_file
            report[arm]["results"].append({"repeat": repeat, **summarize(batch_size, times[arm]),
                                           "profile_top_tottime": child.close()})
        after = report["after"]["results"][-1]
        after["speedup"] = report["before"]["results"][-1]["step_ms_p50"] / after["step_ms_p50"]
        after["speedup_per_turn"] = turn_ratios
        after["speedup_per_turn_median"] = statistics.median(turn_ratios)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--num-steps", type=int, default=40,
                        help="decode steps measured (per checkout with --baseline)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout to compare with (its scheduler, this script)")
    parser.add_argument("--turn-steps", type=int, default=4,
                        help="with --baseline: steps per turn of each checkout")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --baseline: comparisons per batch size, fresh processes each")
    parser.add_argument("--code-root", type=Path, default=None,
                        help="the checkout to measure (default: this script's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.child:
        _serve(args)
        return 0
    from benchmarks.run_info import run_header

    header = run_header("python " + " ".join(sys.argv))
    header["commit"] = _git_commit(_code_root(sys.argv))
    workload = {"prompt_len": args.prompt_len, "num_steps": args.num_steps, "block_size": 16,
                "max_steps_in_flight": 1, "tokens": "every request samples token 7",
                "grammars": "GrammarState present, no constrained request"}
    if args.baseline is not None:
        workload.update(turn_steps=args.turn_steps, repeats=args.repeats)
    if args.baseline is not None:
        report = {**header, "workload": workload, **_compare(args)}
        for before, after in zip(report["before"]["results"], report["after"]["results"]):
            print(f"B{after['batch_size']:5d}: {before['step_ms_p50']:6.2f} -> "
                  f"{after['step_ms_p50']:6.2f} ms per decode step ({after['speedup']:.2f}x; "
                  f"median of the turns' {after['speedup_per_turn_median']:.2f}x)")
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
