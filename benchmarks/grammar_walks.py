"""Random walks under a structured-output grammar, without a model: each step fills the
masks of every live walk (as the engine does), then each walk takes a uniformly random
allowed token. Reports walks that found no allowed token, whose token the matcher
refused, or that ended early (the grammar complete). A probe for failures of the grammar
library itself under long, odd outputs (what random weights produce under a mask).

    python benchmarks/grammar_walks.py --tokenizer .tok/qwen3/tokenizer.json \
        --walks 256 --steps 512 --out walks.json

The schema is the serve benchmark's (benchmarks/grammar_serve.py, throughput_schema).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from actors.core.grammar import GrammarCompiler, GrammarMatcher, allocate_bitmask  # noqa: E402
from actors.protocol.structured_output import StructuredOutputSpec  # noqa: E402
from benchmarks.grammar_serve import throughput_schema  # noqa: E402


def walk(compiler: GrammarCompiler, spec: StructuredOutputSpec, num_walks: int, num_steps: int,
         seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    matchers: list[GrammarMatcher | None] = [compiler.matcher(spec) for _ in range(num_walks)]
    mask = allocate_bitmask(num_walks, compiler.vocab_size)
    failures: list[dict[str, object]] = []
    num_complete = 0
    for step in range(num_steps):
        live = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not live:
            break
        compiler.fill_bitmasks(live, mask)
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :compiler.vocab_size]
        for matcher, i in live:
            allowed = np.flatnonzero(bits[i])
            token = int(rng.choice(allowed)) if allowed.size else -1
            if token < 0 or not matcher.accept_token(token):
                failures.append({"walk": i, "step": step, "token": token, "error": matcher.error})
                matchers[i] = None
            elif matcher.is_terminated:
                num_complete += 1
                matchers[i] = None
    return {"num_walks": num_walks, "num_steps": num_steps, "seed": seed,
            "num_complete_early": num_complete, "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json")
    parser.add_argument("--max-length", type=int, default=None,
                        help="bound the schema's strings (maxLength), as the serve benchmark can")
    parser.add_argument("--vocab-size", type=int, default=151936, help="the model's logits width")
    parser.add_argument("--eos", type=int, nargs="+", default=[151645, 151643])
    parser.add_argument("--walks", type=int, default=256)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    schema = throughput_schema(args.max_length)
    compiler = GrammarCompiler(args.tokenizer.read_text(), args.vocab_size, args.eos)
    started = time.perf_counter()
    result = walk(compiler, StructuredOutputSpec("json", json.dumps(schema)), args.walks,
                  args.steps, args.seed)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["command"] = "python " + " ".join(sys.argv)
    print(f"{args.walks} walks of up to {args.steps} tokens: {len(result['failures'])} failed, "
          f"{result['num_complete_early']} complete early ({result['seconds']} s)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
