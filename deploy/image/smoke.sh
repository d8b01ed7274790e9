#!/usr/bin/env bash
# Runs a built tandem image and checks what the Dockerfile promises.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=deploy/image/engine.sh
source "$HERE/engine.sh"

usage() {
    cat <<EOF
Usage: deploy/image/smoke.sh [--help] IMAGE

Starts IMAGE and checks, in order:
  - its config: USER 10001:10001, a HEALTHCHECK (podman keeps one only in docker format),
    STOPSIGNAL SIGTERM;
  - /health answers 200 (the model loaded; the time it took is printed);
  - GET /v1/models, one chat completion, one streamed chat completion ([DONE] at the end);
  - every process in the container runs as uid 10001;
  - the image's own HEALTHCHECK passes;
  - a plain stop (the engine's default grace, 10 s) while a stream is in flight: the drain
    ends it (finish_reason "abort" after TANDEM_SHUTDOWN_TIMEOUT, 5 s by default) and the
    container exits 0 before the grace runs out (137 would mean SIGKILL);
and prints the image's size. Needs curl and python3 here.

Environment:
  SMOKE_PORT          host port for the container's 8000 (default: a free one)
  SMOKE_NETWORK       "host": run on the host's network instead of publishing a port
                      (for hosts whose container networking cannot forward ports)
  SMOKE_LOAD_TIMEOUT  seconds to wait for /health 200 (default 600, the HEALTHCHECK's
                      start period)
  SMOKE_RUN_OPTS      more options for the run command, e.g. "--gpus all" (docker) or
                      "--device nvidia.com/gpu=all" (podman) for the GPU image
$ENGINE_ENV_HELP
EOF
}

case ${1:-} in
-h | --help) usage; exit 0 ;;
"" | -*) usage >&2; exit 2 ;;
esac
image=$1

engine_init
name=tandem-smoke-$$
work=$(mktemp -d)
stream_pid=""
cleanup() {
    [[ -n $stream_pid ]] && kill "$stream_pid" 2>/dev/null
    "${ENGINE_CMD[@]}" rm -f "$name" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*" >&2
    echo "--- last container logs:" >&2
    "${ENGINE_CMD[@]}" logs --tail 40 "$name" >&2 2>&1 || true
    exit 1
}
ok() { echo "ok: $*"; }

inspect_image() { "${ENGINE_CMD[@]}" image inspect --format "$1" "$image"; }
inspect() { "${ENGINE_CMD[@]}" inspect --format "$1" "$name"; }

json() {  # json EXPRESSION < document: prints EXPRESSION evaluated on the parsed `d`
    python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"
}

# ---- the image's configuration
user=$(inspect_image '{{.Config.User}}')
[[ $user == 10001:10001 ]] || fail "image USER is '$user', not 10001:10001"
health=$(inspect_image '{{json .Config.Healthcheck}}')
[[ $health == *health* ]] || fail "image has no HEALTHCHECK (podman: build with --format docker)"
signal=$(inspect_image '{{.Config.StopSignal}}')
[[ -z $signal || $signal == SIGTERM ]] || fail "image STOPSIGNAL is $signal, not SIGTERM"
ok "image config: USER $user, HEALTHCHECK, STOPSIGNAL ${signal:-SIGTERM (default)}"

