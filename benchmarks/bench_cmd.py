"""`tandem bench`: benchmarks. `tandem bench serve` is a client for a running server
(benchmarks/serve_cli.py). `tandem bench throughput` runs one offline workload (dummy
weights, bf16, fixed lengths) through tandem V2 and V1, interleaved ABBA, then through
transformers `generate` (static batches) and `generate_batch` (continuous batching) on the
same weights, and writes a JSON result (commit, GPU, command, workload, warmup, per-run
and per-arm figures).

    tandem bench throughput --workload W1 --output benchmarks/results/throughput_w1.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from benchmarks.workloads import HF_ARMS, TANDEM_ARMS

ALL_ARMS = (*TANDEM_ARMS, *HF_ARMS)


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks",
                           description="Benchmarks (see `tandem bench throughput --help`).")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    from benchmarks import serve_cli

    serve_cli.add_parser(bench_sub)
    p = bench_sub.add_parser(
        "throughput", help="offline throughput: tandem V2 vs V1 vs transformers",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1",
                   help="W1 (qwen3-0.6b, 1024 x 128 in / 512 out), W2 (qwen3-0.6b, 1000 x 1024 "
                        "in / 128 out) or W3 (llama-3.1-8b, 1024 x 128 in / 512 out)")
    p.add_argument("--model", help="override the workload's model (e.g. dummy:smollm2-135m)")
    p.add_argument("--num-prompts", type=int, help="override the workload's prompt count")
    p.add_argument("--input-len", type=int, help="override the workload's input length")
    p.add_argument("--output-len", type=int, help="override the workload's output length")
    p.add_argument("--arms", default=",".join(ALL_ARMS),
                   help=f"comma-separated subset of {','.join(ALL_ARMS)}")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per tandem arm, in ABBA order (transformers arms run once)")
    p.add_argument("--hf-num-prompts", type=int, default=256,
                   help="prompts the transformers arms run (a prefix of the workload's)")
    p.add_argument("--hf-batch-size", type=int, default=256,
                   help="batch size of the static transformers arm")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.72,
                   help="tandem's share; the rest is left to the transformers arms")
    p.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    p.add_argument("--output", type=Path, default=None,
                   help="JSON result path (default benchmarks/results/throughput_<workload>.json)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from benchmarks.throughput import run_benchmark
    from benchmarks.workloads import workload_by_name
    from app.cli_errors import UserFacingError

    try:
        workload = workload_by_name(args.workload)
    except ValueError as exc:
        raise UserFacingError(str(exc)) from None
    overrides = {k: v for k, v in (("model", args.model), ("num_prompts", args.num_prompts),
                                   ("input_len", args.input_len), ("output_len", args.output_len))
                 if v is not None}
    workload = replace(workload, **overrides)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ALL_ARMS))
    if unknown or "v2" not in arms:
        raise UserFacingError(f"--arms must include v2 and name only {','.join(ALL_ARMS)}; "
                              f"got {args.arms!r}")
    engine_options = dict(dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enforce_eager=args.enforce_eager)
    output = args.output or Path(f"benchmarks/results/throughput_{workload.name.lower()}.json")
    command = "tandem " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else \
        shlex.join(sys.argv)
    record = run_benchmark(workload, engine_options, arms, args.repeats, args.hf_num_prompts,
                           args.hf_batch_size, output, command)
    print(f"targets: {record.get('targets')}")
    print(f"wrote {output}")
    return 0
