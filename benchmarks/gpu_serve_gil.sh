#!/usr/bin/env bash
# Experiment (one device call): does the server's GPU idle come from GIL hand-offs? Serve W1
# (dummy qwen3-0.6b, 128 in / 512 out, concurrency 256, 512 prompts) twice, with Python's
# default GIL switch interval (5 ms) and with 0.5 ms, and compare output tok/s and GPU idle.
#   usage (device tool, carry .whl):  bash benchmarks/gpu_serve_gil.sh
set -u
. benchmarks/device_env.sh
ARGS='["serve", "--model", "dummy:qwen3-0.6b", "--max-num-seqs", "256", "--max-num-batched-tokens", "16384", "--gpu-memory-utilization", "0.85", "--port", "8000", "--log-level", "warning", "--max-queued-requests", "4096"]'
for interval in 0.005 0.0005; do
  python3 -c "import sys; sys.setswitchinterval($interval); from app.cli import main; sys.exit(main($ARGS))" \
    > "$OUT/server_$interval.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 180); do curl -sf -o /dev/null localhost:8000/health && break; sleep 1; done
  echo "switch interval $interval"
  timeout 200 python3 -m app.cli bench serve --base-url http://127.0.0.1:8000 --endpoint completions \
    --num-prompts 512 --input-len 128 --output-len 512 --concurrency 256 --warmup 16 --ignore-eos \
    --output "$OUT/serve_switch_$interval.json" 2>&1 | tail -2
  curl -s localhost:8000/metrics | grep -E "^tandem:gpu_idle_fraction" | tee "$OUT/metrics_$interval.txt"
  kill -TERM $SERVER; wait $SERVER
done
