"""Constrained greedy decoding on the device: V1 and V2 (CUDA graphs on) must give the same
tokens, every output must validate, and prompt logprobs must agree between the runners.

    python benchmarks/grammar_parity.py --model dummy:qwen3-0.6b --tokenizer .tok/qwen3 \\
        --out parity.json        # exit 1 on any mismatch
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from actors.protocol.structured_output import StructuredOutputSpec  # noqa: E402
from app.llm import LLM  # noqa: E402
from benchmarks.grammar_serve import PERSON, REGEX  # noqa: E402

OPTIONS = {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "max_model_len": 2048}


def main(argv: list[str] | None = None) -> int:
    import jsonschema

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:qwen3-0.6b")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--dtype", default="float32",
                        help="float32 for token-for-token parity (bf16 near-ties part V1/V2)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    v2 = LLM(args.model, tokenizer=args.tokenizer, runner="v2", dtype=args.dtype, **OPTIONS)
    v1 = LLM(args.model, reuse=v2, runner="v1", dtype=args.dtype, **OPTIONS)
    prompts = [f"Describe person number {i} as JSON." for i in range(24)]
    person = StructuredOutputSpec("json", json.dumps(PERSON))
    regex = StructuredOutputSpec("regex", REGEX)
    params = [SamplingParams(temperature=0.0, max_tokens=256, prompt_logprobs=2 if i == 0 else None,
                             structured_output=person if i % 3 else regex)
              for i in range(len(prompts))]
    params[5] = SamplingParams(temperature=0.0, max_tokens=64)  # free, in the same batches
    outputs = {name: llm.generate(prompts, params) for name, llm in (("v2", v2), ("v1", v1))}
    same_tokens = [a.outputs[0].token_ids == b.outputs[0].token_ids
                   for a, b in zip(outputs["v2"], outputs["v1"])]
    mismatches = [_divergence(i, params[i], outputs["v2"][i], outputs["v1"][i])
                  for i, same in enumerate(same_tokens) if not same]
    free = [SamplingParams(temperature=0.0, max_tokens=256) for _ in prompts]
    free_same = [a.outputs[0].token_ids == b.outputs[0].token_ids
                 for a, b in zip(v2.generate(prompts, free), v1.generate(prompts, free))]
    invalid = []
    for i, output in enumerate(outputs["v2"]):
        text, spec = output.outputs[0].text, params[i].structured_output
        try:
            if spec is person:
                jsonschema.validate(json.loads(text), PERSON)
            elif spec is regex and re.fullmatch(REGEX, text) is None:
                raise ValueError("regex mismatch")
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            invalid.append({"index": i, "text": text[:200], "error": str(exc)[:200]})
    prompt_gap = max(abs(a.logprob - b.logprob) for a, b in zip(
        outputs["v2"][0].prompt_logprobs[1:], outputs["v1"][0].prompt_logprobs[1:]))
    result = {"num_requests": len(prompts), "num_same_tokens": sum(same_tokens),
              "invalid": invalid, "max_prompt_logprob_gap": prompt_gap,
              "mismatches": mismatches, "num_same_tokens_free": sum(free_same),
              "example": outputs["v2"][1].outputs[0].text[:200]}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"parity: {sum(same_tokens)}/{len(prompts)} identical V1/V2 "
          f"(without grammars {sum(free_same)}/{len(prompts)}), {len(invalid)} invalid, "
          f"prompt logprob gap {prompt_gap:.2e}, e.g. {result['example'][:60]!r}")
    return 0 if all(same_tokens) and not invalid and prompt_gap < 0.05 else 1


def _divergence(index: int, params: SamplingParams, v2_output, v1_output) -> dict:
    """Where two greedy outputs part: the position and both tokens."""
    a, b = v2_output.outputs[0].token_ids, v1_output.outputs[0].token_ids
    position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    spec = params.structured_output
    return {"index": index, "kind": spec.kind if spec else "free", "position": position,
            "v2_len": len(a), "v1_len": len(b), "v2_token": a[position:position + 1],
            "v1_token": b[position:position + 1]}


if __name__ == "__main__":
    sys.exit(main())
