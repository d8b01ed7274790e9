"""ngram speculative decoding: acceptance and TPOT with and without it, at concurrency 1
and 32, through the offline engine (tandem's LLM).

    # CPU, the embedded model, copy-heavy prompts (summarise / edit a given text):
    python -m benchmarks.bench_spec --output benchmarks/results/spec_cpu.json
    # H200, random weights (drafts almost never accepted: the cost of speculating):
    python -m benchmarks.bench_spec --model dummy:qwen3-0.6b --device cuda --output $OUT/spec.json

Correctness first: for every concurrency, greedy outputs with speculation must equal those
without, token for token, or the run stops (exit 1). Then arms run interleaved (off on
off on ... ABBA per repeat). --eager-tail-arm adds a third arm, speculation with the
step's tail launched eagerly instead of replayed as CUDA graphs (the A/B of
gpu/spec_decode/spec_graphs.py; the same without graphs, as on CPU). TPOT is the batch's decode time per output token:
(time for N tokens - time for 1 token) / (N - 1), every request decoding exactly N tokens
(ignore_eos), as benchmarks/cpu_offline.py measures decode speed. Acceptance comes from
the steps' SpecDecodeStats: rate = accepted / draft tokens, mean acceptance length =
1 + accepted / drafts (vLLM's definitions).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.run_info import command_line, load_average, run_header

TEXTS = (
    "The committee met on Tuesday to review the budget for the coming year. It agreed to "
    "fund the new library wing, the renovation of the park on Elm Street and six new bus "
    "shelters, and asked the treasurer to report back in March with the final costs.",
    "Our store opens at nine in the morning and closes at six in the evening from Monday to "
    "Friday. On Saturdays we open at ten and close at four. We are closed on Sundays and on "
    "public holidays. Returns are accepted within thirty days with a receipt.",
    "To reset your password, open the settings page, choose the account tab and click the "
    "reset button. You will receive an email with a link that is valid for one hour. Follow "
    "the link, type a new password twice and save it.",
    "The river rises in the northern hills, flows south through three small towns and "
    "reaches the sea near the old harbour. In spring the water is high and fast; in late "
    "summer it is slow and shallow enough to cross on foot near the mill.",
)
TASKS = ("Repeat the following text exactly, word for word:\n\n{text}",
         "Correct any mistakes in the following text and return the whole text:\n\n{text}",
         "Rewrite the following text with every sentence on its own line:\n\n{text}",
         "Summarise the following text, reusing its wording:\n\n{text}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto",
                   help="float32 on a GPU for the token-for-token check (bf16 near-ties part "
                        "a K+1-position verify from a one-token decode)")
    p.add_argument("--runner", default="v2", choices=("v1", "v2"))
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the greedy equality check (bf16 timings: random weights make "
                        "near-ties that a K+1-token forward rounds differently; the check "
                        "runs in float32)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="of the timed runs (the equality check is greedy): with random "
                        "weights, 1.0 makes nearly every draft fail (the cost of speculation "
                        "that never pays)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    p.add_argument("--eager-tail-arm", action="store_true",
                   help="also time speculation with the step's tail launched eagerly (no "
                        "speculative tail CUDA graphs): arm 'on_eager_tail'")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/spec_cpu.json"))
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="after the runs, profile one run per arm and concurrency into "
                        "DIR/kernels_{arm}_c{N}.txt (torch.profiler tables)")
    return p.parse_args(argv)


def make_prompts(llm: Any, count: int, vocab_size: int) -> list[list[int]]:
    """Copy-heavy chat prompts with a tokenizer; random token ids without one (dummy
    weights, whose answers repeat nothing anyway)."""
    if llm.tokenizer is None:
        rng = random.Random(0)
        return [[rng.randrange(vocab_size) for _ in range(128)] for _ in range(count)]
    prompts = []
    for i in range(count):
        text = TASKS[i % len(TASKS)].format(text=TEXTS[(i // len(TASKS)) % len(TEXTS)])
        prompts.append(llm.tokenizer.encode(llm.apply_chat_template(text)))
    return prompts


def run_batch(llm: Any, prompts: list[list[int]], num_tokens: int, temperature: float = 0.0
              ) -> tuple[float, list[tuple[int, ...]]]:
    from actors.protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, seed=0 if temperature else None,
                            max_tokens=num_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = [o.outputs[0].token_ids for o in outputs]
    if any(len(t) != num_tokens for t in tokens):
        raise RuntimeError("a request decoded fewer tokens than asked for")
    return elapsed, tokens


def step_breakdown(llm: Any) -> dict[str, dict[str, float | int]]:
    """Mean device, idle and launch (CPU) ms of the last run's steps, speculative steps (with
    draft slots) apart from the others."""
    groups: dict[str, list[Any]] = {"spec": [], "plain": []}
    for stats in llm.last_step_stats:
        groups["spec" if stats.spec is not None else "plain"].append(stats)
    return {name: {"num_steps": len(steps),
                   "device_ms": 1e3 * statistics.fmean(s.step_time_s for s in steps),
                   "idle_ms": 1e3 * statistics.fmean(s.gpu_idle_s for s in steps),
                   "launch_ms": 1e3 * statistics.fmean(s.prepare_time_s for s in steps)}
            for name, steps in groups.items() if steps}


def acceptance(llm: Any) -> dict[str, float | int]:
    steps = [s.spec for s in llm.last_step_stats if s.spec is not None]
    drafts = sum(s.num_drafts for s in steps)
    draft_tokens = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_tokens for s in steps)
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "num_steps": len(llm.last_step_stats)}


def measure(llm: Any, prompts: list[list[int]], num_tokens: int, temperature: float
            ) -> dict[str, Any]:
    first_s, _ = run_batch(llm, prompts, 1, temperature)
    total_s, _ = run_batch(llm, prompts, num_tokens, temperature)
    return {"first_token_s": first_s, "total_s": total_s,
            "tpot_ms": 1e3 * (total_s - first_s) / (num_tokens - 1),
            "output_tok_s": len(prompts) * num_tokens / total_s, **acceptance(llm),
            "steps": step_breakdown(llm), "load_average": load_average()}


def profile_kernels(llm: Any, prompts: list[list[int]], num_tokens: int, temperature: float,
                    path: Path) -> None:
    """One run under torch.profiler: its device kernels by total time, to `path` (the CPU
    ops of the engine's threads are not recorded)."""
    import torch

    with torch.profiler.profile() as profiler:
        run_batch(llm, prompts, num_tokens, temperature)
    path.write_text(profiler.key_averages().table(sort_by="self_device_time_total",
                                                  row_limit=40))


def load(args: argparse.Namespace) -> dict[str, Any]:
    """The arms: 'off' (no speculation), 'on', and with --eager-tail-arm 'on_eager_tail'."""
    from actors.protocol.speculative_config import SpeculativeConfig
    from app.llm import LLM

    options = dict(device=args.device, dtype=args.dtype, runner=args.runner, max_num_seqs=max(args.concurrency),
                   max_model_len=1024)
    plain = LLM(args.model, **options)
    config = SpeculativeConfig("ngram", args.num_speculative_tokens, args.prompt_lookup_min,
                               args.prompt_lookup_max)
    arms = {"off": plain, "on": LLM(args.model, reuse=plain, speculative_config=config, **options)}
    if args.eager_tail_arm:
        arms["on_eager_tail"] = LLM(args.model, reuse=plain, speculative_config=config,
                                    spec_tail_graphs=False, **options)
    return arms


def check_greedy(plain: Any, spec: Any, prompts: list[list[int]], num_tokens: int
                 ) -> dict[str, Any]:
    _, expected = run_batch(plain, prompts, num_tokens)
    _, got = run_batch(spec, prompts, num_tokens)
    num_equal = sum(a == b for a, b in zip(expected, got))
    return {"num_requests": len(prompts), "num_equal": num_equal, **acceptance(spec)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    record: dict[str, Any] = {"benchmark": "spec_decode", **run_header(command_line()),
                              "workload": {k: (str(v) if isinstance(v, Path) else v)
                                           for k, v in vars(args).items()},
                              "correctness": {}, "runs": []}
    arms = load(args)
    plain = arms["off"]
    prompts = make_prompts(plain, max(args.concurrency), plain.worker.model_config.vocab_size)
    for concurrency in args.concurrency if args.check else ():
        for arm in (a for a in arms if a != "off"):
            check = check_greedy(plain, arms[arm], prompts[:concurrency], args.max_tokens)
            key = str(concurrency) if arm == "on" else f"{concurrency}_{arm}"
            record["correctness"][key] = check
            print(f"greedy check {arm} c={concurrency}: {check['num_equal']}/"
                  f"{check['num_requests']} equal, acceptance {check['acceptance_rate']:.2f}",
                  flush=True)
            if check["num_equal"] != check["num_requests"]:
                _write(args.output, record)
                print("greedy outputs differ with speculation: stopping", file=sys.stderr)
                return 1
    # One untimed pass per arm and concurrency first: the first runs compile kernels for
    # the speculative step's many shapes (26 ms steps on the H200) and time a cold first
    # token, which made the first timed runs of each arm meaningless.
    for concurrency in args.concurrency:
        for llm in arms.values():
            measure(llm, prompts[:concurrency], args.max_tokens, args.temperature)
    for repeat in range(args.repeats):
        names = list(arms) if repeat % 2 == 0 else list(reversed(arms))
        order = names + names[::-1]  # ABBA (ABCCBA with the eager-tail arm)
        for concurrency in args.concurrency:
            for arm in order:
                figures = measure(arms[arm], prompts[:concurrency], args.max_tokens,
                                  args.temperature)
                record["runs"].append({"arm": arm, "concurrency": concurrency, "repeat": repeat,
                                       **figures})
                _write(args.output, record)
    record["summary"] = summarise(record["runs"], args.concurrency, list(arms))
    _write(args.output, record)
    print_table(record["summary"])
    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        for concurrency in args.concurrency:
            for arm, llm in arms.items():
                profile_kernels(llm, prompts[:concurrency], args.max_tokens, args.temperature,
                                args.profile_dir / f"kernels_{arm}_c{concurrency}.txt")
    return 0


def summarise(runs: list[dict[str, Any]], concurrencies: list[int],
              arms: tuple[str, ...] | list[str] = ("off", "on")) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for concurrency in concurrencies:
        by_arm = {arm: [r for r in runs if r["arm"] == arm and r["concurrency"] == concurrency]
                  for arm in arms}
        row: dict[str, Any] = {f"tpot_ms_{arm}": statistics.median(r["tpot_ms"] for r in arm_runs)
                               for arm, arm_runs in by_arm.items()}
        row["tpot_change"] = row["tpot_ms_on"] / row["tpot_ms_off"] - 1
        if "on_eager_tail" in arms:
            row["tpot_change_on_eager_tail"] = (row["tpot_ms_on_eager_tail"] / row["tpot_ms_off"]
                                                - 1)
        on_runs = by_arm["on"]
        row["acceptance_rate"] = statistics.median(r["acceptance_rate"] for r in on_runs)
        row["mean_acceptance_length"] = statistics.median(r["mean_acceptance_length"]
                                                          for r in on_runs)
        for arm, arm_runs in by_arm.items():
            row[f"steps_{arm}_last_run"] = arm_runs[-1]["steps"]
        summary[str(concurrency)] = row
    return summary


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'conc':>5} {'TPOT off ms':>12} {'TPOT on ms':>11} {'change':>8} {'accept':>7} "
          f"{'mean len':>9}")
    for concurrency, row in summary.items():
        print(f"{concurrency:>5} {row['tpot_ms_off']:>12.2f} {row['tpot_ms_on']:>11.2f} "
              f"{row['tpot_change']:>+8.1%} {row['acceptance_rate']:>7.2f} "
              f"{row['mean_acceptance_length']:>9.2f}")
        _print_steps(row["steps_on_last_run"])
        print("      without speculation:")
        _print_steps(row["steps_off_last_run"])
        if "tpot_ms_on_eager_tail" in row:
            print(f"      eager tail: TPOT {row['tpot_ms_on_eager_tail']:.2f} ms "
                  f"({row['tpot_change_on_eager_tail']:+.1%})")
            _print_steps(row["steps_on_eager_tail_last_run"])


def _print_steps(breakdown: dict[str, dict[str, float | int]]) -> None:
    for kind, steps in breakdown.items():
        print(f"      {kind:5s} steps {steps['num_steps']:4d}: device {steps['device_ms']:.2f} "
              f"ms, idle {steps['idle_ms']:.2f} ms, launch {steps['launch_ms']:.2f} ms")


def _write(output: Path, record: dict[str, Any]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
