#!/usr/bin/env bash
# One prefill and one decode vLLM server with PdTransferConnector, and the P/D proxy in front, started by hand on
# one machine. Copy it and change the variables below (or set them in the environment).
#
#   examples/launch_pd.sh                 # starts all three, waits until they are healthy, Ctrl-C stops them
#   DRY_RUN=1 examples/launch_pd.sh       # prints the commands (and the vLLM commands they run), starts nothing
#
# Then: python examples/client.py --proxy http://127.0.0.1:8000 --decode-metrics http://127.0.0.1:8200
#
# Needs a Python environment with vLLM (pip install 'pd-transfer[vllm,proxy]', see README "With vLLM") and a
# model folder: `pd-transfer make-model .models/tiny-llama-f32` builds the tiny one used here.
set -euo pipefail

PD_TRANSFER=${PD_TRANSFER:-pd-transfer}          # the pd-transfer of the environment that has vLLM
MODEL=${MODEL:-.models/tiny-llama-f32}
HOST=${HOST:-127.0.0.1}                          # where the servers listen and decode servers reach prefills
PREFILL_PORT=${PREFILL_PORT:-8100}
PREFILL_SIDE_CHANNEL_PORT=${PREFILL_SIDE_CHANNEL_PORT:-5600}
PREFILL_CPU_BIND=${PREFILL_CPU_BIND:-0}          # VLLM_CPU_OMP_THREADS_BIND: a core each, so they do not fight
DECODE_PORT=${DECODE_PORT:-8200}
DECODE_SIDE_CHANNEL_PORT=${DECODE_SIDE_CHANNEL_PORT:-5601}
DECODE_CPU_BIND=${DECODE_CPU_BIND:-1}
PROXY_PORT=${PROXY_PORT:-8000}
LOGS=${LOGS:-/tmp/pd-transfer-example}
STARTUP_SECONDS=${STARTUP_SECONDS:-900}          # vLLM compiles its CPU graphs at start: minutes on few cores

# Every vLLM server runs kv_both; --role only names it. The side channel is where decode servers connect to pull a
# prefill's KV: the prefill returns that host and port in kv_transfer_params.
prefill=("$PD_TRANSFER" serve --role prefill --model "$MODEL" --dtype float32 --max-model-len 2048
  --host "$HOST" --port "$PREFILL_PORT"
  --side-channel-host "$HOST" --side-channel-port "$PREFILL_SIDE_CHANNEL_PORT" --cpu-bind "$PREFILL_CPU_BIND")
decode=("$PD_TRANSFER" serve --role decode --model "$MODEL" --dtype float32 --max-model-len 2048
  --host "$HOST" --port "$DECODE_PORT"
  --side-channel-host "$HOST" --side-channel-port "$DECODE_SIDE_CHANNEL_PORT" --cpu-bind "$DECODE_CPU_BIND")
proxy=("$PD_TRANSFER" proxy --prefill "http://$HOST:$PREFILL_PORT" --decode "http://$HOST:$DECODE_PORT"
  --host "$HOST" --port "$PROXY_PORT")

if [ "${DRY_RUN:-0}" = 1 ]; then
  # Each of our commands after "+ ", then the vLLM command it runs (`pd-transfer serve --print`).
  for command in prefill decode; do
    declare -n words=$command
    printf '+'; printf ' %q' "${words[@]}"; echo
    "${words[@]}" --print
  done
  printf '+'; printf ' %q' "${proxy[@]}"; echo
  exit 0
fi

# The tiny seeded model, built once (a second run finds it and does nothing).
[ "$MODEL" != .models/tiny-llama-f32 ] || "$PD_TRANSFER" make-model "$MODEL" --dtype float32 > /dev/null

mkdir -p "$LOGS"
pids=()
stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT TERM

# GET URL/health until it answers 200, the process dies, or STARTUP_SECONDS pass.
wait_healthy() {
  local name=$1 pid=$2 url=$3 deadline=$((SECONDS + STARTUP_SECONDS))
  until python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url/health" \
    2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name exited while starting; last lines of $LOGS/$name.log:" >&2
      tail -n 30 "$LOGS/$name.log" >&2
      exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "$name not healthy after $STARTUP_SECONDS s; see $LOGS/$name.log" >&2
      exit 1
    fi
    sleep 2
  done
  echo "$name healthy at $url"
}

"${prefill[@]}" > "$LOGS/prefill.log" 2>&1 &
pids+=($!)
prefill_pid=$!
"${decode[@]}" > "$LOGS/decode.log" 2>&1 &
pids+=($!)
decode_pid=$!
echo "starting prefill and decode (logs in $LOGS)"
wait_healthy prefill "$prefill_pid" "http://$HOST:$PREFILL_PORT"
wait_healthy decode "$decode_pid" "http://$HOST:$DECODE_PORT"

"${proxy[@]}" > "$LOGS/proxy.log" 2>&1 &
pids+=($!)
wait_healthy proxy $! "http://$HOST:$PROXY_PORT"
echo "P/D cluster up: http://$HOST:$PROXY_PORT (Ctrl-C stops it)"
wait -n "${pids[@]}" || true
echo "a process exited; stopping the others" >&2