# ---- start it
port=${SMOKE_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
run_opts=()
read -ra run_opts <<<"${SMOKE_RUN_OPTS:-}"
if [[ ${SMOKE_NETWORK:-} == host ]]; then
    run_opts+=(--network host -e "TANDEM_PORT=$port")
else
    run_opts+=(-p "127.0.0.1:$port:8000")
fi
url=http://127.0.0.1:$port
start=$SECONDS
"${ENGINE_CMD[@]}" run -d --name "$name" "${RUN_OPTS[@]}" "${run_opts[@]}" "$image" >/dev/null

deadline=$((SECONDS + ${SMOKE_LOAD_TIMEOUT:-600}))
until [[ $(curl -s -o /dev/null -w '%{http_code}' "$url/health" || true) == 200 ]]; do
    [[ $(inspect '{{.State.Running}}') == true ]] || fail "the container exited before /health 200"
    ((SECONDS < deadline)) || fail "/health not 200 within ${SMOKE_LOAD_TIMEOUT:-600} s"
    sleep 0.5
done
ok "/health 200 after $((SECONDS - start)) s"

# ---- the API
model=$(curl -fsS "$url/v1/models" | json 'd["data"][0]["id"]') || fail "GET /v1/models"
ok "model: $model"

body='{"model": "'"$model"'", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0}'
answer=$(curl -fsS "$url/v1/chat/completions" -H 'Content-Type: application/json' -d "$body") ||
    fail "chat completion"
content=$(json 'd["choices"][0]["message"]["content"]' <<<"$answer")
[[ -n $content ]] || fail "empty chat completion: $answer"
ok "chat completion: ${content//$'\n'/ }"

curl -fsS -N "$url/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "${body%\}}, \"stream\": true}" >"$work/stream" || fail "streamed chat completion"
chunks=$(grep -c '^data: {' "$work/stream" || true)
[[ $(grep '^data: ' "$work/stream" | tail -n1) == "data: [DONE]" && $chunks -gt 1 ]] ||
    fail "streamed chat completion did not end with [DONE]: $(tail -c 300 "$work/stream")"
ok "streamed chat completion: $chunks chunks, then [DONE]"

# ---- non-root: every process, tini (PID 1) and the server included
uids=$("${ENGINE_CMD[@]}" exec "$name" sh -c 'grep -h "^Uid:" /proc/[0-9]*/status' |
    awk '{print $2, $3, $4, $5}' | tr ' ' '\n' | sort -u | tr '\n' ' ')
[[ $uids == "10001 " ]] || fail "processes run as uids: $uids"
ok "every process runs as uid 10001"

# ---- the image's HEALTHCHECK itself (curl inside, TANDEM_PORT)
if [[ $ENGINE == podman ]]; then
    "${ENGINE_CMD[@]}" healthcheck run "$name" || fail "podman healthcheck run"
else
    until [[ $(inspect '{{.State.Health.Status}}') == healthy ]]; do
        [[ $(inspect '{{.State.Health.Status}}') != unhealthy ]] || fail "container unhealthy"
        sleep 1
    done
fi
ok "HEALTHCHECK passes"

# ---- drain on a plain stop, a stream in flight
long='{"model": "'"$model"'", "messages": [{"role": "user", "content": "Count to ten thousand."}], "max_tokens": 4000, "ignore_eos": true, "stream": true}'
curl -sS -N "$url/v1/chat/completions" -H 'Content-Type: application/json' -d "$long" \
    >"$work/long" 2>"$work/long.err" &
stream_pid=$!
for _ in $(seq 100); do
    grep -q '^data: {' "$work/long" 2>/dev/null && break
    sleep 0.1
done
grep -q '^data: {' "$work/long" || fail "the long stream sent nothing"
stop_start=$(date +%s.%N)
"${ENGINE_CMD[@]}" stop "$name" >/dev/null
stop_s=$(python3 -c "import time; print(f'{time.time() - $stop_start:.1f}')")
wait "$stream_pid" || true
stream_pid=""
code=$(inspect '{{.State.ExitCode}}')
finish=$(grep -o '"finish_reason":"[a-z_]*"' "$work/long" | tail -n1 | cut -d'"' -f4)
last=$(grep '^data: ' "$work/long" | tail -n1)
[[ $code == 0 ]] || fail "exit code $code after stop (${stop_s} s): 137 is a SIGKILL, the drain overran"
[[ $last == "data: [DONE]" ]] || fail "the in-flight stream broke off instead of ending: $(tail -c 300 "$work/long")"
ok "stop with a stream in flight: exit 0 after ${stop_s} s; the stream ended with finish_reason ${finish:-none}, then [DONE]"

size=$(inspect_image '{{.Size}}')
echo "image $image: $((size / 1000000)) MB ($(awk -v s="$size" 'BEGIN {printf "%.2f", s / 2^30}') GiB)"
