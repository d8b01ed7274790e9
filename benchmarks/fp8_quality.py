"""FP8 quality against bf16 on the same weights: teacher-forced logprobs and greedy agreement.

    # the H200/H100 run of the FP8 issue: dummy llama-3.1-8b, bf16 against FP8 weights and
    # FP8 weights with an FP8 KV cache
    python -m benchmarks.fp8_quality --model dummy:llama-3.1-8b --num-prompts 8 \\
        --input-len 128 --output-len 256

Each arm loads the same weights (a `dummy:` model draws them from one seed; a checkpoint is
the checkpoint), the FP8 arms quantizing them at load (`--quantization fp8`). The bf16 arm
decodes `--output-len` greedy tokens after each random prompt; every arm is then fed the
prompt plus those tokens and asked for `prompt_logprobs`, so all arms score the same
sequence (teacher forcing). Reported per arm against bf16:

- `logprob_abs_diff`: |logprob of the sequence's next token| differences, mean / p99 / max
  over every scored position (nats);
- `top1_agreement`: the share of positions where the arm's most likely next token is
  bf16's;
- greedy: each arm's own greedy continuation, compared with bf16's: the mean length of the
  common prefix and the number of prompts identical over all `--output-len` tokens. This
  is reported, not asserted: one near-tie flipped by rounding parts the rest.
"""

from __future__ import annotations

from typing import Any

from benchmarks import recording
from benchmarks.throughput_engine import free_device_memory
from benchmarks.workloads import random_prompts

ARMS: dict[str, dict[str, Any]] = {
    "bf16": {"quantization": "none"},
    "fp8": {"quantization": "fp8"},
    "fp8_kv_fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def main(argv: list[str] | None = None) -> int:
    p = recording.parser("fp8_quality", __doc__)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated; bf16 comes first")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--device", default="cuda", help="cpu runs the arms' dequantized weights")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    arms = ["bf16", *(a for a in args.arms.split(",") if a != "bf16")]
    keys = ("model", "num_prompts", "input_len", "output_len", "device", "dtype")
    workload = {k: getattr(args, k) for k in keys}
    run = recording.Run("fp8_quality", args, "fp8_quality", {**workload, "arms": arms}, argv)
    details = measure(args, arms)
    record = run.finish(headline(details), details)
    for arm, figures in record["figures"].items():
        print(f"{arm}: {figures}")
    return 0


def measure(args: Any, arms: list[str]) -> dict[str, Any]:
    details: dict[str, Any] = {"arms": {}}
    reference: dict[str, Any] = {}
    for arm in arms:
        details["arms"][arm] = _measure_arm(args, arm, reference)
        free_device_memory()  # the arm's engine is gone once _measure_arm returns
        print(arm, details["arms"][arm], flush=True)
    return details


def _measure_arm(args: Any, arm: str, reference: dict[str, Any]) -> dict[str, Any]:
    """One arm against `reference` (filled by the first arm: prompts, greedy, scored)."""
    llm = _load(args, ARMS[arm])
    try:
        if not reference:
            vocab_size = llm.worker.model_config.vocab_size
            reference["prompts"] = random_prompts(args.num_prompts, args.input_len, vocab_size)
        greedy = _greedy(llm, reference["prompts"], args.output_len)
        reference.setdefault("greedy", greedy)
        sequences = [p + g for p, g in zip(reference["prompts"], reference["greedy"])]
        scored = _teacher_forced(llm, sequences, args.input_len)
        reference.setdefault("scored", scored)
        return {
            "weights": getattr(llm.worker, "weights_precision", None),
            "kv_cache_dtype": str(llm.config.kv_cache_dtype),
            **compare_scores(reference["scored"], scored),
            **compare_greedy(reference["greedy"], greedy),
        }
    finally:
        llm.close()


def _load(args: Any, options: dict[str, Any]) -> Any:
    from app.llm import LLM

    memory = (
        {"gpu_memory_utilization": args.gpu_memory_utilization} if args.device == "cuda" else {}
    )
    return LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 8,
        **memory,
        **options,
    )


def _greedy(llm: Any, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    from actors.protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def _teacher_forced(
    llm: Any, sequences: list[list[int]], first_scored: int
) -> list[list[tuple[float, int]]]:
    """Per sequence, per position from `first_scored` on: (logprob of the sequence's token
    there, the arm's most likely token there)."""
    from actors.protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = []
    for out in llm.generate(sequences, params):
        entries = out.prompt_logprobs[first_scored:]
        scored.append([(e.logprob, e.top_logprobs[0].token_id) for e in entries])
    return scored


def compare_scores(
    reference: list[list[tuple[float, int]]], arm: list[list[tuple[float, int]]]
) -> dict[str, Any]:
    diffs, agree = [], 0
    for ref_seq, arm_seq in zip(reference, arm, strict=True):
        for (ref_lp, ref_top), (arm_lp, arm_top) in zip(ref_seq, arm_seq, strict=True):
            diffs.append(abs(arm_lp - ref_lp))
            agree += ref_top == arm_top
    diffs.sort()
    return {
        "positions": len(diffs),
        "logprob_abs_diff": {
            "mean": round(sum(diffs) / len(diffs), 5),
            "p99": round(diffs[min(len(diffs) - 1, int(0.99 * len(diffs)))], 5),
            "max": round(diffs[-1], 5),
        },
        "top1_agreement": round(agree / len(diffs), 5),
    }


def compare_greedy(reference: list[list[int]], arm: list[list[int]]) -> dict[str, Any]:
    common = [_common_prefix(r, a) for r, a in zip(reference, arm, strict=True)]
    return {
        "greedy_common_prefix_mean": round(sum(common) / len(common), 2),
        "greedy_identical": sum(c == len(r) for c, r in zip(common, reference)),
        "greedy_prompts": len(reference),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def headline(details: dict[str, Any]) -> dict[str, Any]:
    return {
        arm: {
            "logprob_abs_diff_mean": d["logprob_abs_diff"]["mean"],
            "logprob_abs_diff_p99": d["logprob_abs_diff"]["p99"],
            "top1_agreement": d["top1_agreement"],
            "greedy_identical": f"{d['greedy_identical']}/{d['greedy_prompts']}",
            "greedy_common_prefix_mean": d["greedy_common_prefix_mean"],
        }
        for arm, d in details["arms"].items()
    }


if __name__ == "__main__":
    raise SystemExit(main())
