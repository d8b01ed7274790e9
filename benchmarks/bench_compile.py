"""--compile-level on the V1 runner against eager V1 and V2's CUDA graphs, on a CUDA GPU.

Dummy qwen3-0.6b (bfloat16). First correctness, then timings; timings run only if the
correctness checks pass.

1. Correctness: teacher-forced prefill logits, 4 sequences x 96 tokens, error = max over
   positions of ||a - b|| / ||b||. float32: compiled (each level) vs eager under 1e-3.
   bfloat16: compiled vs float32 on the same weights no worse than eager bfloat16 vs
   float32 (x 1.1, + 1e-3). Plus greedy tokens of the whole V1 engine, eager vs compiled
   (float32, 8 prompts x 32 tokens), reported as the number of identical sequences.
2. Startup cost: seconds to compile each level, with an empty inductor cache (a fresh
   TORCHINDUCTOR_CACHE_DIR; the first compile of the process also pays inductor's one-time
   setup) and again with a warm one, next to the V2 worker's load and ready time (weights,
   KV sizing, CUDA-graph capture).
3. Step time: decode steps of the whole engine (scheduler, runner, sampler, output
   processing), batch 1 and 64, 32-token random prompts, `--decode-steps` tokens each:
   step = (T(1 + steps tokens) - T(1 token)) / steps, the prefill cancelling out; arms
   v2 (CUDA graphs), v1 eager, v1 -O1, v1 -O2, in ABBA order, median of `--repeats`.

    TANDEM_COMMIT=<sha> bash -c '. benchmarks/device_env.sh && \
        python3 benchmarks/bench_compile.py --out $OUT/compile.json'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Before torch is imported: measure compilation with an empty cache.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="tandem_inductor_"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from benchmarks.run_info import run_header  # noqa: E402
from app.llm import LLM  # noqa: E402
from gpu.attention.base import AttentionMetadata  # noqa: E402
from gpu.models.llama import DecoderModel  # noqa: E402
from gpu.runner_v1.compiled_model import compiled_decoder  # noqa: E402

PRESET = "dummy:qwen3-0.6b"
ENGINE = dict(max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=4096,
              num_kv_blocks=4096, gpu_memory_utilization=0.5)
FP32_TOLERANCE = 1e-3
BF16_RULE = "error vs float32 <= 1.1 * eager bfloat16's error vs float32 + 1e-3"
ARMS = {"v2_graphs": dict(runner="v2"), "v1_eager": dict(runner="v1"),
        "v1_O1": dict(compile_level=1), "v1_O2": dict(compile_level=2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("compile.json"))
    parser.add_argument("--levels", default="1,2", help="compile levels to measure")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="check the script itself on the CPU (tiny sizes, level 1 only)")
    args = parser.parse_args()
    device = "cpu" if args.dry_run_cpu else "cuda"
    if args.dry_run_cpu:
        _shrink_for_cpu(args)
    elif not torch.cuda.is_available():
        raise SystemExit("bench_compile needs a CUDA GPU (or --dry-run-cpu)")
    torch.backends.cuda.matmul.allow_tf32 = False
    levels = [int(x) for x in args.levels.split(",")]
    record: dict[str, Any] = {
        "benchmark": "compile", **run_header(" ".join(["python3", *sys.argv])),
        "torch": torch.__version__, "preset": PRESET, "engine": {**ENGINE, "device": device},
        "inductor_cache_dir": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    record["commit"] = os.environ.get("TANDEM_COMMIT") or record["commit"]
    record["correctness"] = correctness(levels, device)
    passed = record["correctness"]["passed"]
    print(f"correctness: {'PASSED' if passed else 'FAILED'}", flush=True)
    if passed:
        record.update(timings(levels, device, [int(b) for b in args.batches.split(",")],
                              args.decode_steps, args.repeats))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    _print_table(record)
    print(f"wrote {args.out}")
    return 0 if passed else 1


def _shrink_for_cpu(args: argparse.Namespace) -> None:
    global PRESET
    PRESET = "dummy:smollm2-135m"
    ENGINE.update(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=512,
                  num_kv_blocks=256)
    args.levels, args.batches, args.decode_steps, args.repeats = "1", "1,2", 4, 1
    torch.set_num_threads(2)


def correctness(levels: list[int], device: str) -> dict[str, Any]:
    """Also records each level's compile time: the bfloat16 ones run with an empty cache
    for their graphs (float32 compiled other kernels first)."""
    result: dict[str, Any] = {"float32_tolerance": FP32_TOLERANCE,
                              "bfloat16_rule": BF16_RULE, "passed": True}
    llm = LLM(PRESET, dtype="float32", device=device, runner="v1", **ENGINE)
    seqs = torch.from_numpy(np.random.default_rng(3).integers(
        0, llm.worker.model_config.vocab_size, (4, 96))).to(device)
    eager = _prefill_logits(llm.worker.model, llm.worker.kv_caches, seqs)
    for level in levels:
        compiled = compiled_decoder(llm.worker.model, level)
        result[f"float32_O{level}_compile_s_cold_cache"] = compiled.compile_time_s
        error = _max_rel_err(_prefill_logits(compiled, llm.worker.kv_caches, seqs,
                                             llm.worker.model), eager)
        result[f"float32_O{level}_prefill_rel_err"] = error
        result["passed"] &= error < FP32_TOLERANCE
    result.update(_greedy_agreement(llm, levels, device))
    del llm
    _empty_cache(device)
    result.update(_bf16_accuracy(levels, device, seqs))
    result["passed"] &= all(result[f"bfloat16_O{level}_passed"] for level in levels)
    return result


def _bf16_accuracy(levels: list[int], device: str, seqs: torch.Tensor) -> dict[str, Any]:
    """bfloat16 rounds differently once inductor fuses (it keeps fused intermediates in
    float32), so compiled and eager bfloat16 differ by about bfloat16's own error; each is
    compared with float32 on the same weights instead."""
    llm = LLM(PRESET, dtype="bfloat16", device=device, runner="v1", **ENGINE)
    model = llm.worker.model
    reference_model = DecoderModel(model.config, model.layers[0].self_attn.attn_backend,
                                   torch.float32, device)
    reference_model.load_weights({k: v.float() for k, v in model.hf_weight_views().items()})
    fp32_caches = [cache.float() for cache in llm.worker.kv_caches]
    reference = _prefill_logits(reference_model, fp32_caches, seqs)
    del reference_model, fp32_caches
    eager_error = _max_rel_err(_prefill_logits(model, llm.worker.kv_caches, seqs), reference)
    out: dict[str, Any] = {"bfloat16_eager_vs_float32": eager_error}
    for level in levels:
        compiled = compiled_decoder(model, level)
        out[f"bfloat16_O{level}_compile_s_cold_cache"] = compiled.compile_time_s
        error = _max_rel_err(_prefill_logits(compiled, llm.worker.kv_caches, seqs, model),
                             reference)
        out[f"bfloat16_O{level}_vs_float32"] = error
        out[f"bfloat16_O{level}_passed"] = error <= 1.1 * eager_error + 1e-3
    return out


def _greedy_agreement(eager: LLM, levels: list[int], device: str) -> dict[str, Any]:
    rng = np.random.default_rng(5)
    vocab = eager.worker.model_config.vocab_size
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(8, 64, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    out = {}
    for level in levels:
        llm = LLM(PRESET, reuse=eager, dtype="float32", device=device, compile_level=level,
                  enforce_eager=True, **ENGINE)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        out[f"float32_O{level}_identical_sequences"] = sum(a == b for a, b in zip(got, expected))
    out["num_sequences"] = len(prompts)
    return out


@torch.inference_mode()
def _prefill_logits(forward: Any, kv_caches: list[torch.Tensor], seqs: torch.Tensor,
                    model: DecoderModel | None = None) -> torch.Tensor:  # [seqs, len, vocab]
    model = model or forward
    num_seqs, seq_len = seqs.shape
    block_size = kv_caches[0].shape[2]
    blocks_per_seq = -(-seq_len // block_size)
    device = seqs.device
    table = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=device)
    table = table.view(num_seqs, blocks_per_seq)
    positions = torch.arange(seq_len, device=device)
    slots = (table[:, positions // block_size].long() * block_size
             + positions % block_size).flatten()
    query_start_loc = np.arange(num_seqs + 1, dtype=np.int32) * seq_len
    seq_lens = np.full(num_seqs, seq_len, dtype=np.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_seqs * seq_len, num_reqs=num_seqs, max_query_len=seq_len,
        max_seq_len=seq_len, query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device), slot_mapping=slots, block_table=table,
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)
    hidden = forward(seqs.flatten(), positions.repeat(num_seqs), kv_caches, metadata)
    return model.compute_logits(hidden).view(num_seqs, seq_len, -1)


def _max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    err = (actual - expected).norm(dim=-1) / expected.norm(dim=-1)
    return float(err.max()) if torch.isfinite(err).all() else float("inf")


def timings(levels: list[int], device: str, batches: list[int], decode_steps: int,
            repeats: int) -> dict[str, Any]:
    base = LLM(PRESET, dtype="bfloat16", device=device, runner="v2", **ENGINE)
    startup: dict[str, Any] = {"v2_load_s": base.worker.load_time_s,
                               "v2_ready_s": base.worker.ready_time_s,
                               "v2_graphs_captured": base.worker.graphs is not None}
    for level in levels:  # the same graphs as in the bfloat16 correctness check
        startup[f"O{level}_compile_s_warm_cache"] = compiled_decoder(
            base.worker.model, level).compile_time_s
    arms = {name: base if name == "v2_graphs" else LLM(PRESET, reuse=base, dtype="bfloat16",
                                                       device=device, **options, **ENGINE)
            for name, options in ARMS.items()
            if "compile_level" not in options or options["compile_level"] in levels}
    steps: dict[str, dict[str, list[float]]] = {name: {} for name in arms}
    order = list(arms) + list(reversed(arms))
    for batch in batches:
        prompts = [np.random.default_rng(batch + i).integers(0, 1000, 32).tolist()
                   for i in range(batch)]
        for name in arms:  # warm-up: first-use costs of every shape
            _generate_s(arms[name], prompts, 4)
        for _ in range(repeats):
            for name in order:
                prefill_s = _generate_s(arms[name], prompts, 1)
                total_s = _generate_s(arms[name], prompts, 1 + decode_steps)
                steps[name].setdefault(str(batch), []).append((total_s - prefill_s) / decode_steps)
    step_ms = {name: {b: 1e3 * statistics.median(v) for b, v in per_batch.items()}
               for name, per_batch in steps.items()}
    return {"startup": startup, "decode_step_ms_median": step_ms,
            "decode_step_ms_all": {n: {b: [1e3 * x for x in v] for b, v in pb.items()}
                                   for n, pb in steps.items()},
            "workload": {"prompt_len": 32, "decode_steps": decode_steps, "batches": batches,
                         "repeats": repeats, "order": "ABBA per repeat", "dtype": "bfloat16"}}


def _generate_s(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return elapsed


def _empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def _print_table(record: dict[str, Any]) -> None:
    print(json.dumps(record["correctness"]))
    if "startup" not in record:
        return
    print("startup:", json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                  for k, v in record["startup"].items()}))
    batches = record["workload"]["batches"]
    print(f"{'arm':<12}" + "".join(f"{'batch ' + str(b) + ' ms/step':>20}" for b in batches))
    for name, per_batch in record["decode_step_ms_median"].items():
        print(f"{name:<12}" + "".join(f"{per_batch[str(b)]:>20.3f}" for b in batches))


if __name__ == "__main__":
    sys.exit(main())
