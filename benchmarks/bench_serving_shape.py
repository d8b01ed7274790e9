"""Serving-shaped steps on a CUDA GPU: does a step that carries prefill chunks next to its
decodes cost about what a decode-only step of the same batch costs?

The offline engine (dummy qwen3-0.6b, bf16, V2, CUDA graphs, max_num_seqs 256) gets
requests arriving over time (Poisson, 128 prompt / 512 output tokens, ignore_eos), at a
rate that keeps the batch near 256, so that most steps admit a new request's prefill
beside ~255 decodes. From the runner's per-step stats (device time between its first and
last launch): the median step time of mixed steps and of decode-only steps, both at
batch >= 90% of max_num_seqs, and their ratio (target <= 1.2). A second run submits 256 requests at once
for a pure decode reference at batch 256.

    python benchmarks/bench_serving_shape.py --out $OUT/serving_shape.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402
import msgspec  # noqa: E402

from _device_record import run_record, write_json  # noqa: E402
from actors.inprocess_engine import InProcessEngine  # noqa: E402
from actors.protocol.messages import EngineRequest, StepStats  # noqa: E402
from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from app.llm import LLM  # noqa: E402

MIN_BATCH_FRACTION = 0.9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("serving_shape.json"))
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--rate", type=float, default=110.0, help="arrivals per second")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--model", default="dummy:qwen3-0.6b")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="check the script itself on the CPU (tiny counts, float32)")
    args = parser.parse_args()
    engine_options: dict[str, Any] = dict(runner="v2", dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                                          max_num_batched_tokens=16384, gpu_memory_utilization=0.85)
    if args.dry_run_cpu:
        engine_options.update(dtype="float32", device="cpu", max_num_batched_tokens=512,
                              max_model_len=256)
        engine_options.pop("gpu_memory_utilization")
    record = run_record("serving_shape", {"model": args.model, "engine": engine_options,
                                          **{k: v for k, v in vars(args).items() if k != "out"}})
    llm = LLM(args.model, **engine_options)
    rng = random.Random(0)
    vocab = llm.worker.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, min_tokens=args.output_len,
                            ignore_eos=True)
    anyio.run(_run, llm, prompts[: args.max_num_seqs], params, 0.0)  # warm-up: compiles, graphs
    for name, rate, subset in (("serving", args.rate, prompts),
                               ("decode_only", 0.0, prompts[: args.max_num_seqs])):
        started = time.perf_counter()
        steps = anyio.run(_run, llm, subset, params, rate)
        min_batch = max(1, int(MIN_BATCH_FRACTION * args.max_num_seqs))
        record[name] = {"wall_s": time.perf_counter() - started, **_summary(steps, min_batch)}
        write_json(args.out, record)
        print(name, {k: v for k, v in record[name].items() if not isinstance(v, dict)}, flush=True)
    mixed = record["serving"]["mixed"].get("median_ms")
    for reference in ("serving", "decode_only"):
        decode = record[reference]["decode_only"].get("median_ms")
        if mixed and decode:
            record[f"mixed_over_{reference}_decode"] = mixed / decode
    write_json(args.out, record)
    print({k: v for k, v in record.items() if k.startswith("mixed_over")})
    return 0


async def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams, rate: float
               ) -> tuple[StepStats, ...]:
    engine = InProcessEngine(llm.worker, llm.loaded.runner, llm.config, tokenizer=llm.tokenizer)
    rng = random.Random(1)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        streams = []
        for index, prompt in enumerate(prompts):
            if rate > 0:
                await anyio.sleep(rng.expovariate(rate))
            streams.append(engine.add_request(EngineRequest(
                request_id=f"s{index}", prompt_token_ids=tuple(prompt), sampling_params=params,
                arrival_time=time.monotonic())))
        for stream in streams:
            await stream.wait_finished()
        engine.stop()
    return engine.recent_step_stats()


def _summary(steps: tuple[StepStats, ...], min_batch: int) -> dict[str, Any]:
    # On CPU there is no device timing: the step's CPU time stands in (dry runs only).
    timed = [s for s in steps[1:] if s.num_reqs >= min_batch]
    timed = [s if s.step_time_s > 0 else msgspec.structs.replace(s, step_time_s=s.prepare_time_s)
             for s in timed]
    out: dict[str, Any] = {"num_steps": len(steps), "num_steps_at_batch": len(timed)}
    for name, chosen in (("mixed", [s for s in timed if s.num_prefill_tokens > 0]),
                         ("decode_only", [s for s in timed if s.num_prefill_tokens == 0])):
        times = sorted(s.step_time_s * 1e3 for s in chosen)
        out[name] = {"count": len(times)} if not times else {
            "count": len(times), "median_ms": statistics.median(times),
            "p90_ms": times[int(0.9 * (len(times) - 1))],
            "mean_prefill_tokens": statistics.fmean(s.num_prefill_tokens for s in chosen),
            "mean_batch": statistics.fmean(s.num_reqs for s in chosen),
            "mean_idle_ms": statistics.fmean(s.gpu_idle_s * 1e3 for s in chosen)}
    return out


if __name__ == "__main__":
    sys.exit(main())
