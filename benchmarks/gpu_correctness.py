"""End-to-end correctness of tandem on a CUDA GPU, against transformers on the same weights.

1. float32 greedy: 8 prompts x 64 tokens through the whole engine (V2 with CUDA graphs,
   V2 eager, V1) must give exactly transformers' greedy tokens (`generate`, one prompt at
   a time), for qwen3-0.6b and smollm2-135m (llama architecture) dummy weights.
2. bfloat16 teacher-forced logits: 4 sequences of 256 tokens through tandem's model, once
   as one varlen prefill and once as a 128-token prefill followed by 128 batched decode
   steps (the split-KV decode kernel); at every position ||tandem - hf|| / ||hf|| over the
   vocabulary must stay under 2e-2, hf being transformers in bfloat16. The errors against
   transformers in float32 are reported too, as is transformers bf16's own error there.

transformers' parameters are views of tandem's (benchmarks/hf_model.py): identical weights.

    python benchmarks/gpu_correctness.py --out $OUT/correctness.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from benchmarks.hf_model import hf_model_sharing_weights  # noqa: E402
from app.llm import LLM  # noqa: E402
from gpu.attention.base import AttentionMetadata  # noqa: E402
from gpu.models.llama import DecoderModel  # noqa: E402

NUM_PROMPTS, NUM_OUTPUT = 8, 64
TEACHER_SEQS, TEACHER_LEN, TEACHER_PREFILL = 4, 256, 128
DEVICE = "cuda"
BF16_REL_TOL = 2e-2
SMALL_ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=1024,
                    num_kv_blocks=1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("correctness.json"))
    parser.add_argument("--models", default="qwen3-0.6b,smollm2-135m")
    parser.add_argument("--teacher-model", default="qwen3-0.6b")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="check the script itself on the CPU with short sequences")
    args = parser.parse_args()
    if args.dry_run_cpu:
        _shrink_for_cpu()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    record: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__,
                              "commit": os.environ.get("TANDEM_COMMIT"), "greedy_fp32": {},
                              "teacher_forced_bf16": {}}
    ok = True
    for preset in args.models.split(","):
        result = greedy_fp32(preset)
        record["greedy_fp32"][preset] = result
        ok &= result["passed"]
        print(f"greedy fp32 {preset}: {_summary(result)}", flush=True)
    result = teacher_forced_bf16(args.teacher_model)
    record["teacher_forced_bf16"][args.teacher_model] = result
    ok &= result["passed"]
    print(f"teacher-forced bf16 {args.teacher_model}: {_summary(result)}", flush=True)
    record["passed"] = bool(ok)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("CORRECTNESS", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


def _shrink_for_cpu() -> None:
    global NUM_OUTPUT, TEACHER_SEQS, TEACHER_LEN, TEACHER_PREFILL, DEVICE
    NUM_OUTPUT, TEACHER_SEQS, TEACHER_LEN, TEACHER_PREFILL, DEVICE = 8, 2, 48, 24, "cpu"
    SMALL_ENGINE["device"] = "cpu"
    torch.set_num_threads(2)


def _summary(result: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in result.items() if k not in ("mismatches",)})


def greedy_fp32(preset: str) -> dict[str, Any]:
    started = time.perf_counter()
    v2 = LLM(f"dummy:{preset}", dtype="float32", runner="v2", **SMALL_ENGINE)
    vocab_size = v2.worker.model_config.vocab_size
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in rng.integers(4, 80, NUM_PROMPTS)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_OUTPUT, ignore_eos=True)
    outputs = {
        "v2_graphs": _tokens(v2.generate(prompts, params)),
        "v2_eager": _tokens(LLM(f"dummy:{preset}", reuse=v2, dtype="float32", runner="v2",
                                enforce_eager=True, **SMALL_ENGINE).generate(prompts, params)),
        "v1": _tokens(LLM(f"dummy:{preset}", reuse=v2, dtype="float32", runner="v1",
                          **SMALL_ENGINE).generate(prompts, params)),
    }
    hf = hf_model_sharing_weights(v2.worker.model)
    expected, gaps = _hf_greedy(hf, prompts)
    result: dict[str, Any] = {"num_prompts": len(prompts), "num_output": NUM_OUTPUT,
                              "graphs_captured": v2.worker.graphs is not None, "mismatches": {}}
    passed = True
    for name, tokens in outputs.items():
        mismatches = _first_mismatches(tokens, expected, gaps)
        result[f"{name}_identical"] = not mismatches
        result["mismatches"][name] = mismatches
        passed &= not mismatches
    result["passed"] = passed
    result["seconds"] = round(time.perf_counter() - started, 1)
    del hf, v2
    torch.cuda.empty_cache()
    return result


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.inference_mode()
def _hf_greedy(hf: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens, and at each step the gap between its top two logits."""
    tokens, gaps = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=DEVICE)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_OUTPUT,
                          min_new_tokens=NUM_OUTPUT, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        top2 = torch.stack([s[0].float().topk(2).values for s in out.scores])
        gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    return tokens, gaps


