"""Offline throughput: one workload through tandem's V2 and V1 runners, interleaved ABBA,
then through transformers on the same weights (`generate` on static batches, and
`generate_batch`, its continuous batching).

    python -m benchmarks.throughput --workload W1          # the H200's headline (W1-W3)
    python -m benchmarks.throughput --workload W2 --arms v2,v1,hf_static --hf-batch-size 128
    python -m benchmarks.throughput --workload CPU         # the embedded model on the CPU
    python -m benchmarks.throughput --workload CPU --quantization none  # ... in float32
    python -m benchmarks.throughput --workload W3 --quantization fp8   # FP8 projections
    python -m benchmarks.throughput --workload W3 --kv-cache-dtype fp8  # an FP8 KV cache
    python -m benchmarks.throughput --workload W3 --num-prompts 90 -tp 2 -pp 2
        # TP x PP on four GPUs, V2 against V1 (vLLM issue 55139's shape; its gpt-oss-20b,
        # W4, splits into stages but not yet over TP ranks: -pp 2 only)

Every request is submitted at t=0, as in vLLM's `bench throughput`; a run's wall time goes
from the first submission to the last finish. Each request's first-token and finish times
come from its stream; each step's statistics from the engine client's step observers, the
path by which they reach the server's metrics. Figures: output tokens/s per arm (median of
its repeats), TTFT and TPOT (vLLM's definitions), the GPU's idle time between steps at batch
>= 64, and the fraction of the workload's bandwidth floor (benchmarks.workloads).
"""

# The docstring above is --help's text. Here: the command line; the arms and their order are
# in throughput_arms, one engine pass in throughput_engine, the figures in throughput_figures.

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from benchmarks import recording
from benchmarks.throughput_arms import HF_ARMS, TANDEM_ARMS, run_arms
from benchmarks.throughput_figures import headline
from benchmarks.workloads import WORKLOADS, workload_by_name


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
    _add_engine_args(p)
    p.add_argument(
        "--kernel-profile",
        action="store_true",
        help="CUDA: one more v2 run under torch.profiler, its device time per step by "
        "kernel (recorded as kernel_profile)",
    )
    args = p.parse_args(argv)
    args.default_arms = args.arms is None
    args.arms = _checked_arms(p, args)
    return args


def _add_engine_args(p: Any) -> None:
    """The options tandem's engine runs under (both runners)."""
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
    p.add_argument(
        "--mxfp4-copy",
        choices=["none", "bf16", "fp8"],
        default="none",
        help="tandem's --mxfp4-copy: gpt-oss's MXFP4 experts also kept in bf16 or FP8 for "
        "steps with many tokens per expert",
    )
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="tandem's, for both runners"
    )
    p.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=1, help="tandem's, for both runners"
    )


def _checked_arms(p: Any, args: Any) -> list[str]:
    """--arms as a list (its default for the run's ranks and quantization); a usage error
    for arms that cannot run together."""
    multi_rank = args.tensor_parallel_size * args.pipeline_parallel_size > 1
    if args.arms is None:  # transformers runs one device's unquantized weights only
        with_hf = not multi_rank and args.quantization != "fp8"
        args.arms = ",".join(TANDEM_ARMS + HF_ARMS if with_hf else TANDEM_ARMS)
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
    if multi_rank and set(arms) & set(HF_ARMS):
        p.error("-tp/-pp above 1: the transformers arms run on one device; pass --arms v2,v1")
    return arms


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
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:  # older engines lack pp
        engine_options["tensor_parallel_size"] = args.tensor_parallel_size
        engine_options["pipeline_parallel_size"] = args.pipeline_parallel_size
    if args.kv_cache_dtype != "auto":  # engines older than the option run the default
        engine_options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.mxfp4_copy != "none":
        engine_options["mxfp4_copy"] = args.mxfp4_copy
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


if __name__ == "__main__":
    sys.exit(main())
