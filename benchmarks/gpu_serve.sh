#!/usr/bin/env bash
# One device call: `tandem serve` on W1 (dummy qwen3-0.6b, 1024 prompts, 128 in / 512 out)
# driven by `tandem bench serve` at concurrency 256, then the offline engine on the same
# workload with the same in-flight limit (max_num_seqs 256), for the serve/offline ratio.
#   usage (device tool, carry .whl):  TANDEM_COMMIT=<sha> bash benchmarks/gpu_serve.sh
set -u
. benchmarks/device_env.sh
ENGINE=(--model dummy:qwen3-0.6b --max-num-seqs 256 --max-num-batched-tokens 16384
        --gpu-memory-utilization 0.85)

python3 -m app.cli serve "${ENGINE[@]}" --port 8000 --log-level warning \
  --max-queued-requests 4096 > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 180); do
  curl -sf -o /dev/null localhost:8000/health && break
  sleep 1
done
echo "server ready after ${SECONDS}s"
timeout 300 python3 -m app.cli bench serve --base-url http://127.0.0.1:8000 \
  --endpoint completions --num-prompts 1024 --input-len 128 --output-len 512 \
  --concurrency 256 --warmup 32 --ignore-eos --output "$OUT/serve_w1.json" 2>&1 | tail -5
curl -s localhost:8000/metrics | grep -E "^tandem:gpu_idle_fraction|^vllm:num_preemptions" > "$OUT/metrics.txt"
kill -TERM $SERVER; wait $SERVER
echo "server exit $?"

timeout 240 python3 -m app.cli bench throughput --workload W1 --arms v2 --repeats 1 \
  --max-num-seqs 256 --gpu-memory-utilization 0.85 --output "$OUT/offline_w1_seqs256.json" 2>&1 | tail -5