def _first_mismatches(actual: list[list[int]], expected: list[list[int]],
                      gaps: list[list[float]]) -> list[dict[str, Any]]:
    found = []
    for prompt_index, (got, want) in enumerate(zip(actual, expected)):
        position = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if position is None and len(got) == len(want):
            continue
        position = min(len(got), len(want)) if position is None else position
        gap = gaps[prompt_index][position] if position < len(gaps[prompt_index]) else None
        found.append({"prompt": prompt_index, "position": position, "hf_top2_gap": gap,
                      "got": got[position:position + 4], "want": want[position:position + 4]})
    return found


@torch.inference_mode()
def teacher_forced_bf16(preset: str) -> dict[str, Any]:
    started = time.perf_counter()
    llm = LLM(f"dummy:{preset}", dtype="bfloat16", runner="v2",
              **{**SMALL_ENGINE, "num_kv_blocks": 512})
    model: DecoderModel = llm.worker.model
    config = model.config
    rng = np.random.default_rng(11)
    seqs = torch.tensor(rng.integers(0, config.vocab_size, (TEACHER_SEQS, TEACHER_LEN)), device=DEVICE)
    hf_bf16 = hf_model_sharing_weights(model)
    ref_bf16 = torch.stack([hf_bf16(s[None]).logits[0].float() for s in seqs])
    fp32_model = DecoderModel(config, model.layers[0].self_attn.attn_backend, torch.float32, DEVICE)
    fp32_model.load_weights({k: v.float() for k, v in model.hf_weight_views().items()})
    hf_fp32 = hf_model_sharing_weights(fp32_model)
    ref_fp32 = torch.stack([hf_fp32(s[None]).logits[0].float() for s in seqs])
    kv_caches = llm.worker.kv_caches
    result: dict[str, Any] = {"num_sequences": TEACHER_SEQS, "sequence_len": TEACHER_LEN,
                              "tolerance": BF16_REL_TOL,
                              "hf_bf16_vs_hf_fp32_max": _max_rel_err(ref_bf16, ref_fp32)}
    passed = True
    for mode, logits in (("prefill", _tandem_prefill(model, seqs, kv_caches)),
                         ("prefill_then_decode", _tandem_decode(model, seqs, kv_caches))):
        start = 0 if mode == "prefill" else TEACHER_PREFILL - 1
        err_bf16 = _max_rel_err(logits[:, start:], ref_bf16[:, start:])
        result[f"{mode}_vs_hf_bf16_max"] = err_bf16
        result[f"{mode}_vs_hf_fp32_max"] = _max_rel_err(logits[:, start:], ref_fp32[:, start:])
        passed &= err_bf16 < BF16_REL_TOL
    result["passed"] = bool(passed)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest over positions of ||actual - expected|| / ||expected|| along the vocabulary."""
    err = (actual - expected).norm(dim=-1) / expected.norm(dim=-1)
    if not torch.isfinite(err).all():
        return float("inf")
    return float(err.max())


def _metadata(query_lens: list[int], seq_lens: list[int], slots: torch.Tensor,
              block_table: torch.Tensor) -> AttentionMetadata:
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens_np = np.asarray(seq_lens, dtype=np.int32)
    return AttentionMetadata(
        num_actual_tokens=int(query_start_loc[-1]), num_reqs=len(query_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(query_start_loc).to(DEVICE),
        seq_lens=torch.from_numpy(seq_lens_np).to(DEVICE), slot_mapping=slots,
        block_table=block_table, query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens_np)


def _block_table(block_size: int) -> torch.Tensor:
    """Each sequence its own blocks, interleaved across sequences (non-contiguous)."""
    blocks_per_seq = -(-TEACHER_LEN // block_size)
    ids = torch.arange(TEACHER_SEQS * blocks_per_seq, dtype=torch.int32, device=DEVICE)
    return ids.view(blocks_per_seq, TEACHER_SEQS).t().contiguous()


def _slots(block_table: torch.Tensor, block_size: int, seq: int, positions: torch.Tensor
           ) -> torch.Tensor:
    return block_table[seq, positions // block_size].long() * block_size + positions % block_size


def _tandem_prefill(model: DecoderModel, seqs: torch.Tensor, kv_caches: list[torch.Tensor]
                    ) -> torch.Tensor:  # [seqs, len, vocab] float32
    block_size = kv_caches[0].shape[2]
    table = _block_table(block_size)
    positions = torch.arange(TEACHER_LEN, device=DEVICE)
    slots = torch.cat([_slots(table, block_size, s, positions) for s in range(TEACHER_SEQS)])
    metadata = _metadata([TEACHER_LEN] * TEACHER_SEQS, [TEACHER_LEN] * TEACHER_SEQS, slots, table)
    hidden = model(seqs.flatten(), positions.repeat(TEACHER_SEQS), kv_caches, metadata)
    return model.compute_logits(hidden).view(TEACHER_SEQS, TEACHER_LEN, -1)


def _tandem_decode(model: DecoderModel, seqs: torch.Tensor, kv_caches: list[torch.Tensor]
                   ) -> torch.Tensor:  # [seqs, len, vocab] float32, positions < prefill - 1 unset
    block_size = kv_caches[0].shape[2]
    table = _block_table(block_size)
    logits = torch.zeros(TEACHER_SEQS, TEACHER_LEN, model.config.vocab_size, device=DEVICE)
    prefix = torch.arange(TEACHER_PREFILL, device=DEVICE)
    slots = torch.cat([_slots(table, block_size, s, prefix) for s in range(TEACHER_SEQS)])
    metadata = _metadata([TEACHER_PREFILL] * TEACHER_SEQS, [TEACHER_PREFILL] * TEACHER_SEQS,
                         slots, table)
    hidden = model(seqs[:, :TEACHER_PREFILL].flatten(), prefix.repeat(TEACHER_SEQS), kv_caches,
                   metadata)
    last = hidden.view(TEACHER_SEQS, TEACHER_PREFILL, -1)[:, -1]
    logits[:, TEACHER_PREFILL - 1] = model.compute_logits(last)
    for pos in range(TEACHER_PREFILL, TEACHER_LEN):
        position = torch.full((TEACHER_SEQS,), pos, device=DEVICE)
        slots = torch.stack([_slots(table, block_size, s, position[:1])[0]
                             for s in range(TEACHER_SEQS)])
        metadata = _metadata([1] * TEACHER_SEQS, [pos + 1] * TEACHER_SEQS, slots, table)
        hidden = model(seqs[:, pos], position, kv_caches, metadata)
        logits[:, pos] = model.compute_logits(hidden)
    return logits


if __name__ == "__main__":
    sys.exit(main())
