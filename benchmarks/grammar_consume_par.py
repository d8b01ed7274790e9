"""Advancing a batch of grammar matchers by one token each: the engine's serial loop
(GrammarMatcher.accept_token, as Scheduler.update_from_step calls it) against llguidance's
parallel consume_token_par, on 256 matchers of the throughput schema advanced by random
allowed tokens (as random weights sample them). Alternating steps use either way, so both
meet the same kind of states.

    python benchmarks/grammar_consume_par.py --tokenizer .tok/qwen3 --out consume.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import llguidance
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.core.grammar import allocate_bitmask  # noqa: E402
from benchmarks.grammar_fill_threads import (  # noqa: E402
    add_batch_arguments,
    random_allowed,
    throughput_matchers,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_batch_arguments(parser, num_steps=60, threads=[1, 2])
    args = parser.parse_args()
    compiler, matchers = throughput_matchers(args)
    bitmask = allocate_bitmask(args.num_rows, args.vocab_size)
    executors = {f"par_{n}": llguidance.LLExecutor(num_threads=n) for n in args.threads}
    arms = ["serial", *executors]
    times_ms: dict[str, list[float]] = {arm: [] for arm in arms}
    rng = np.random.default_rng(0)
    for step in range(args.num_steps):
        compiler.fill_bitmasks([(m, row) for row, m in enumerate(matchers)], bitmask)
        tokens = random_allowed(bitmask, args.vocab_size, rng)
        arm = arms[step % len(arms)]
        started = time.perf_counter()
        if arm == "serial":
            accepted = [m.accept_token(t) for m, t in zip(matchers, tokens)]
        else:
            accepted = executors[arm].consume_token_par(
                [(m._matcher, t) for m, t in zip(matchers, tokens)])
        times_ms[arm].append((time.perf_counter() - started) * 1e3)
        assert all(accepted)
    medians = {arm: round(float(np.median(ms)), 3) for arm, ms in times_ms.items()}
    print(medians)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    args.out.write_text(json.dumps({
        "what": __doc__.split("\n\n")[0], "commit": commit,
        "hardware": f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "command": "python benchmarks/grammar_consume_par.py " + " ".join(sys.argv[1:]),
        "workload": {"num_rows": args.num_rows, "num_steps": args.num_steps,
                     "schema": "throughput_schema()", "vocab_size": args.vocab_size},
        "median_ms_per_batch": medians, "times_ms": times_ms}, indent=1))


if __name__ == "__main__":
    main()
