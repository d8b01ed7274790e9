#!/usr/bin/env bash
# guidellm against `tandem serve` with a tokenizer that `tandem export-tokenizer` wrote: the
# offline path for a benchmark client that needs a Hugging Face tokenizer of the served
# model (the embedded model has no hub id). guidellm needs torch and transformers of its own,
# so it lives in its own environment:
#   python3 -m venv /tmp/glvenv && /tmp/glvenv/bin/pip install guidellm
#   GUIDELLM=/tmp/glvenv/bin/guidellm OUT=/tmp/gl bash benchmarks/guidellm_check.sh
# Writes $OUT/guidellm.json (guidellm's report) and $OUT/guidellm_summary.json.
set -eu
GUIDELLM=${GUIDELLM:-guidellm}
OUT=${OUT:-/tmp/tandem_guidellm}
PORT=${PORT:-8123}
MODEL=${MODEL:-default}
mkdir -p "$OUT"
rm -rf "$OUT/tokenizer"
tandem export-tokenizer --model "$MODEL" "$OUT/tokenizer"
tandem serve --model "$MODEL" --port "$PORT" --log-level warning > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' EXIT
for _ in $(seq 1 240); do curl -sf -o /dev/null "localhost:$PORT/health" && break; sleep 0.5; done
SERVED=$(curl -s "localhost:$PORT/v1/models" | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
"$GUIDELLM" run --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=$SERVED" \
  --tokenizer "kind=hf_auto,model=$OUT/tokenizer" \
  --data kind=synthetic_text,prompt_tokens=64,output_tokens=16 \
  --profile kind=concurrent,streams=4 --constraint kind=max_requests,count=12 \
  --output "kind=json,path=$OUT/guidellm.json" --disable-console-interactive > "$OUT/guidellm.log" 2>&1
curl -s "localhost:$PORT/metrics" > "$OUT/metrics.txt"
python3 - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
bench = json.load(open(f"{out}/guidellm.json"))["benchmarks"][0]
metrics = open(f"{out}/metrics.txt").read()
def counter(name):
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))
totals = bench["metrics"]["request_totals"]
summary = {
    "requests": {k: totals[k] for k in ("successful", "errored", "incomplete")},
    "guidellm_prompt_tokens": bench["metrics"]["prompt_token_count"]["successful"]["total_sum"],
    "guidellm_output_tokens": bench["metrics"]["output_token_count"]["successful"]["total_sum"],
    "server_prompt_tokens": counter("vllm:prompt_tokens_total"),
    "server_generation_tokens": counter("vllm:generation_tokens_total"),
}
json.dump(summary, open(f"{out}/guidellm_summary.json", "w"), indent=2)
print(json.dumps(summary))
ok = summary["requests"]["successful"] > 0 and not summary["requests"]["errored"]
sys.exit(0 if ok else 1)
PY
