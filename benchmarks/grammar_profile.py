"""Where a constrained decode step's time goes: in-process engine, one batch of JSON-schema
requests against the same batch free, with a stack sampler over every thread.

    python benchmarks/grammar_profile.py --model dummy:qwen3-0.6b --tokenizer .tok/qwen3 \\
        --num-requests 256 --out profile.json

Prints output tok/s for both arms and, per thread, the functions most often on top of the
stack (self) and anywhere on it (inclusive) during the constrained arm.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llguidance  # noqa: E402
import llguidance.numpy  # noqa: E402

from actors.core.grammar_state import MaskFiller  # noqa: E402
from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from actors.protocol.structured_output import StructuredOutputSpec  # noqa: E402
from app.llm import LLM  # noqa: E402
from benchmarks._mask_chain import MaskChain  # noqa: E402
from benchmarks.grammar_serve import THROUGHPUT_SCHEMA  # noqa: E402


class StackSampler:
    """Samples every thread's Python stack each `interval_s` (own thread excluded)."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.self_counts: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.incl_counts: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        names = {}
        while not self._stop.wait(self.interval_s):
            names.update({t.ident: t.name for t in threading.enumerate()})
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                name = names.get(ident, str(ident))
                self.self_counts[name][_where(frame)] += 1
                seen = set()
                while frame is not None:
                    seen.add(_where(frame))
                    frame = frame.f_back
                self.incl_counts[name].update(seen)
            self.num_samples += 1

    def report(self, top: int) -> dict:
        return {name: {"self": counts.most_common(top),
                       "focus": {w: n for w, n in self.incl_counts[name].items()
                                 if w.split(":")[1] in FOCUS}}
                for name, counts in self.self_counts.items()}


FOCUS = {"step_mask", "fill_bitmasks", "_bitmask", "update_from_step", "_apply_step",
         "schedule", "apply_grammar_bitmask", "_logits", "run_sample", "_sample_eagerly",
         "advance", "_complete_loop", "execute", "wait", "step", "ready_masks"}
"""Functions whose inclusive share is reported whole (time = count x interval)."""


def _where(frame) -> str:
    code = frame.f_code
    return f"{Path(code.co_filename).name}:{code.co_name}"


def _time_fills(executor: dict) -> tuple[list[float], list[int]]:
    """Time every batch mask fill of the engine (wraps GrammarCompiler.fill_bitmasks); the
    fill uses `executor["now"]` instead of the engine's own when one is set."""
    from actors.core.grammar import GrammarCompiler

    times_ms: list[float] = []
    num_rows: list[int] = []
    fill = GrammarCompiler.fill_bitmasks

    def timed(self, rows, bitmask):  # noqa: ANN001 - the wrapped method's own arguments
        started = time.perf_counter()
        if executor.get("now") is None:
            fill(self, rows, bitmask)
        else:
            llguidance.numpy.fill_next_token_bitmask_par(
                executor["now"], [(m._matcher, row) for m, row in rows], bitmask)
        times_ms.append((time.perf_counter() - started) * 1e3)
        num_rows.append(len(rows))

    GrammarCompiler.fill_bitmasks = timed
    return times_ms, num_rows


def _time_mask_waits() -> list[float]:
    """Time the runner thread's waits for deferred masks (wraps DeferredMasks.step_mask)."""
    from gpu.sampling.grammar_mask import DeferredMasks

    waits_ms: list[float] = []
    step_mask = DeferredMasks.step_mask

    def timed(self, sched):  # noqa: ANN001 - the wrapped method's own arguments
        started = time.perf_counter()
        mask = step_mask(self, sched)
        if sched.grammar_mask_deferred:
            waits_ms.append((time.perf_counter() - started) * 1e3)
        return mask

    DeferredMasks.step_mask = timed
    return waits_ms


TIMED = ("actors.core.scheduler_actor:SchedulerActor._apply_step",
         "actors.core.scheduler:Scheduler.update_from_step", "actors.core.scheduler:Scheduler.schedule",
         "actors.core.core_outputs:CoreOutputs.step", "gpu.runner_v2.runner:apply_grammar_bitmask",
         "gpu.runner_v2.runner:ModelRunnerV2.execute")
"""Functions timed per call in every arm (module:attribute; a function is patched in the
module that calls it)."""


def _time_calls(targets: tuple[str, ...]) -> dict[str, list[float]]:
    """Wraps each target to record its duration in ms per call (coroutines included)."""
    import importlib
    import inspect

    durations: dict[str, list[float]] = {target: [] for target in targets}
    for target in targets:
        module_name, _, path = target.partition(":")
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        original = getattr(owner, name)
        record = durations[target]
        if inspect.iscoroutinefunction(original):
            async def timed(*args, _original=original, _record=record, **kwargs):
                started = time.perf_counter()
                try:
                    return await _original(*args, **kwargs)
                finally:
                    _record.append((time.perf_counter() - started) * 1e3)
        else:
            def timed(*args, _original=original, _record=record, **kwargs):
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    _record.append((time.perf_counter() - started) * 1e3)
        setattr(owner, name, timed)
    return durations


def _arm_options(name: str) -> tuple[str, int | None, float | None, bool]:
    """(base arm, fill threads, switch interval in s, one torch thread) of an arm name:
    base[_t1][_f<threads>][_si<microseconds>][_nohand] (_nohand: the core thread does not
    wait for the filler to take a mask job, MaskFiller.wait_for_start)."""
    base, *suffixes = name.split("_")
    threads = switch_s = None
    for suffix in suffixes:
        if suffix.startswith("si"):
            switch_s = int(suffix[2:]) * 1e-6
        elif suffix.startswith("f"):
            threads = int(suffix[1:])
    return base, threads, switch_s, "t1" in suffixes


