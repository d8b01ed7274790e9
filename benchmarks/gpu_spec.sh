#!/usr/bin/env bash
# One device call for ngram speculative decoding on the H200, dummy qwen3-0.6b weights
# (random: drafts are almost never accepted, so this measures what speculating costs).
#   1. correctness: the speculative kernels against their references on CUDA
#      (spec post-update, rejection sampling / acceptance, ngram proposer);
#   2. greedy outputs with speculation equal those without, token for token, at
#      concurrency 1 and 32 (V2 with CUDA graphs) - checked by bench_spec before timing;
#   3. TPOT with and without speculation at concurrency 1 and 32 (target at 32: <= +10%).
# Results land in $OUT (spec_h200.json, spec.log); the table is printed at the end.
#   wheels to carry in .whl: what device_env.sh already carries (no tokenizer is needed).
#   usage (device tool, carry .whl):  bash benchmarks/gpu_spec.sh
set -u
. benchmarks/device_env.sh
LOG="$OUT/spec.log"
export PYTHONFAULTHANDLER=1
python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_spec_post_update.py \
  tests/kernels/test_rejection_sample.py tests/kernels/test_accept_draft_prefix.py \
  tests/kernels/test_ngram_propose.py 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "kernel checks failed: no timings" | tee -a "$LOG"; exit 1; }
timeout -s ABRT 480 python3 -m benchmarks.bench_spec --model dummy:qwen3-0.6b --device cuda \
  --concurrency 1 32 --max-tokens 256 --repeats 2 --output "$OUT/spec_h200.json" 2>&1 \
  | grep -v '\[info' | tee -a "$LOG"
