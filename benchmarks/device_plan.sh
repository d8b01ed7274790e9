#!/usr/bin/env bash
# The open issues' GPU runs in groups ("plans"), each short enough to share one device call
# (600 s) with another: device time is scarce, and a call that starts a machine pays minutes.
#
#   bash benchmarks/device_plan.sh lane spec       # run on the GPU machine, in order
#
# Plans (seconds each took on one H100 at 296bdea):
#   lane   the GPU lane, its 4 parts side by side (.ci/gpu-lane run --parts-at-once 4; 3 parts
#          took 115-175 s at 296bdea, and ran part 1 out of its 300 s at 8f15722)
#   spec   issue 33: speculative decoding, float32 token check and bf16 timings (~150)
#   fp8    issue 26: W3 FP8 batch 1 and offline, FP8 KV, qwen3-32b FP8 batch 1 (~130 without
#          the offline runs' kernel profiles, which say where W3 FP8's offline step goes)
#   moe    issue 25: W4 (gpt-oss-20b), W5 (qwen3-30b-a3b) batch 1 and offline, gpt-oss-120b
#          batch 1, W4 offline with --mxfp4-copy fp8 and bf16, W5 offline with FP8 experts
#          (--quantization fp8) (~150 without the 120b, the copies and W5's FP8)
#   fp8_copy  issue 25: W4 batch 1 and offline with --mxfp4-copy fp8; for an A/B of two trees
#          run it with BASELINE=DIR (device_run.sh runs each step on DIR's engine first)
#   moe_tiles  issue 25: one gpt-oss-20b MoE layer at 1-4,096 tokens, every tile shape of the
#          sweep (benchmarks/moe.py SWEEP); the same layer with bf16 experts, and with FP8
#          per-channel ones (what --mxfp4-copy fp8 multiplies) swept too; qwen3-30b-a3b's
#          layer swept
#   fp8_gemv_ncu  issue 26: Nsight Compute's counters (throughput, stalls, occupancy) for one
#          gate/up call of each GEMV kernel (benchmarks/fp8_gemv_ncu.py; NCU names the binary)
#   fp8_gemv  issue 26: the FP8 GEMV at batch 1 on llama-3.1-8b's and qwen3-32b's projections
#          (FP8_GEMV_MODELS picks), weights read from HBM, with a tile sweep
#   tiers  issue 29: the host tier on dummy qwen3-0.6b: unlimited, limited, limited + host,
#          and unlimited without the answers' reuse (--no-prefix-caching-outputs) (~220)
#   tiers8b  issue 29: the host tier on dummy llama-3.1-8b, 64 conversations (what an H100's
#          KV pool holds) sent as token ids (its random answers do not survive a text round
#          trip): unlimited, 10,000 blocks, the same plus 32 GB of host tier, unlimited
#          without the answers' reuse
#   serve_moe  issue 25: the streamed chat of W4 and W5 (real tokenizers) at 64 and 256 clients
#   hf_moe  issue 25: W4 and W5 offline against transformers' static generate, same weights
# Each plan writes into its own folder and leaves one archive, $OUT/<plan>.tgz: a call brings
# back at most 8 files. Each step has its own time limit, so a slow step costs only itself,
# and no step runs past PLAN_BUDGET_S (default 570) from the start: the call's own limit
# (600 s) would kill the plan before it leaves its archive. A step cut short or skipped says so;
# SKIP_STEPS="w4 w5_b1" leaves out the steps so named (what an earlier call measured already);
# PLAN_END=$(($(date +%s) + 575)) set once holds two invocations (one with BASELINE, one
# without) to one deadline; KERNEL_PROFILE=0 drops the steps' --kernel-profile runs (the
# figures only, in about half the time: for a call that must fetch many target figures).
#
# Here, before the call (the tree travels as .lane; the lane checks it against the stamp):
#   .ci/gpu-lane prepare && rm -rf .lane && mkdir .lane && git archive HEAD | tar -x -C .lane
#   cp -r .gpu-lane .lane/ && tar -czf .lane/tok.tgz .tok/{qwen3,gptoss,llama3}
#   python -m benchmarks.recording stamp --tree .lane --commit HEAD
#   run(command="cd .lane && tar -xzf tok.tgz && bash benchmarks/device_plan.sh lane spec",
#       carry=[".lane"])        # the tokenizers travel packed: a call carries 64 MiB at most
# After it: untar each archive; `.ci/gpu-lane merge lane/part-*/gpu-lane.json`; copy the
# result files (<plan>/<result>.json) over benchmarks/results/.
set -uo pipefail
FINAL_OUT=${OUT:-/tmp/tandem_out}
mkdir -p "$FINAL_OUT"
export WHEELS=${WHEELS:-.gpu-lane/wheels}
T="python3 -m benchmarks.throughput --arms v2 --repeats 1"
ONE="--num-prompts 1 --output-len 256 --max-num-seqs 4 --gpu-memory-utilization 0.9 --kernel-profile"
SPEC="python3 -m benchmarks.spec_decode --device cuda --dtype bfloat16"
TIER_SERVER="--model dummy:qwen3-0.6b --tokenizer .tok/qwen3 --max-num-seqs 256 --max-model-len 8192"

