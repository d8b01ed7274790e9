"""How the batch mask fill scales with the grammar library's threads: 256 matchers of the
throughput schema, advanced by random allowed tokens (as random weights sample them). Per
step, the first fill of the new states (which builds the library's lexer cache for them,
as every fill inside the engine does) is timed apart as "cold", then one warm fill of the
whole batch per thread count.

    python benchmarks/grammar_fill_threads.py --tokenizer .tok/qwen3 --out fill.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.core.grammar import GrammarCompiler, GrammarMatcher, allocate_bitmask  # noqa: E402
from actors.protocol.structured_output import StructuredOutputSpec  # noqa: E402
from benchmarks.grammar_serve import throughput_schema  # noqa: E402


def add_batch_arguments(parser: argparse.ArgumentParser, num_steps: int,
                        threads: list[int]) -> None:
    """The options of a benchmark over a batch of throughput-schema matchers."""
    parser.add_argument("--tokenizer", required=True, help="a tokenizer directory")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--eos-token-id", type=int, default=151645, help="Qwen3 <|im_end|>")
    parser.add_argument("--num-rows", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=num_steps)
    parser.add_argument("--threads", type=int, nargs="+", default=threads)
    parser.add_argument("--out", type=Path, required=True)


def throughput_matchers(args: argparse.Namespace, max_length: int | None = None
                        ) -> tuple[GrammarCompiler, list[GrammarMatcher]]:
    """A compiler for the tokenizer of `args` and args.num_rows fresh matchers of the
    throughput schema."""
    tokenizer_json = (Path(args.tokenizer) / "tokenizer.json").read_text()
    compiler = GrammarCompiler(tokenizer_json, args.vocab_size, [args.eos_token_id])
    spec = StructuredOutputSpec("json", json.dumps(throughput_schema(max_length)))
    return compiler, [compiler.matcher(spec) for _ in range(args.num_rows)]


def random_allowed(bitmask: np.ndarray, vocab_size: int, rng: np.random.Generator) -> list[int]:
    """One token per row that the row of `bitmask` ([rows, words] int32) allows."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return [int(rng.choice(np.flatnonzero(row[:vocab_size]))) for row in bits]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_batch_arguments(parser, num_steps=64, threads=[1, 2, 4, 8, 16])
    parser.add_argument("--max-length", type=int, default=None,
                        help="bound the schema's strings (maxLength): the library's slow case")
    args = parser.parse_args(argv)
    compiler, matchers = throughput_matchers(args, args.max_length)
    executors = {n: llguidance.LLExecutor(num_threads=n) for n in args.threads}
    executors[0] = llguidance.LLExecutor()  # the library's default
    times_ms: dict[int, list[float]] = {n: [] for n in executors}
    cold_ms: list[float] = []
    pairs = [(m._matcher, row) for row, m in enumerate(matchers)]
    bitmask = allocate_bitmask(args.num_rows, args.vocab_size)
    rng = np.random.default_rng(0)
    for _ in range(args.num_steps):
        # The first fill of a state also builds the library's lexer cache for it, as
        # every fill in the engine does: that one is timed apart ("cold"), so every other
        # fill finds the same warm cache.
        started = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(executors[0], pairs, bitmask)
        cold_ms.append((time.perf_counter() - started) * 1e3)
        for n, executor in executors.items():
            started = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask_par(executor, pairs, bitmask)
            times_ms[n].append((time.perf_counter() - started) * 1e3)
        for matcher, token in zip(matchers, random_allowed(bitmask, args.vocab_size, rng)):
            matcher.accept_token(token)
    result = {"num_rows": args.num_rows, "num_steps": args.num_steps, "cpus": os.cpu_count(),
              "max_length": args.max_length,
              "fill_ms": {("default" if n == 0 else str(n)): {
                  "p50": float(np.median(t)), "p90": float(np.percentile(t, 90)),
                  "mean": float(np.mean(t))} for n, t in times_ms.items()}}
    result["cold_fill_ms_default_threads"] = {"p50": float(np.median(cold_ms)),
                                              "p90": float(np.percentile(cold_ms, 90)),
                                              "mean": float(np.mean(cold_ms))}
    args.out.write_text(json.dumps(result, indent=2))
    cold = result["cold_fill_ms_default_threads"]
    print(f"cold (first fill of each state, default threads) p50 {cold['p50']:6.2f} "
          f"p90 {cold['p90']:6.2f}; warm below")
    for name, stats in result["fill_ms"].items():
        print(f"threads {name:8s} fill ms p50 {stats['p50']:6.2f} p90 {stats['p90']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
