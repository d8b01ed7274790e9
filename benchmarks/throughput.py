"""Offline throughput: one workload through tandem's V2 and V1 runners, interleaved ABBA,
then through transformers on the same weights (`generate` on static batches, and
`generate_batch`, its continuous batching).

    python -m benchmarks.throughput --workload W1          # the H200's headline (W1-W3)
    python -m benchmarks.throughput --workload W2 --arms v2,v1,hf_static --hf-batch-size 128
    python -m benchmarks.throughput --workload CPU         # the embedded model on the CPU
    python -m benchmarks.throughput --workload CPU --quantization none  # ... in float32
    python -m benchmarks.throughput --workload W3 --quantization fp8   # FP8 projections
    python -m benchmarks.throughput --workload W3 --kv-cache-dtype fp8  # an FP8 KV cache

Every request is submitted at t=0, as in vLLM's `bench throughput`; a run's wall time goes
from the first submission to the last finish. Each request's first-token and finish times
come from its stream; each step's statistics from the engine client's step observers, the
path by which they reach the server's metrics. Figures: output tokens/s per arm (median of
its repeats), TTFT and TPOT (vLLM's definitions), the GPU's idle time between steps at batch
>= 64, and the fraction of the workload's bandwidth floor (benchmarks.workloads).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import recording
from benchmarks.workloads import (
    WORKLOADS,
    Workload,
    floors,
    random_prompts,
    workload_by_name,
)

TANDEM_ARMS = ("v2", "v1")
HF_ARMS = ("hf_static", "hf_continuous")
IDLE_MIN_BATCH = 64


@dataclass(frozen=True, slots=True)
class RequestTiming:
    num_output_tokens: int
    ttft_s: float
    latency_s: float
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class EngineRun:
    elapsed_s: float
    requests: tuple[RequestTiming, ...]
    steps: tuple[Any, ...]
    """Every step's StepStats, as the engine client's step observers saw them."""
    num_preemptions: int | None

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)


def parse_args(argv: list[str] | None) -> Any:
    p = recording.parser("throughput", __doc__)
    p.add_argument(
        "--workload",
        default="W1",
        type=str.upper,
        choices=list(WORKLOADS),
        help="W1 (qwen3-0.6b, 1024 x 128 in / 512 out), W2 (qwen3-0.6b, 1000 x 1024 "
        "in / 128 out), W3 (llama-3.1-8b), W4 (gpt-oss-20b, MXFP4 experts), W5 "
        "(qwen3-30b-a3b), W3-W5 1024 x 128 in / 512 out, all dummy weights in bf16 on "
        "CUDA; CPU (the embedded model, float32, 32 x 128 in / 64 out)",
    )
    p.add_argument("--model", help="override the workload's model (e.g. dummy:smollm2-135m)")
    p.add_argument("--num-prompts", type=int, help="override the workload's prompt count")
    p.add_argument("--input-len", type=int, help="override the workload's input length")
    p.add_argument("--output-len", type=int, help="override the workload's output length")
    p.add_argument(
        "--arms",
        help=f"comma-separated, v2 first: any of {','.join(TANDEM_ARMS + HF_ARMS)} (the "
        "default; without the transformers arms when tandem's projections are FP8 or "
        "packed int4)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs per tandem arm, in ABBA order (transformers arms run once)",
    )
    p.add_argument(
        "--hf-num-prompts",
        type=int,
        default=256,
        help="prompts the transformers arms run (a prefix of the workload's)",
    )
    p.add_argument(
        "--hf-batch-size", type=int, default=256, help="batch size of the static transformers arm"
    )
    p.add_argument(
        "--max-num-seqs", type=int, help="default 1024 on CUDA, the number of prompts on the CPU"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.72,
        help="tandem's share (CUDA); the rest is left to the transformers arms",
    )
    p.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    p.add_argument(
        "--quantization",
        choices=["auto", "fp8", "int4", "none"],
        default="auto",
        help="tandem's --quantization: fp8 quantizes the (dummy) weights' projections per "
        "output channel at load (CUDA >= 8.9); auto keeps the CPU workload's Q4_1 "
        "projections packed int4, none runs them in float32. The transformers arms share "
        "tandem's weights, so they run only unquantized ones; the floor figures assume "
        "2-byte weights whatever this is",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3"],
        default="auto",
        help="tandem's --kv-cache-dtype: fp8 stores the paged KV cache in e4m3 (half of "
        "bf16's bytes per token)",
    )
    args = p.parse_args(argv)
    args.default_arms = args.arms is None
    if args.arms is None:
        default = TANDEM_ARMS if args.quantization == "fp8" else TANDEM_ARMS + HF_ARMS
        args.arms = ",".join(default)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or arms[0] != "v2" or not set(arms) <= {*TANDEM_ARMS, *HF_ARMS}:
        p.error(
            f"--arms must start with v2 and name only {','.join(TANDEM_ARMS + HF_ARMS)}; "
            f"got {args.arms!r}"
        )
    if args.quantization == "fp8" and set(arms) & set(HF_ARMS):
        p.error(
            "--quantization fp8: the transformers arms cannot share FP8 weights; pass --arms v2,v1"
        )
    args.arms = arms
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {
        k: v
        for k, v in (
            ("model", args.model),
            ("num_prompts", args.num_prompts),
            ("input_len", args.input_len),
            ("output_len", args.output_len),
        )
        if v is not None
    }
    workload = replace(workload_by_name(args.workload), **overrides)
    engine_options: dict[str, Any] = {
        "device": workload.device,
        "dtype": workload.dtype,
        "max_num_seqs": args.max_num_seqs
        or (1024 if workload.device == "cuda" else workload.num_prompts),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enforce_eager": args.enforce_eager,
        "quantization": args.quantization,
    }
    if args.kv_cache_dtype != "auto":  # engines older than the option run the default
        engine_options["kv_cache_dtype"] = args.kv_cache_dtype
    if workload.device == "cuda":
        engine_options["gpu_memory_utilization"] = args.gpu_memory_utilization
    run = recording.Run(
        "throughput",
        args,
        f"throughput_{workload.name.lower()}",
        {**workload.as_dict(), "engine_options": engine_options},
        argv,
    )
    details = run_arms(workload, engine_options, args, run.checkpoint)
    record = run.finish(headline(details), details)
    for arm, figures in record["details"]["summary"].items():
        print(
            f"{arm}: {figures['median_output_tok_s']:,.0f} output tok/s (median of "
            f"{figures['repeats']})"
        )
    return 0


def run_arms(
    workload: Workload, engine_options: dict[str, Any], args: Any, checkpoint: Any
) -> dict[str, Any]:
    from app.llm import LLM

    details: dict[str, Any] = {
        "sampling": "temperature 1.0, top_p 1.0, ignore_eos, min_tokens = max_tokens = output_len",
        "arms": args.arms,
        "repeats": args.repeats,
        "hf_num_prompts": args.hf_num_prompts,
        "hf_batch_size": args.hf_batch_size,
        "order": "tandem arms ABBA (v2 v1 v1 v2 ...), then each transformers arm once",
        "runs": [],
    }
    triton_cache_was_empty = _triton_cache_is_empty()
    started = time.perf_counter()
    v2 = LLM(workload.model, runner="v2", **engine_options)
    details["startup"] = _startup_figures(v2, time.perf_counter() - started, triton_cache_was_empty)
    if getattr(args, "default_arms", False) and v2.worker.model.precision.schemes:
        args.arms = [arm for arm in args.arms if arm not in HF_ARMS]  # nothing to share
        details["arms"] = args.arms
    llms = {"v2": v2}
    if "v1" in args.arms:
        llms["v1"] = LLM(workload.model, reuse=v2, runner="v1", **engine_options)
    prompts = random_prompts(
        workload.num_prompts, workload.input_len, v2.worker.model_config.vocab_size, seed=0
    )
    tandem_arms = tuple(a for a in TANDEM_ARMS if a in args.arms)
    details["warmup"] = _warm_up(llms, tandem_arms, prompts, engine_options["max_num_seqs"])
    for arm in abba_order(tandem_arms, args.repeats):
        engine_run = run_engine(llms[arm], prompts, fixed_length_params(workload.output_len))
        details["runs"].append(_tandem_run_record(arm, engine_run, v2, workload))
        details["summary"] = summarise_runs(details["runs"])
        checkpoint(details)
        print(_describe(details["runs"][-1]), flush=True)
    hf_arms = [a for a in HF_ARMS if a in args.arms]
    if hf_arms:
        _run_hf_arms(
            details, hf_arms, v2, prompts[: args.hf_num_prompts], workload, args.hf_batch_size
        )
    details["summary"] = summarise_runs(details["runs"])
    return details


def abba_order(arms: tuple[str, ...], repeats: int) -> list[str]:
    """v2 v1 v1 v2 v2 v1 ...: each arm sees early and late positions equally often."""
    order: list[str] = []
    for repeat in range(repeats):
        order.extend(arms if repeat % 2 == 0 else tuple(reversed(arms)))
    return order


def fixed_length_params(output_len: int) -> Any:
    """vLLM's throughput-benchmark sampling: T=1, top_p=1, ignore_eos, exact length."""
    from actors.protocol.sampling_params import SamplingParams

    return SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True
    )


