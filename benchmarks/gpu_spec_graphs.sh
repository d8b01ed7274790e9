#!/usr/bin/env bash
# One device call for the speculative tail CUDA graphs (gpu/spec_decode/spec_graphs.py) on
# the H200, dummy qwen3-0.6b weights, K=4:
#   1. correctness on CUDA: the spec / draft / graph tests of tests/gpu (real captures:
#      the tail graphs against the eager tail step by step, the step graphs against an
#      eager runner) and spec_post_update's padded launch against its reference;
#   2. greedy equality in float32: speculation with the tail graphs, and with the tail
#      launched eagerly, token for token equal to no speculation at concurrency 1 and 32
#      (bench_spec checks before timing and stops at a difference);
#   3. bf16 TPOT, off / on (graphs) / on_eager_tail, at concurrency 1 and 32: greedy
#      (temperature 0, random weights repeat: drafts often accepted) and seeded sampling
#      (temperature 1: nearly nothing accepted). Target: 'on' within +10% of 'off' at 32.
# Results land in $OUT (spec_fp32.json, spec_bf16_t0.json, spec_bf16_t1.json,
# spec_graphs.log); the tables are printed at the end.
#   wheels to carry in .whl: what device_env.sh already carries (no tokenizer is needed).
#   usage (device tool, carry .whl .tok):  [REPEATS=2] [EAGER_ARM= (no eager-tail arm)] bash benchmarks/gpu_spec_graphs.sh
set -u
. benchmarks/device_env.sh
LOG="$OUT/spec_graphs.log"
export PYTHONFAULTHANDLER=1
timeout -s ABRT 200 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "spec or draft or graph" \
  tests/kernels/test_spec_post_update.py 2>&1 | tail -25 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "CUDA tests failed: no timings" | tee -a "$LOG"; exit 1; }
# Keep the graph capture lines (sizes, seconds, memory), drop the other info lines.
keep() { awk '!/\[info/ || /graphs_captured/'; }
BENCH="python3 -m benchmarks.bench_spec --model dummy:qwen3-0.6b --device cuda --concurrency 1 32 --max-tokens 128 ${EAGER_ARM---eager-tail-arm}"
timeout -s ABRT 130 $BENCH --dtype float32 --repeats 1 --output "$OUT/spec_fp32.json" 2>&1 \
  | keep | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "float32 greedy check failed: no bf16 timings" | tee -a "$LOG"; exit 1; }
for T in 0 1; do
  echo "== bf16, temperature $T" | tee -a "$LOG"
  timeout -s ABRT $((50 * ${REPEATS:-2} + 20)) $BENCH --dtype bfloat16 --no-check --repeats ${REPEATS:-2} --temperature $T \
    --output "$OUT/spec_bf16_t$T.json" 2>&1 | keep | tee -a "$LOG"
done
