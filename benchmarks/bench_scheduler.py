"""The scheduler's CPU time per decode step: schedule + KV allocation + update from the
step's tokens, for a batch of B running requests, with no device (the KV cache manager is
called in place, every request samples token 7). On the H200 a B1024 decode step of
qwen3-0.6b takes ~14.7 ms on the GPU (benchmarks/results/gpu_step/summary.json); two steps
in flight hide the scheduler only while it takes less than that.

    python benchmarks/bench_scheduler.py --batch-sizes 256 1024 --out sched.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.kv_cache_manager import KVCacheManager  # noqa: E402
from actors.kv_messages import AllocateStep, StepAllocation  # noqa: E402
from actors.messages import EngineRequest, SchedulerOutput, StepOutput, StepStats  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from actors.scheduler import Scheduler  # noqa: E402
from actors.scheduler_config import SchedulerConfig  # noqa: E402
from benchmarks.run_info import run_header  # noqa: E402

import numpy as np  # noqa: E402


class _InPlaceKV:
    """The KV cache actor's client, calling the manager in place (never suspends)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager

    async def allocate_step(self, msg: AllocateStep) -> StepAllocation:
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
    config = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=16384,
                             max_model_len=4096, block_size=16, max_steps_in_flight=1)
    scheduler = Scheduler(config, _InPlaceKV(KVCacheManager(num_blocks=batch_size * 64,
                                                            block_size=16)))
    for i in range(batch_size):
        scheduler.add_request(EngineRequest(
            f"r{i}", tuple(range(1, prompt_len + 1)),
            SamplingParams(max_tokens=num_steps + 64, ignore_eos=True), 0.0, eos_token_ids=(2,)))

    def step() -> int:
        out = _run(scheduler.schedule())
        scheduler.update_from_step(_answer(out))
        return out.num_reqs

    for _ in range(-(-batch_size * prompt_len // config.max_num_batched_tokens) + 1):
        step()  # the prefills, then the first decode step
    times_ms = []
    for _ in range(num_steps):
        started = time.perf_counter()
        step()
        times_ms.append((time.perf_counter() - started) * 1e3)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(8):
        step()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(8)
    return {"batch_size": batch_size, "num_steps": num_steps,
            "step_ms_p50": statistics.median(times_ms), "step_ms_mean": statistics.fmean(times_ms),
            "per_request_us": statistics.median(times_ms) * 1e3 / batch_size,
            "profile_top_tottime": text.getvalue().splitlines()[-12:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--num-steps", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = [measure(b, args.num_steps, args.prompt_len) for b in args.batch_sizes]
    for r in results:
        print(f"B{r['batch_size']:5d}: {r['step_ms_p50']:6.2f} ms per decode step "
              f"({r['per_request_us']:.1f} us per request)")
    if args.out is not None:
        header = run_header("python " + " ".join(sys.argv))
        args.out.write_text(json.dumps({**header, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
