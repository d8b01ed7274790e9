#!/usr/bin/env bash
# One device call: is the benchmark client part of what limits streamed chat at concurrency
# 256? The same server (gpu_serve_split.sh's model, tokenizer and lengths, max_num_seqs 256)
# is driven by one client process at concurrency 256 and by four client processes at 64
# each (distinct prompt seeds), interleaved A B A B; the result lands in
# $OUT/serve_clients.json (tok/s summed over clients over the longest client's duration).
#   usage (device tool, carry .whl and .tok):  TANDEM_COMMIT=<sha> bash benchmarks/gpu_serve_clients.sh
#   API_SERVERS: the API-server counts to run it with (default "1 4").
set -u
. benchmarks/device_env.sh
API_SERVERS=${API_SERVERS:-"1 4"}
TOK=.tok/qwen3
CHAT=(--endpoint chat --tokenizer "$TOK" --input-len 128 --output-len 512 --ignore-eos --temperature 1.0)

start_server() {  # start_server API_SERVERS
  python3 -m app.cli serve --model dummy:qwen3-0.6b --tokenizer "$TOK" --max-num-batched-tokens 16384 \
    --gpu-memory-utilization 0.85 --max-queued-requests 8192 --log-level warning --port 8000 \
    --max-num-seqs 256 --api-server-count "$1" > "$OUT/server_api$1.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do
    curl -sf -o /dev/null localhost:8000/health && return 0
    kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/server_api$1.log"; return 1; }
    sleep 0.5
  done
  return 1
}

client() {  # client NAME SEED CONCURRENCY NUM_PROMPTS
  python3 -m app.cli bench serve --base-url http://127.0.0.1:8000 "${CHAT[@]}" --seed "$2" \
    --concurrency "$3" --num-prompts "$4" --warmup 8 --output "$OUT/runs/$1.json" > /dev/null 2>&1
}

mkdir -p "$OUT/runs"
for servers in $API_SERVERS; do
  echo "=== $servers API server(s) ($(date +%T))"
  start_server "$servers" || exit 1
  for round in 1 2; do
    client "api${servers}_one_r$round" "$round" 256 1024
    for i in 1 2 3 4; do client "api${servers}_four_r${round}_c$i" "$((round * 10 + i))" 64 256 & done
    for pid in $(jobs -p); do [[ $pid == "$SERVER" ]] || wait "$pid"; done
  done
  kill -TERM $SERVER; wait $SERVER
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); runs = {}
for path in sorted((out / "runs").glob("*.json")):
    level = json.loads(path.read_text())["levels"][0]
    key = path.stem.rsplit("_c", 1)[0] if "_four_" in path.stem else path.stem
    runs.setdefault(key, []).append(level)
summary = {}
for key, levels in runs.items():
    tokens = sum(lv["total_output_tokens"] for lv in levels)
    seconds = max(lv["duration_s"] for lv in levels)
    summary[key] = {"clients": len(levels), "output_tok_s": round(tokens / seconds, 1),
                    "failed": sum(lv["failed"] for lv in levels),
                    "ttft_ms_p50_median_over_clients": round(statistics.median(
                        lv["ttft"]["p50_ms"] for lv in levels), 1)}
    print(f"{key:24s} {summary[key]}")
(out / "serve_clients.json").write_text(json.dumps(summary, indent=1))
PY
