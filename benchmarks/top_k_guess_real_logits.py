"""How often the threshold search's guessed top-k cut holds on a real language model's
logits: the embedded model (SmolLM2-135M-Instruct, transformers on its GGUF, CPU) scores
its own greedy answers to a few chat prompts, and for each position and k the count of
tokens above the cut the search would guess (kernels/_threshold_guess.start_top_k: mean
+ std * the normal quantile with 1.5 k + 32 tokens above it) must lie in [k, CAPACITY] for
the one-pass path to resolve the row.

    python benchmarks/top_k_guess_real_logits.py --out benchmarks/results/gpu_step/top_k_guess_real_logits.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from app.llm import LLM  # noqa: E402
from kernels._threshold_guess import MAX_GUESSED_TOP_K  # noqa: E402
from kernels._threshold_search import CAPACITY  # noqa: E402
from tests._hf_reference import hf_reference_model  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Give me a tip for learning to code.", "Explain photosynthesis in detail."]


def answer_logits(llm: LLM, model, prompt: str, max_tokens: int) -> torch.Tensor:
    """[positions, vocab] float32: the logits before each token of the greedy answer."""
    ids = llm.tokenizer.encode(llm.apply_chat_template(prompt))
    answer = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    full = ids + list(answer[0].outputs[0].token_ids)
    with torch.inference_mode():
        return model(torch.tensor([full])).logits[0, len(ids) - 1:-1].float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    llm = LLM("default", runner="v2", max_model_len=512, max_num_seqs=4)
    model = hf_reference_model()
    logits = torch.cat([answer_logits(llm, model, p, args.max_tokens) for p in PROMPTS])
    num_rows, vocab = logits.shape
    by_k = {}
    for top_k in (1, 20, 50, 100, MAX_GUESSED_TOP_K):
        expected = 1.5 * top_k + 32
        cut = logits.mean(1) + NormalDist().inv_cdf(1 - expected / vocab) * logits.std(1)
        counts = (logits > cut[:, None]).sum(1)
        by_k[top_k] = {"expected_above": expected,
                       "rows_resolved_in_one_pass": int(((counts >= top_k) & (counts <= CAPACITY)).sum()),
                       "count_above_median": int(counts.median()), "count_above_min": int(counts.min()),
                       "count_above_max": int(counts.max())}
        print(top_k, by_k[top_k])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    args.out.write_text(json.dumps({
        "what": __doc__.split("\n\n")[0], "commit": commit,
        "hardware": f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
        "command": "python benchmarks/top_k_guess_real_logits.py --out " + str(args.out),
        "workload": {"model": "embedded SmolLM2-135M-Instruct (float32)", "prompts": PROMPTS,
                     "max_tokens": args.max_tokens, "num_rows": num_rows, "vocab": vocab,
                     "temperature": "1 (the fit scales with temperature, so the counts do not change)"},
        "capacity": CAPACITY, "by_top_k": by_k}, indent=1))


if __name__ == "__main__":
    main()
