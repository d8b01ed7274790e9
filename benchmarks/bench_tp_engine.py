"""The tensor-parallel serving engine (`--tensor-parallel-size N`): correctness, then
output tokens/s and inter-token latency, TP = 1 against TP = N, through the offline LLM
(the same engine core, scheduler, V2 runner and step broadcast as `tandem serve`).

Correctness first (--check, on by default): the check model (dummy qwen3-0.6b) in
float32 gives the same greedy tokens at TP = N as at TP = 1 for --check-prompts random
prompts, and seeded T = 0.8 / top-p sampling the same tokens; a mismatch fails the run
before any timing.

Timing: for each TP size one engine (dummy --model, bfloat16, CUDA graphs) serves, per
batch size B, B random prompts of --input-len tokens, --output-len tokens each (vLLM's
throughput sampling: T = 1, ignore_eos), every request submitted at t = 0, after a short
warm-up. Reported per (TP, B): output tok/s, TPOT (ITL) median / p90 / p99 from the
per-request times, the mean decode step time from rank 0's CUDA events, the KV cache
size and the weights per rank. Each TP size runs in a fresh process (its own devices and
process group).

    python benchmarks/bench_tp_engine.py --tp 1,2 --check-only --out $OUT/tp_engine_check.json
    python benchmarks/bench_tp_engine.py --no-check --out $OUT/tp_engine_w3.json  # W3 shape
    python benchmarks/bench_tp_engine.py --model dummy:qwen3-32b --tp 2 --batch 1,64 \
        --no-check --out $OUT/tp_engine_32b.json
    python benchmarks/bench_tp_engine.py --device cpu --model <tiny hf dir> \
        --check-model <tiny hf dir> --tp 1,2 --batch 2 --input-len 8 --output-len 4  # smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._tp_bench import header, usable_tp_sizes  # noqa: E402

ARM_TIMEOUT_S = 540.0
RESULT_MARKER = "TP_ENGINE_ARM_RESULT "


def main() -> None:
    args = _parser().parse_args()
    if args.arm is not None:  # one TP size, in its own process
        print(RESULT_MARKER + json.dumps(_run_arm(json.loads(args.arm))), flush=True)
        return
    tp_sizes, skipped = usable_tp_sizes([int(n) for n in args.tp.split(",")], args.device)
    record = {**header("tp_engine"), "args": {k: str(v) for k, v in vars(args).items()},
              "skipped_tp_sizes": skipped}
    if not args.no_check:
        record["check"] = _check(args, [n for n in tp_sizes if n > 1])
        _write(args.out, record)
    if args.check_only:
        print(f"wrote {args.out}")
        return
    record["runs"] = {}
    for tp_size in tp_sizes:
        record["runs"][str(tp_size)] = _spawn_arm({**_options(args, args.model, args.dtype),
                                                  "tensor_parallel_size": tp_size},
                                                 _timing_job(args))
        _write(args.out, record)
    _print_table(record)
    print(f"wrote {args.out}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tp_engine.json"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--tp", default="1,2", help="TP sizes (comma-separated)")
    parser.add_argument("--batch", default="1,256", help="batch sizes (comma-separated)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--check-model", default="dummy:qwen3-0.6b")
    parser.add_argument("--check-prompts", type=int, default=8)
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--check-only", action="store_true", help="only the correctness check")
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    return parser


def _options(args: argparse.Namespace, model: str, dtype: str) -> dict[str, Any]:
    options = {"model": model, "device": args.device, "dtype": dtype,
               "max_model_len": args.input_len + args.output_len + 16,
               "max_num_seqs": max(int(b) for b in args.batch.split(",")),
               "max_num_batched_tokens": 8192}
    if args.device == "cuda":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        options["num_kv_blocks"] = 256
    return options


def _timing_job(args: argparse.Namespace) -> dict[str, Any]:
    return {"kind": "timing", "batch": [int(b) for b in args.batch.split(",")],
            "input_len": args.input_len, "output_len": args.output_len}


def _check(args: argparse.Namespace, tp_sizes: list[int]) -> dict[str, Any]:
    """TP = N against TP = 1 on the float32 check model; raises SystemExit on a mismatch."""
    options = {**_options(args, args.check_model, "float32"), "max_num_seqs": 16,
               "max_model_len": 256}
    job = {"kind": "check", "num_prompts": args.check_prompts, "num_tokens": args.check_tokens}
    reference = _spawn_arm({**options, "tensor_parallel_size": 1}, job)
    result: dict[str, Any] = {"model": args.check_model, "dtype": "float32",
                              "num_prompts": args.check_prompts, "num_tokens": args.check_tokens,
                              "tp_sizes": tp_sizes, "passed": True}
    for tp_size in tp_sizes:
        sharded = _spawn_arm({**options, "tensor_parallel_size": tp_size}, job)
        for name in ("greedy", "sampled"):
            same = sharded[name] == reference[name]
            result[f"tp{tp_size}_{name}_equal"] = same
            if not same:
                result["passed"] = False
                result[f"tp{tp_size}_{name}"] = sharded[name]
                result[f"tp1_{name}"] = reference[name]
    print(f"check: {result}")
    if not result["passed"]:
        _write(args.out, {**header("tp_engine"), "check": result})
        raise SystemExit(f"TP tokens differ from TP = 1 on {args.check_model}; see {args.out}")
    return result


def _spawn_arm(options: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--arm",
                           json.dumps({"options": options, "job": job})],
                          capture_output=True, text=True, timeout=ARM_TIMEOUT_S)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"arm tp={options['tensor_parallel_size']} {job['kind']} failed "
                         f"(exit {proc.returncode})")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    result["arm_wall_s"] = time.perf_counter() - started
    return result


def _run_arm(spec: dict[str, Any]) -> dict[str, Any]:
    from benchmarks._tp_engine_arm import run_check, run_timing

    options, job = spec["options"], spec["job"]
    return (run_check if job["kind"] == "check" else run_timing)(options, job)


def _write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def _print_table(record: dict[str, Any]) -> None:
    print(f"{'tp':>3} {'batch':>5} {'out tok/s':>10} {'TPOT med ms':>11} {'TPOT p99 ms':>11} "
          f"{'step ms':>8} {'KV GiB':>7} {'weights GiB':>11}")
    for tp_size, run in record["runs"].items():
        for batch, result in run["batches"].items():
            tpot = result["tpot"]
            step_ms = result.get("mean_decode_step_ms")
            print(f"{tp_size:>3} {batch:>5} {result['output_tok_s']:>10.0f} "
                  f"{1e3 * tpot['p50']:>11.3f} {1e3 * tpot['p99']:>11.3f} "
                  f"{step_ms if step_ms is not None else float('nan'):>8.3f} "
                  f"{run['kv_cache_gib']:>7.1f} {run.get('weights_gib_rank0', float('nan')):>11.2f}")
    for tp_size, why in record.get("skipped_tp_sizes", {}).items():
        print(f"tp {tp_size} skipped: {why}")


if __name__ == "__main__":
    main()
