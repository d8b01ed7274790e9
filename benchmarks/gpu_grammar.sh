#!/usr/bin/env bash
# One device call for structured outputs. Phases (PHASES, default "kernel parity serve"):
#   kernel  the token-bitmask kernel against its reference on the GPU (tests/kernels);
#   parity  constrained greedy decoding on dummy qwen3-0.6b: V1 and V2 (CUDA graphs) give
#           the same tokens, outputs validate, prompt logprobs agree (grammar_parity.py);
#   library the grammar-library benchmark on the device's CPU (needs xgrammar too);
#   serve   the two-process server on dummy qwen3-0.6b bf16 with the real Qwen3 tokenizer
#           (.tok/qwen3): first every constrained output must validate (json_schema, regex,
#           choice; benchmarks/grammar_serve.py check), then 256 concurrent streamed chats,
#           128-token messages, 512 output tokens, ignore_eos, free vs json_schema, run
#           A B C B A (C: strings with maxLength, one wave of 256, reported without a
#           target); the ratio of output tok/s (target >= 0.8) goes to grammar_serve.json.
# Results land in $OUT (grammar_parity.json, grammar_check.json, grammar_serve.json, logs;
# serve_runs.tgz holds serve_*.json and the server's log).
#   wheels to carry in .whl (Python 3.12, manylinux x86_64): those of gpu_serve_split.sh
#   plus llguidance, jsonschema, jsonschema-specifications, referencing, rpds-py, attrs
#   (and xgrammar, apache-tvm-ffi for the library phase only). llguidance must be >= 1.9
#   (pyproject's bound): its wheel is tagged cp39-abi3-manylinux_2_31, a tag that a download
#   for the usual manylinux platforms skips in favour of 1.6.1 (whose API differs), so fetch
#   it by name: pip download --no-deps --only-binary=:all: llguidance==1.9.1 -d .whl
#   usage (device tool, carry .whl and .tok):  bash benchmarks/gpu_grammar.sh
set -u
. benchmarks/device_env.sh
PHASES=${PHASES:-"kernel parity serve"}
LOG="$OUT/grammar.log"
TOK=.tok/qwen3
phase() { echo "=== $* ($(date +%T), ${SECONDS}s)"; }

if [[ " $PHASES " == *" kernel "* ]]; then
  phase "token bitmask kernel"
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_token_bitmask.py 2>&1 | tee -a "$LOG"
fi
if [[ " $PHASES " == *" parity "* ]]; then
  phase "V1 / V2 parity under grammars"
  python3 benchmarks/grammar_parity.py --model dummy:qwen3-0.6b --tokenizer "$TOK" \
    --out "$OUT/grammar_parity.json" 2>&1 | grep -v '\[info' | tail -5 | tee -a "$LOG"
fi
if [[ " $PHASES " == *" library "* ]]; then
  phase "grammar libraries on the host CPU"
  python3 benchmarks/bench_grammar.py --out "$OUT/grammar_h200.json" 2>&1 | tee -a "$LOG"
fi
[[ " $PHASES " == *" serve "* ]] || exit 0

phase "server: dummy qwen3-0.6b, max_num_seqs 256"
python3 -m app.cli serve --model dummy:qwen3-0.6b --tokenizer "$TOK" --max-num-seqs 256 \
  --max-num-batched-tokens 16384 --gpu-memory-utilization 0.85 --max-queued-requests 8192 \
  --log-level warning --port 8000 > "$OUT/server_grammar.log" 2>&1 &
SERVER=$!
ready=0
for _ in $(seq 1 240); do
  curl -sf -o /dev/null localhost:8000/health && { ready=1; break; }
  kill -0 $SERVER 2>/dev/null || break
  sleep 0.5
done
[[ $ready == 1 ]] || { tail -30 "$OUT/server_grammar.log"; exit 1; }
echo "ready after ${SECONDS}s"

phase "correctness: constrained outputs validate"
if ! python3 benchmarks/grammar_serve.py check --num-requests 64 --out "$OUT/grammar_check.json"; then
  echo "constrained outputs do not validate: no timings"; kill -TERM $SERVER; wait $SERVER; exit 1
fi

python3 benchmarks/grammar_serve.py schema --out "$OUT/response_format.json"
python3 benchmarks/grammar_serve.py schema --max-length 20 --out "$OUT/response_format_bounded.json"
bench() {  # bench NAME ARGS...
  local name=$1; shift
  timeout -s INT 240 python3 -m app.cli bench serve --base-url http://127.0.0.1:8000 \
    --endpoint chat --tokenizer "$TOK" --input-len 128 --output-len 512 --ignore-eos \
    --temperature 1.0 --num-prompts 1024 --concurrency 256 --warmup 32 "$@" \
    --output "$OUT/serve_$name.json" 2>&1 | grep -E "^concurrency|rror"
}
phase "throughput, A B C B A: free, json_schema, bounded strings (one wave), json_schema, free"
bench free_1
bench json_1 --response-format "@$OUT/response_format.json"
bench bounded_1 --response-format "@$OUT/response_format_bounded.json" --num-prompts 256
bench json_2 --response-format "@$OUT/response_format.json"
bench free_2
curl -s localhost:8000/metrics | grep -E "^tandem:gpu_idle_fraction|^vllm:num_preemptions_total|^vllm:request_success_total" \
  > "$OUT/metrics_grammar.txt"
kill -TERM $SERVER; wait $SERVER; echo "server exit $?"

python3 benchmarks/grammar_serve.py ratio --free "$OUT/serve_free_1.json" "$OUT/serve_free_2.json" \
  --constrained "$OUT/serve_json_1.json" "$OUT/serve_json_2.json" \
  --bounded "$OUT/serve_bounded_1.json" --out "$OUT/grammar_serve.json"
# The device hands back a few files per call: the per-run results and logs travel as one.
(cd "$OUT" && tar czf serve_runs.tgz --remove-files serve_*.json server_grammar.log)
phase "done"
