#!/usr/bin/env bash
# One device call: install the carried wheels, run every gpu-marked test, the end-to-end
# correctness check against transformers, and (only if that passes) the benchmarks named
# in $BENCH (default: "w1-quick attention sampler"). Everything lands in $OUT.
#   usage (device tool, carry .whl):  TANDEM_COMMIT=<sha> bash benchmarks/gpu_check.sh
#   BENCH words: w1-quick | w1 | w1-tandem | w2 | w3 | attention | sampler | profile |
#                serving | none
#     profile: benchmarks/profile_step.py (kernel breakdown of decode steps, next to the
#              floor); when this checkout sits inside another tandem checkout (../gpu
#              exists), that one is profiled too, as "main" (an A/B of the same script)
#     serving: benchmarks/bench_serving_shape.py (mixed vs decode-only step times)
#   TESTS="path ..." runs only those gpu-marked tests; SKIP_TESTS=1 / SKIP_CORRECTNESS=1 skip.
#   A phase that hangs is stopped with SIGABRT, which makes Python print every thread's stack.
set -u
. benchmarks/device_env.sh
LOG="$OUT/check.log"
export PYTHONFAULTHANDLER=1
BENCH=${BENCH:-"w1-quick attention sampler"}
SKIP_TESTS=${SKIP_TESTS:-0}
SKIP_CORRECTNESS=${SKIP_CORRECTNESS:-0}
TESTS=${TESTS:-}
phase() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

phase "device"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
for _ in range(10): y.copy_(x)
e.record(); torch.cuda.synchronize()
print(f"copy bandwidth (read+write): {2 * x.numel() * 10 / (s.elapsed_time(e) * 1e-3) / 1e12:.2f} TB/s")
PY

if [ "$SKIP_TESTS" != 1 ]; then
  phase "pytest -m gpu"
  # shellcheck disable=SC2086
  timeout -s ABRT 240 python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    -k "not embedded" --tb=short $TESTS 2>&1 | tail -60 | tee -a "$LOG"
fi

if [ "$SKIP_CORRECTNESS" != 1 ]; then
  phase "correctness"
  timeout -s ABRT 200 python3 benchmarks/gpu_correctness.py --out "$OUT/correctness.json" 2>&1 \
    | grep -v '\[info' | tail -20 | tee -a "$LOG"
  if ! grep -q '"passed": true' "$OUT/correctness.json" 2>/dev/null || \
     grep -q 'CORRECTNESS FAILED' "$LOG"; then
    phase "correctness FAILED: no benchmarks"; exit 1
  fi
fi

bench() {  # bench NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  phase "bench $name"
  timeout -s ABRT "$limit" python3 -m app.cli bench throughput "$@" --output "$OUT/throughput_$name.json" \
    2>&1 | grep -v '\[info' | tail -40 | tee -a "$LOG"
}
for b in $BENCH; do
  case $b in
    w1-quick) TRITON_CACHE_DIR=/tmp/triton_cold bench w1_quick 200 --workload W1 --arms v2,v1 --repeats 1 ;;
    w1) bench w1 400 --workload W1 --repeats 2 ;;
    w1-tandem) bench w1_tandem 300 --workload W1 --arms v2,v1 --repeats 2 ;;
    profile)
      phase "profile step"
      roots=(--code-root .:branch)
      [ -f ../gpu/runner_v2/runner.py ] && roots+=(--code-root "..:main:b1,b8,mix256,b1024")
      timeout -s ABRT 330 python3 benchmarks/profile_step.py --out "$OUT/profile_step.json" \
        "${roots[@]}" 2>&1 | grep -v '\[info' | tail -60 | tee -a "$LOG" ;;
    serving)
      phase "bench serving shape"
      timeout -s ABRT 200 python3 benchmarks/bench_serving_shape.py --out "$OUT/serving_shape.json" \
        2>&1 | grep -v '\[info' | tail -8 | tee -a "$LOG" ;;
    w1-cb) bench w1_cb 240 --workload W1 --arms v2,hf_continuous --repeats 1 ;;
    w2) bench w2 200 --workload W2 --repeats 2 --arms v2,v1,hf_static --hf-batch-size 128 ;;
    w3) bench w3 260 --workload W3 --repeats 2 --arms v2,v1,hf_static ;;
    attention)
      phase "bench paged attention"
      timeout 120 python3 benchmarks/bench_paged_attention.py --sweep --out "$OUT/paged_attention.json" \
        2>&1 | tail -25 | tee -a "$LOG" ;;
    sampler)
      phase "bench sampler"
      timeout 300 python3 benchmarks/bench_sampler.py --out "$OUT/sampler.json" 2>&1 | tail -40 | tee -a "$LOG" ;;
  esac
done
phase "done"
