"""ngram speculative decoding, off and on, through the offline engine: TPOT, acceptance, and
the step profile (launches per step, device time per output token).

    # the issue's workload: random weights repeat themselves under greedy decoding (drafts
    # accepted), and at temperature 1 nearly nothing is accepted (the cost of speculating)
    python -m benchmarks.spec_decode --model dummy:qwen3-0.6b --device cuda --dtype bfloat16 \\
        --concurrency 1 32 128 --max-tokens 128
    # token-for-token check in float32 (stops with exit 1 on a difference)
    python -m benchmarks.spec_decode --model dummy:qwen3-0.6b --device cuda --dtype float32 \\
        --concurrency 1 32 --check-only

Correctness first: at every concurrency, greedy outputs and seeded temperature-1 outputs
with speculation must equal those without, token for token (in float32 a difference
stops the run; in another dtype near-ties of random weights may part a K + 1-token
verify from a one-token decode: reported, not fatal). Then, per repeat, concurrency and
sampling arm (greedy, temperature 1), speculation off and on run interleaved (off on on
off, then on off off on). TPOT is the batch's decode time per output token: (time for N
tokens - time for 1 token) / (N - 1), every request decoding exactly N tokens
(ignore_eos). Acceptance from the steps' SpecDecodeStats: rate = accepted / draft
tokens, mean acceptance length = 1 + accepted / drafts (vLLM's definitions).

Step profile, from each timed run's step statistics: per kind of step (speculative or
plain decode) the steps, mean device time (CUDA events), launch time (CPU) and the device
idle gap before it, and the device time per output token (a speculative step emits each
row's last token plus its accepted drafts). On CUDA, one more run per arm under
torch.profiler counts the CUDA runtime launches (kernels, graph replays, copies) per step.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from benchmarks import recording

LAUNCH_CALLS = {
    "kernels": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"),
    "graphs": ("cudaGraphLaunch", "cuGraphLaunch"),
    "copies": ("cudaMemcpyAsync", "cuMemcpyAsync", "cudaMemsetAsync"),
}
"""CUDA runtime calls counted as launches, by kind."""
SAMPLING = ("greedy", "temperature_1")


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("spec_decode", __doc__)
    p.add_argument("--model", default="dummy:qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--check-only", action="store_true", help="the token check alone")
    p.add_argument("--no-profile", action="store_true", help="skip the launch counts (CUDA)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (TPOT needs a second token)")
    return args


def params_for(sampling: str, num_tokens: int, count: int) -> list[Any]:
    """Per request: greedy, or temperature 1 seeded by the request's index (so that the
    same request draws the same tokens with and without speculation)."""
    from actors.protocol.sampling_params import SamplingParams

    if sampling == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)] * count
    return [
        SamplingParams(temperature=1.0, seed=index, max_tokens=num_tokens, ignore_eos=True)
        for index in range(count)
    ]


def run_batch(
    llm: Any, prompts: list[list[int]], num_tokens: int, sampling: str
) -> tuple[float, list[tuple[int, ...]]]:
    llm.reset_prefix_cache()  # each batch prefills its prompts whole, as the first did
    started = time.perf_counter()
    outputs = llm.generate(prompts, params_for(sampling, num_tokens, len(prompts)))
    elapsed = time.perf_counter() - started
    tokens = [o.outputs[0].token_ids for o in outputs]
    if any(len(t) != num_tokens for t in tokens):
        raise RuntimeError("a request decoded fewer tokens than asked for")
    return elapsed, tokens


def step_profile(steps: tuple[Any, ...]) -> dict[str, dict[str, float | int]]:
    """Per kind of decode step (speculative, plain): steps, mean device / launch / idle
    ms, output tokens per step and device ms per output token. Prefill steps apart."""
    groups: dict[str, list[Any]] = {"spec": [], "plain": [], "prefill": []}
    for stats in steps:
        kind = "prefill" if stats.num_prefill_tokens else "plain" if stats.spec is None else "spec"
        groups[kind].append(stats)
    profile = {}
    for kind, group in groups.items():
        if not group:
            continue
        num_tokens = sum(s.num_reqs + (s.spec.num_accepted_tokens if s.spec else 0) for s in group)
        device_s = sum(s.step_time_s for s in group)
        profile[kind] = {
            "num_steps": len(group),
            "device_ms": 1e3 * device_s / len(group),
            "launch_ms": 1e3 * statistics.fmean(s.prepare_time_s for s in group),
            "idle_ms": 1e3 * statistics.fmean(s.gpu_idle_s for s in group),
            "output_tokens_per_step": num_tokens / len(group),
            # K + 1 per row in a padded step: what the draft-length policy's cost model prices
            "query_tokens_per_step": statistics.fmean(s.num_tokens for s in group),
            "device_ms_per_output_token": 1e3 * device_s / num_tokens if num_tokens else 0.0,
        }
    return profile


def acceptance(steps: tuple[Any, ...]) -> dict[str, float | int]:
    spec = [s.spec for s in steps if s.spec is not None]
    drafts = sum(s.num_drafts for s in spec)
    draft_tokens = sum(s.num_draft_tokens for s in spec)
    accepted = sum(s.num_accepted_tokens for s in spec)
    return {
        "num_spec_steps": len(spec),
        "num_steps": len(steps),
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }


def measure(llm: Any, prompts: list[list[int]], num_tokens: int, sampling: str) -> dict[str, Any]:
    first_s, _ = run_batch(llm, prompts, 1, sampling)
    total_s, _ = run_batch(llm, prompts, num_tokens, sampling)
    steps = llm.last_step_stats
    return {
        "first_token_s": first_s,
        "total_s": total_s,
        "tpot_ms": 1e3 * (total_s - first_s) / (num_tokens - 1),
        "output_tok_s": len(prompts) * num_tokens / total_s,
        **acceptance(steps),
        "steps": step_profile(steps),
        "load_average": recording.load_average(),
    }


def count_launches(
    llm: Any, prompts: list[list[int]], num_tokens: int, sampling: str
) -> dict[str, float]:
    """One run under torch.profiler: CUDA runtime launches per step, by kind (every
    thread's runtime calls are traced, the engine's launcher thread's among them)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        run_batch(llm, prompts, num_tokens, sampling)
    counts = dict.fromkeys(LAUNCH_CALLS, 0)
    for event in profiler.events():
        for kind, names in LAUNCH_CALLS.items():
            if event.name in names:
                counts[kind] += 1
    num_steps = max(len(llm.last_step_stats), 1)
    per_step = {f"{kind}_per_step": count / num_steps for kind, count in counts.items()}
    per_step["launches_per_step"] = sum(counts.values()) / num_steps
    per_step["spec_step_share"] = acceptance(llm.last_step_stats)["num_spec_steps"] / num_steps
    return per_step


def load(args: Any) -> dict[str, Any]:
    """The arms: 'off' (no speculation) and 'on', one loaded model."""
    from actors.protocol.speculative_config import SpeculativeConfig
    from app.llm import LLM

    options = dict(
        device=args.device,
        dtype=args.dtype,
        runner="v2",
        max_num_seqs=max(args.concurrency),
        max_model_len=args.max_model_len,
    )
    plain = LLM(args.model, **options)
    config = SpeculativeConfig(
        "ngram", args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max
    )
    return {"off": plain, "on": LLM(args.model, reuse=plain, speculative_config=config, **options)}


def make_prompts(count: int, input_len: int, vocab_size: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(count)]


def check_tokens(arms: dict[str, Any], prompts: list[list[int]], args: Any) -> dict[str, Any]:
    """Outputs with speculation against those without, per concurrency and sampling arm."""
    checks: dict[str, Any] = {}
    for concurrency in args.concurrency:
        for sampling in SAMPLING:
            batch = prompts[:concurrency]
            _, expected = run_batch(arms["off"], batch, args.max_tokens, sampling)
            _, got = run_batch(arms["on"], batch, args.max_tokens, sampling)
            num_equal = sum(a == b for a, b in zip(expected, got))
            checks[f"{sampling}_c{concurrency}"] = {
                "num_requests": len(batch),
                "num_equal": num_equal,
                **acceptance(arms["on"].last_step_stats),
            }
            print(
                f"check {sampling} c={concurrency}: {num_equal}/{len(batch)} equal, "
                f"acceptance {checks[f'{sampling}_c{concurrency}']['acceptance_rate']:.2f}",
                flush=True,
            )
    return checks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    workload = {k: v for k, v in vars(args).items() if k not in ("results_dir", "output")}
    run = recording.Run("spec_decode", args, f"spec_decode_{args.device}", workload, argv)
    arms = load(args)
    vocab_size = arms["off"].worker.model_config.vocab_size
    prompts = make_prompts(max(args.concurrency), args.input_len, vocab_size)
    details: dict[str, Any] = {"checks": check_tokens(arms, prompts, args), "runs": []}
    run.checkpoint(details)
    failed = [
        key
        for key, check in details["checks"].items()
        if check["num_equal"] != check["num_requests"]
    ]
    if failed and args.dtype in ("float32", "fp32"):
        print(f"outputs differ with speculation ({', '.join(failed)}): stopping", file=sys.stderr)
        run.finish({"tokens_equal": False}, details)
        return 1
    if not args.check_only:
        _timed_runs(arms, prompts, args, details, run)
        if args.device == "cuda" and not args.no_profile:
            details["launches"] = {
                f"{arm}_{sampling}_c{c}": count_launches(
                    llm, prompts[:c], args.max_tokens, sampling
                )
                for c in args.concurrency
                for sampling in SAMPLING
                for arm, llm in arms.items()
            }
        details["summary"] = summarise(details["runs"], args.concurrency)
        print_table(details["summary"], details.get("launches", {}))
    figures = {"tokens_equal": not failed, **headline(details.get("summary", {}))}
    run.finish(figures, details)
    return 0


def _timed_runs(
    arms: dict[str, Any], prompts: list[list[int]], args: Any, details: dict, run: Any
) -> None:
    # One untimed pass per arm first: the first runs compile kernels.
    for concurrency in args.concurrency:
        for sampling in SAMPLING:
            for llm in arms.values():
                measure(llm, prompts[:concurrency], min(args.max_tokens, 8), sampling)
    for repeat in range(args.repeats):
        order = ["off", "on", "on", "off"] if repeat % 2 == 0 else ["on", "off", "off", "on"]
        for concurrency in args.concurrency:
            for sampling in SAMPLING:
                for arm in order:
                    figures = measure(arms[arm], prompts[:concurrency], args.max_tokens, sampling)
                    details["runs"].append(
                        {
                            "arm": arm,
                            "sampling": sampling,
                            "concurrency": concurrency,
                            "repeat": repeat,
                            **figures,
                        }
                    )
                    run.checkpoint(details)


def summarise(runs: list[dict[str, Any]], concurrencies: list[int]) -> dict[str, Any]:
    """Per concurrency and sampling arm: median TPOT off and on, their change, acceptance,
    and the last 'on' run's step profile beside the last 'off' run's."""
    summary: dict[str, Any] = {}
    for concurrency in concurrencies:
        for sampling in SAMPLING:
            chosen = [
                r for r in runs if r["concurrency"] == concurrency and r["sampling"] == sampling
            ]
            by_arm = {arm: [r for r in chosen if r["arm"] == arm] for arm in ("off", "on")}
            if not all(by_arm.values()):
                continue
            tpot = {arm: statistics.median(r["tpot_ms"] for r in rs) for arm, rs in by_arm.items()}
            summary[f"{sampling}_c{concurrency}"] = {
                "tpot_ms_off": tpot["off"],
                "tpot_ms_on": tpot["on"],
                "tpot_change": tpot["on"] / tpot["off"] - 1,
                "acceptance_rate": statistics.median(r["acceptance_rate"] for r in by_arm["on"]),
                "mean_acceptance_length": statistics.median(
                    r["mean_acceptance_length"] for r in by_arm["on"]
                ),
                "spec_step_share": statistics.median(
                    r["num_spec_steps"] / max(r["num_steps"], 1) for r in by_arm["on"]
                ),
                "steps_on": by_arm["on"][-1]["steps"],
                "steps_off": by_arm["off"][-1]["steps"],
            }
    return summary


def headline(summary: dict[str, Any]) -> dict[str, float]:
    figures: dict[str, float] = {}
    for key, row in summary.items():
        figures[f"{key}_tpot_change"] = round(row["tpot_change"], 4)
        figures[f"{key}_acceptance"] = round(row["acceptance_rate"], 3)
    return figures


def print_table(summary: dict[str, Any], launches: dict[str, Any]) -> None:
    print(
        f"{'arm':>20} {'TPOT off':>9} {'TPOT on':>8} {'change':>8} {'accept':>7} "
        f"{'mean len':>9} {'spec steps':>10}"
    )
    for key, row in summary.items():
        print(
            f"{key:>20} {row['tpot_ms_off']:>9.3f} {row['tpot_ms_on']:>8.3f} "
            f"{row['tpot_change']:>+8.1%} {row['acceptance_rate']:>7.2f} "
            f"{row['mean_acceptance_length']:>9.2f} {row['spec_step_share']:>10.0%}"
        )
        for arm in ("on", "off"):
            for kind, steps in row[f"steps_{arm}"].items():
                print(
                    f"{'':>8}{arm:>3} {kind:>7}: {steps['num_steps']:5d} steps of "
                    f"{steps['query_tokens_per_step']:.0f} tokens, device "
                    f"{steps['device_ms']:.3f} ms ({steps['device_ms_per_output_token']:.4f} "
                    f"per output token), launch {steps['launch_ms']:.3f} ms, idle "
                    f"{steps['idle_ms']:.3f} ms"
                )
            counts = launches.get(f"{arm}_{key}")
            if counts:
                print(
                    f"{'':>8}{arm:>3} launches/step {counts['launches_per_step']:.1f} (kernels "
                    f"{counts['kernels_per_step']:.1f}, graphs {counts['graphs_per_step']:.1f}, "
                    f"copies {counts['copies_per_step']:.1f}; speculative steps "
                    f"{counts['spec_step_share']:.0%})"
                )


if __name__ == "__main__":
    sys.exit(main())