def run_engine(llm: Any, prompts: list[list[int]], params: Any) -> EngineRun:
    """Run every prompt through a fresh engine on `llm`'s loaded model (app.llm.LLM)."""
    import anyio

    return anyio.run(_run_engine, llm, prompts, params)


async def _run_engine(llm: Any, prompts: list[list[int]], params: Any) -> EngineRun:
    import anyio

    from actors.inprocess_engine import InProcessEngine
    from actors.protocol.messages import EngineRequest

    steps: list[Any] = []
    preemptions: list[int] = []
    engine = InProcessEngine(
        llm.worker,
        llm.loaded.runner,
        llm.config,
        tokenizer=llm.tokenizer,
        step_observers=[steps.append],
        on_scheduler_stats=lambda stats: preemptions.append(stats.num_preemptions_total),
    )
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        started = time.monotonic()
        streams = [
            engine.add_request(
                EngineRequest(
                    request_id=f"bench-{index}",
                    prompt_token_ids=tuple(prompt),
                    sampling_params=params,
                    arrival_time=started,
                )
            )
            for index, prompt in enumerate(prompts)
        ]
        timings = await _collect_finished(streams, started)
        elapsed_s = time.monotonic() - started
        engine.stop()
    # Each engine starts a fresh scheduler: its running total is this run's count.
    return EngineRun(
        elapsed_s, tuple(timings), tuple(steps), preemptions[-1] if preemptions else None
    )