# PLAN_END (epoch seconds) from the caller holds several invocations of one call to one end
PLAN_END=${PLAN_END:-$(($(date +%s) + ${PLAN_BUDGET_S:-570}))}

step() {  # step NAME SECONDS COMMAND...: one benchmark, its log in the plan's folder
  local name=$1 limit=$2 left=$((PLAN_END - $(date +%s) - 5))
  shift 2
  [ -z "${BASELINE:-}" ] || limit=$((limit * 2))  # an A/B runs the step on both trees
  if [[ " ${SKIP_STEPS:-} " == *" $name "* ]]; then
    echo "== $name skipped: in SKIP_STEPS"
    return
  fi
  if [ "$left" -lt 30 ]; then
    echo "== $name skipped: ${left} s left of PLAN_BUDGET_S"
    return
  fi
  if [ "${KERNEL_PROFILE:-1}" = 0 ]; then  # a profile is one more run of the benchmark
    local arg kept=()
    for arg in "$@"; do [ "$arg" = --kernel-profile ] || kept+=("$arg"); done
    set -- "${kept[@]}"
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name ($(date +%T), limit ${limit} s)"
  timeout "$limit" bash benchmarks/device_run.sh "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $?; $(grep -E 'tok/s \(|equal|TPOT|overall' "$OUT/$name.log" | tail -1 | cut -c1-150)"
}

plan_lane() {
  python3 .ci/gpu-lane run --parts-at-once 4 --budget 300 2>&1 | grep -E "passed|FAILED|ERROR"
}

plan_spec() {
  step spec_f32 90 $SPEC --model dummy:qwen3-0.6b --dtype float32 --concurrency 1 32 --check-only
  step spec_qwen3 150 $SPEC --model dummy:qwen3-0.6b --concurrency 1 32 128 --max-tokens 128
  grep -E "^ +(greedy|temperature)_c" "$OUT/spec_qwen3.log"
  step spec_llama8b 150 $SPEC --model dummy:llama-3.1-8b --concurrency 1 32 128 \
    --max-tokens 128 --repeats 1 --result spec_decode_llama8b
}

plan_fp8() {
  step w3_fp8_b1 80 $T --workload W3 $ONE --quantization fp8 --result throughput_w3_fp8_batch1
  step q32_fp8_b1 120 $T --workload W3 --model dummy:qwen3-32b $ONE --quantization fp8 \
    --result throughput_qwen3_32b_fp8_batch1
  step w3_fp8 170 $T --workload W3 --quantization fp8 --kernel-profile \
    --result throughput_w3_fp8
  step w3_fp8_kv 170 $T --workload W3 --quantization fp8 --kv-cache-dtype fp8 \
    --kernel-profile --result throughput_w3_fp8_kv
}

plan_moe() {
  step w4_b1 90 $T --workload W4 $ONE --result throughput_w4_batch1
  step w5_b1 90 $T --workload W5 $ONE --result throughput_w5_batch1
  step oss120_b1 90 $T --workload W4 --model dummy:gpt-oss-120b $ONE \
    --result throughput_gpt_oss_120b_batch1
  step w4 170 $T --workload W4 --gpu-memory-utilization 0.9 --kernel-profile \
    --result throughput_w4
  step w4_fp8_copy 170 $T --workload W4 --gpu-memory-utilization 0.9 --mxfp4-copy fp8 \
    --kernel-profile --result throughput_w4_mxfp4_fp8_copy
  step w4_bf16_copy 170 $T --workload W4 --gpu-memory-utilization 0.9 --mxfp4-copy bf16 \
    --kernel-profile --result throughput_w4_mxfp4_bf16_copy
  step w5 260 $T --workload W5 --gpu-memory-utilization 0.92 --kernel-profile \
    --result throughput_w5
  # FP8 experts halve W5's 61 GB of weights: the KV pool an H100 lacks for W5 in bf16
  step w5_fp8 200 $T --workload W5 --gpu-memory-utilization 0.9 --quantization fp8 \
    --kernel-profile --result throughput_w5_fp8
}

plan_fp8_copy() {
  step w4_fp8_copy_b1 150 $T --workload W4 $ONE --mxfp4-copy fp8 \
    --result throughput_w4_mxfp4_fp8_copy_batch1
  step w4_fp8_copy 300 $T --workload W4 --gpu-memory-utilization 0.9 --mxfp4-copy fp8 \
    --kernel-profile --result throughput_w4_mxfp4_fp8_copy
}