class _Timings:
    """Every per-call timing of the engine this profile records, taken and reset per run."""

    def __init__(self) -> None:
        self.executor: dict = {}
        self.fill_ms, self.fill_rows = _time_fills(self.executor)
        self.waits_ms = _time_mask_waits()
        self.call_ms = _time_calls(TIMED)
        self.chain = MaskChain.install()

    def take(self) -> tuple[dict, dict, dict]:
        """(mask fills, calls, mask chain) since the last take, then cleared."""
        fills = {"num_fills": len(self.fill_ms), "mean_ms": _mean(self.fill_ms),
                 "mean_rows": _mean(self.fill_rows), "mask_wait_ms_mean": _mean(self.waits_ms)}
        calls = {target.rpartition(":")[2]: {"num_calls": len(ms), "mean_ms": _mean(ms)}
                 for target, ms in self.call_ms.items()}
        chain = self.chain.summary()
        for timings in (self.fill_ms, self.fill_rows, self.waits_ms, *self.call_ms.values()):
            timings.clear()
        self.chain.clear()
        return fills, calls, chain


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:qwen3-0.6b")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--runs", nargs="+", default=["free", "json", "free", "json", "free_t1",
                                                      "json_t1", "free_t1", "json_t1"],
                        help="arms in order, base[_t1][_fN][_siUS][_nohand]: _t1 one torch "
                             "CPU thread, _fN N mask-fill threads, _siUS a GIL switch "
                             "interval, _nohand no handoff to the mask filler")
    parser.add_argument("--stack-arm", default="json",
                        help="the arm whose last run samples stacks (the others run clean)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def _print_run(name: str, record: dict) -> None:
    fills, calls, chain = record["mask_fills"], record["calls"], record["mask_chain_ms"]
    print(f"{name:8s} {record['output_tok_s']:10.1f} output tok/s ({record['elapsed_s']:.2f} s)"
          f" fills {fills['num_fills']} x {fills['mean_ms']:.2f} ms"
          f" ({fills['mean_rows']:.0f} rows), mask wait {fills['mask_wait_ms_mean']:.2f} ms"
          + (" (stacks sampled)" if record["stacks_sampled"] else ""))
    print("    " + ", ".join(f"{call} {c['num_calls']} x {c['mean_ms']:.2f}"
                             for call, c in calls.items()))
    if chain:
        print("    chain (median ms): " + "; ".join(f"{label} {v['median']}"
                                                 for label, v in chain.items()))


def _print_stacks(arm: str, stacks_by_thread: dict) -> None:
    for thread, stacks in stacks_by_thread.items():
        print(f"--- {arm} arm, thread {thread}")
        print("  self: " + "; ".join(f"{w} {n}" for w, n in stacks["self"]))
        print("  focus: " + "; ".join(f"{w} {n}" for w, n in sorted(
            stacks["focus"].items(), key=lambda item: -item[1])))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    llm = LLM(args.model, tokenizer=args.tokenizer, max_num_seqs=args.num_requests,
              max_num_batched_tokens=16384, max_model_len=2048)
    prompts = [f"List people as JSON, batch {i}." for i in range(args.num_requests)]
    spec = StructuredOutputSpec("json", json.dumps(THROUGHPUT_SCHEMA))
    arms = {"free": SamplingParams(temperature=1.0, seed=1, max_tokens=args.max_tokens,
                                   ignore_eos=True),
            "json": SamplingParams(temperature=1.0, seed=1, max_tokens=args.max_tokens,
                                   ignore_eos=True, structured_output=spec)}
    timings = _Timings()
    llm.generate(prompts[:8], arms["json"])  # warm-up: compile, graphs
    timings.take()
    result = {"num_requests": args.num_requests, "max_tokens": args.max_tokens, "arms": {}}
    import torch

    # Stacks are sampled in the last run of one arm only: the sampler takes the GIL every
    # half millisecond, so the other runs are the clean timings.
    plan = tuple(args.runs)
    default_switch_s = sys.getswitchinterval()
    default_torch_threads = torch.get_num_threads()
    for index, name in enumerate(plan):
        base, threads, switch_s, one_torch_thread = _arm_options(name)
        torch.set_num_threads(1 if one_torch_thread else default_torch_threads)
        sys.setswitchinterval(switch_s or default_switch_s)
        timings.executor["now"] = (None if threads is None
                                   else llguidance.LLExecutor(num_threads=threads))
        MaskFiller.wait_for_start = not name.endswith("_nohand")
        sampler = StackSampler()
        sampled = name == args.stack_arm and name not in plan[index + 1:]
        started = time.perf_counter()
        with sampler if sampled else contextlib.nullcontext():
            outputs = llm.generate(prompts, arms[base])
        elapsed_s = time.perf_counter() - started
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        if name.startswith("json"):
            print(f"  e.g. {outputs[0].outputs[0].text[:160]!r}")
        fills, calls, mask_chain = timings.take()
        record = {"output_tok_s": num_tokens / elapsed_s, "elapsed_s": elapsed_s,
                  "mask_chain_ms": mask_chain, "stacks": sampler.report(args.top),
                  "num_samples": sampler.num_samples, "stacks_sampled": sampled,
                  "mask_fills": fills, "calls": calls}
        result["arms"].setdefault(name, []).append(record)
        _print_run(name, record)
    args.out.write_text(json.dumps(result, indent=1))
    if args.stack_arm in plan:
        _print_stacks(args.stack_arm, result["arms"][args.stack_arm][-1]["stacks"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