async def _collect_finished(streams: list[Any], started: float) -> list[RequestTiming]:
    """Read each stream once, after it has finished, as vLLM's offline `generate` returns
    whole outputs. Reading every step instead would wake one task per request per step,
    CPU time the engine's own threads then lack. The timestamps are the stream's own (set
    when the engine pushed), so reading late does not blur TTFT or latency."""
    import anyio

    timings: list[RequestTiming | None] = [None] * len(streams)

    async def read(index: int) -> None:
        delta = await streams[index].wait_finished()
        if delta is None:
            timings[index] = RequestTiming(0, 0.0, 0.0, None)
            return
        end = delta.finish_time if delta.finish_time is not None else time.monotonic()
        first = delta.first_token_time if delta.first_token_time is not None else end
        timings[index] = RequestTiming(
            delta.num_output_tokens, first - started, end - started, delta.finish_reason
        )

    async with anyio.create_task_group() as tg:
        for index in range(len(streams)):
            tg.start_soon(read, index)
    return [t for t in timings if t is not None]


# ---- figures ------------------------------------------------------------------------------


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "mean_ms": 1e3 * statistics.fmean(ordered),
        "median_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def latency_figures(run: EngineRun) -> dict[str, Any]:
    """TTFT and TPOT with vLLM's definitions (TPOT = (latency - TTFT) / (outputs - 1))."""
    tpot = [
        (r.latency_s - r.ttft_s) / (r.num_output_tokens - 1)
        for r in run.requests
        if r.num_output_tokens > 1
    ]
    return {"ttft": _percentiles([r.ttft_s for r in run.requests]), "tpot": _percentiles(tpot)}