plan_moe_tiles() {
  step moe_tiles 200 python3 -m benchmarks.moe --model gpt-oss-20b --tokens 1,256,4096 --sweep \
    --result moe_gpt-oss-20b_tiles
  step moe_bf16 45 python3 -m benchmarks.moe --model gpt-oss-20b --expert-dtype bf16 \
    --tokens 1,256,4096 --result moe_gpt-oss-20b_bf16
  # per-channel FP8 is what --mxfp4-copy fp8 multiplies; it runs on the bf16 table's tiles
  step moe_fp8 150 python3 -m benchmarks.moe --model gpt-oss-20b --expert-dtype fp8-channel \
    --tokens 1,256,1024,4096 --sweep --result moe_gpt-oss-20b_fp8_channel
  step moe_tiles_qwen3 100 python3 -m benchmarks.moe --model qwen3-30b-a3b --tokens 1,4096 \
    --sweep --result moe_qwen3-30b-a3b_tiles
}

plan_fp8_gemv() {
  local model
  for model in ${FP8_GEMV_MODELS:-llama-3.1-8b qwen3-32b}; do
    step "gemv_$model" 270 python3 -m benchmarks.fp8_gemv --model "$model" --sweep
  done
}

plan_fp8_gemv_ncu() {
  step gemv_ncu 240 "${NCU:-ncu}" --clock-control none --nvtx --nvtx-include "profile/" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section SchedulerStats python3 -m benchmarks.fp8_gemv_ncu
}

tier_arms() {  # tier_arms NAME "SERVER FLAGS" "CLIENT FLAGS" "ARM|ITS SERVER FLAGS"...
  local prefix=$1 server=$2 client=$3 arm
  shift 3
  for arm in "$@"; do
    # shellcheck disable=SC2086  # the client flags are words
    step "${prefix}_${arm%%|*}" 150 python3 -m benchmarks.multi_turn \
      --result "multi_turn_${prefix}_${arm%%|*}" --server "$server ${arm#*|}" $client
  done
}

plan_tiers() {
  tier_arms qwen3_tiers "$TIER_SERVER" "--tokenizer .tok/qwen3 --clients 4 --think-time 2" \
    "unlimited|--gpu-memory-utilization 0.85" "limited|--num-kv-blocks 24000" \
    "host|--num-kv-blocks 24000 --kv-offload-cpu-gb 16" \
    "noreuse|--gpu-memory-utilization 0.85 --no-prefix-caching-outputs"
}

plan_tiers8b() {
  tier_arms llama8b_tiers "--model dummy:llama-3.1-8b --tokenizer .tok/llama3 --max-num-seqs 256" \
    "--tokenizer .tok/llama3 --token-ids --conversations 64 --clients 4 --think-time 2" \
    "unlimited|--gpu-memory-utilization 0.9" "limited|--num-kv-blocks 10000" \
    "host|--num-kv-blocks 10000 --kv-offload-cpu-gb 32" \
    "noreuse|--gpu-memory-utilization 0.9 --no-prefix-caching-outputs"
}

plan_serve_moe() {
  local pair name model tokenizer
  for pair in "w4|gpt-oss-20b|gptoss" "w5|qwen3-30b-a3b|qwen3"; do
    IFS='|' read -r name model tokenizer <<< "$pair"
    step "serve_$name" 160 python3 -m benchmarks.serve --result "serve_chat_$name" \
      --server "--model dummy:$model --tokenizer .tok/$tokenizer --max-num-seqs 256 \
      --max-num-batched-tokens 16384 --gpu-memory-utilization 0.9 --max-queued-requests 8192 \
      --api-server-count 4" --endpoint chat --tokenizer ".tok/$tokenizer" --input-len 128 \
      --output-len 512 --ignore-eos --temperature 1.0 --concurrency 64,256 --num-prompts 512 \
      --warmup 32 --clients 4
  done
}

plan_hf_moe() {
  # transformers keeps its own bf16 copy of gpt-oss-20b's experts (38 GB, its layout is not
  # tandem's): the benchmark frees tandem's KV cache and graphs before it builds that model
  step hf_w4 300 $T --workload W4 --arms v2,hf_static --hf-num-prompts 128 \
    --hf-batch-size 128 --gpu-memory-utilization 0.9 --result throughput_w4_hf
  step hf_w5 300 $T --workload W5 --arms v2,hf_static --hf-num-prompts 64 \
    --hf-batch-size 64 --gpu-memory-utilization 0.9 --result throughput_w5_hf
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/{/^#/p}' "$0"; exit 2; }
for plan in "$@"; do
  if ! declare -F "plan_$plan" > /dev/null; then
    echo "unknown plan $plan (lane, spec, fp8, fp8_gemv, fp8_gemv_ncu, moe, fp8_copy, moe_tiles, tiers, tiers8b, serve_moe, hf_moe)" >&2
    exit 2
  fi
done
for plan in "$@"; do
  export OUT="/tmp/device_plan/$plan"
  rm -rf "$OUT" && mkdir -p "$OUT"
  echo "=== plan $plan ($(date +%T))"
  "plan_$plan"
  tar -czf "$FINAL_OUT/$plan.tgz" -C "$OUT" .
done