def gpu_idle_figures(steps: tuple[Any, ...], min_batch: int = IDLE_MIN_BATCH) -> dict[str, Any]:
    """Idle fraction = idle / (idle + step time) over steps of at least `min_batch` requests
    (the first step has no predecessor and is left out)."""
    timed = [s for s in steps[1:] if s.step_time_s > 0 and s.num_reqs >= min_batch]
    if not timed:
        return {"measured": False}
    idle = sum(s.gpu_idle_s for s in timed)
    busy = sum(s.step_time_s for s in timed)
    decode = [s for s in timed if s.num_prefill_tokens == 0]
    return {
        "measured": True,
        "min_batch": min_batch,
        "num_steps": len(timed),
        "idle_fraction": idle / (idle + busy),
        "decode_idle_fraction": (
            sum(s.gpu_idle_s for s in decode)
            / max(sum(s.gpu_idle_s + s.step_time_s for s in decode), 1e-12)
        ),
        "mean_step_ms": 1e3 * busy / len(timed),
        "mean_decode_step_ms": (
            1e3 * statistics.fmean(s.step_time_s for s in decode) if decode else None
        ),
        "mean_prepare_ms": 1e3 * statistics.fmean(s.prepare_time_s for s in timed),
    }


def summarise_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: median and spread of output tokens/s over its repeats."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if "output_tok_s" in run:
            by_arm.setdefault(run["arm"], []).append(run)
    summary = {}
    for arm, arm_runs in by_arm.items():
        rates = [r["output_tok_s"] for r in arm_runs]
        summary[arm] = {
            "repeats": len(rates),
            "median_output_tok_s": statistics.median(rates),
            "min_output_tok_s": min(rates),
            "max_output_tok_s": max(rates),
            "num_prompts": arm_runs[0]["num_prompts"],
        }
    return summary


def headline(details: dict[str, Any]) -> dict[str, Any]:
    """The figures `benchmarks.report` compares between results."""
    rate = {arm: s["median_output_tok_s"] for arm, s in details["summary"].items()}
    figures: dict[str, Any] = {
        f"{arm}_output_tok_s": round(value, 1) for arm, value in rate.items()
    }
    if "v1" in rate:
        figures["v2_over_v1"] = round(rate["v2"] / rate["v1"], 3)
    v2_runs = [r for r in details["runs"] if r.get("arm") == "v2"]
    idle = [r["gpu_idle"]["idle_fraction"] for r in v2_runs if r["gpu_idle"].get("measured")]
    if idle:
        figures["v2_gpu_idle_fraction"] = round(max(idle), 4)
    for metric in ("ttft", "tpot"):
        medians = [r[metric]["median_ms"] for r in v2_runs if r[metric]]
        if medians:
            figures[f"v2_{metric}_median_ms"] = round(statistics.median(medians), 2)
    figures["ready_s"] = round(details["startup"]["ready_s"], 2)
    return figures


# ---- arms ---------------------------------------------------------------------------------


def _startup_figures(llm: Any, ready_s: float, triton_cache_was_empty: bool) -> dict[str, Any]:
    worker = llm.worker
    graphs = getattr(worker, "graphs", None)
    memory_report = getattr(worker, "memory_report", None)
    kv_spec = getattr(worker, "kv_spec", None)
    return {
        "ready_s": ready_s,
        "process_age_at_ready_s": _process_age_s(),
        "runner": llm.runner,
        "weights": getattr(worker, "weights_precision", None),
        "weights_load_s": getattr(worker, "load_time_s", None),
        "graph_capture_s": graphs.capture_time_s if graphs is not None else None,
        "num_graphs": graphs.num_captured if graphs is not None else 0,
        "graph_memory_bytes": getattr(worker, "graph_memory_bytes", None),
        "kv_cache_tokens": kv_spec.num_tokens if kv_spec is not None else None,
        "memory_report": asdict(memory_report) if memory_report is not None else None,
        "triton_cache": "cold" if triton_cache_was_empty else "warm",
    }


def _warm_up(
    llms: dict[str, Any], arms: tuple[str, ...], prompts: list[list[int]], max_num_seqs: int
) -> dict[str, Any]:
    """One short run per arm at full concurrency: compiles the prefill kernels' shapes."""
    num_prompts = min(len(prompts), max_num_seqs)
    seconds = {}
    for arm in arms:
        started = time.perf_counter()
        run_engine(llms[arm], prompts[:num_prompts], fixed_length_params(8))
        seconds[arm] = time.perf_counter() - started
    return {
        "description": f"{num_prompts} prompts x 8 output tokens per tandem arm, untimed; "
        "one 8-prompt x 4-token generate for the transformers arms",
        "seconds": seconds,
    }


def _tandem_run_record(arm: str, run: EngineRun, v2: Any, workload: Workload) -> dict[str, Any]:
    num_tokens = run.num_output_tokens
    bound = floors(v2.worker.model_config, workload, num_steps=len(run.steps))
    return {
        "arm": arm,
        "num_prompts": len(run.requests),
        "elapsed_s": run.elapsed_s,
        "output_tokens": num_tokens,
        "all_outputs_full_length": num_tokens == workload.num_prompts * workload.output_len,
        "output_tok_s": num_tokens / run.elapsed_s,
        "total_tok_s": (num_tokens + len(run.requests) * workload.input_len) / run.elapsed_s,
        "num_steps": len(run.steps),
        "num_preemptions": run.num_preemptions,
        **latency_figures(run),
        "gpu_idle": gpu_idle_figures(run.steps),
        "floor": {
            **bound,
            "fraction_of_roofline": bound["ideal_s"] / run.elapsed_s,
            "fraction_of_larger_floor": max(bound["ideal_s"], bound["compute_floor_s"])
            / run.elapsed_s,
        },
    }


def _run_hf_arms(
    details: dict[str, Any],
    arms: list[str],
    v2: Any,
    prompts: list[list[int]],
    workload: Workload,
    batch_size: int,
) -> None:
    import torch

    from benchmarks.hf_arms import (
        hf_model_sharing_weights,
        run_hf_continuous,
        run_hf_static,
        warm_up_hf,
    )

    try:  # a transformers model that cannot be built (no room for its copies) is reported
        hf = hf_model_sharing_weights(v2.worker.model)
        warm_up_hf(hf, prompts)
    except Exception as exc:  # noqa: BLE001
        for arm in arms:
            details["runs"].append({"arm": arm, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(_describe(details["runs"][-1]), flush=True)
        return
    details["hf_implementation"] = {
        "attention": getattr(hf.config, "_attn_implementation", None),
        "experts": getattr(hf.config, "_experts_implementation", None),
    }
    for arm in arms:
        try:
            if arm == "hf_static":
                run = run_hf_static(hf, prompts, workload.output_len, batch_size)
            else:
                run = run_hf_continuous(hf, prompts, workload.output_len)
            details["runs"].append(
                {
                    "arm": arm,
                    "num_prompts": run.num_prompts,
                    "batch_size": run.batch_size,
                    "elapsed_s": run.elapsed_s,
                    "output_tokens": run.num_output_tokens,
                    "all_outputs_full_length": run.num_output_tokens
                    == run.num_prompts * workload.output_len,
                    "output_tok_s": run.num_output_tokens / run.elapsed_s,
                    "note": f"subset: the first {run.num_prompts} of the workload's prompts",
                }
            )
        except Exception as exc:  # noqa: BLE001 - a failing baseline is reported, not fatal
            details["runs"].append({"arm": arm, "error": f"{type(exc).__name__}: {exc}"[:500]})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(_describe(details["runs"][-1]), flush=True)


def _describe(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"{run['arm']}: ERROR {run['error']}"
    extra = ""
    if run.get("gpu_idle", {}).get("measured"):
        extra = (
            f", gpu idle {100 * run['gpu_idle']['idle_fraction']:.1f}%, "
            f"{100 * run['floor']['fraction_of_roofline']:.1f}% of the floor"
        )
    return (
        f"{run['arm']}: {run['output_tok_s']:,.0f} output tok/s ({run['output_tokens']} "
        f"tokens in {run['elapsed_s']:.2f} s{extra})"
    )


def _triton_cache_is_empty() -> bool:
    cache_dir = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return not cache_dir.is_dir() or not any(cache_dir.iterdir())


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux), so 'ready' includes imports."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return uptime_s - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


if __name__ == "__main__":
    sys.exit(main())
