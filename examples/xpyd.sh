#!/usr/bin/env bash
# 2P1D by hand: two prefill vLLM servers and one decode server with PdTransferConnector, and the P/D proxy routing
# prompts over both prefills. More prefills: add a name to PREFILLS and give it ports in the same pattern.
#
#   examples/xpyd.sh                      # starts all four, waits until they are healthy, Ctrl-C stops them
#   DRY_RUN=1 examples/xpyd.sh            # prints the commands (and the vLLM commands they run), starts nothing
#
# Each prefill needs its own HTTP port and side-channel port on one host (on separate hosts the same ports do):
# the decode pulls from whichever prefill the proxy picked, at the host and port that prefill returned in
# kv_transfer_params. Needs vLLM and a model folder, as examples/launch_pd.sh.
set -euo pipefail

PD_TRANSFER=${PD_TRANSFER:-pd-transfer}
MODEL=${MODEL:-.models/tiny-llama-f32}
HOST=${HOST:-127.0.0.1}
PREFILL_PORT=${PREFILL_PORT:-8100}               # prefill i (0, 1, ...) listens on PREFILL_PORT + i
PREFILL_SIDE_CHANNEL_PORT=${PREFILL_SIDE_CHANNEL_PORT:-5600}   # and serves KV on PREFILL_SIDE_CHANNEL_PORT + i
PREFILLS=${PREFILLS:-"prefill-0 prefill-1"}
PREFILL_CPU_BIND=${PREFILL_CPU_BIND:-0}          # all prefills share these cores
DECODE_PORT=${DECODE_PORT:-8200}
DECODE_SIDE_CHANNEL_PORT=${DECODE_SIDE_CHANNEL_PORT:-5700}
DECODE_CPU_BIND=${DECODE_CPU_BIND:-1}
PROXY_PORT=${PROXY_PORT:-8000}
LOGS=${LOGS:-/tmp/pd-transfer-xpyd}
STARTUP_SECONDS=${STARTUP_SECONDS:-1200}

names=()
commands=()
prefill_urls=()
i=0
for name in $PREFILLS; do
  names+=("$name")
  commands+=("$(printf '%q ' "$PD_TRANSFER" serve --role prefill --model "$MODEL" --dtype float32 \
    --max-model-len 2048 --host "$HOST" --port $((PREFILL_PORT + i)) --side-channel-host "$HOST" \
    --side-channel-port $((PREFILL_SIDE_CHANNEL_PORT + i)) --cpu-bind "$PREFILL_CPU_BIND")")
  prefill_urls+=("http://$HOST:$((PREFILL_PORT + i))")
  i=$((i + 1))
done
names+=(decode)
commands+=("$(printf '%q ' "$PD_TRANSFER" serve --role decode --model "$MODEL" --dtype float32 \
  --max-model-len 2048 --host "$HOST" --port "$DECODE_PORT" --side-channel-host "$HOST" \
  --side-channel-port "$DECODE_SIDE_CHANNEL_PORT" --cpu-bind "$DECODE_CPU_BIND")")
urls=("${prefill_urls[@]}" "http://$HOST:$DECODE_PORT")
proxy=("$PD_TRANSFER" proxy --prefill "${prefill_urls[@]}" --decode "http://$HOST:$DECODE_PORT"
  --host "$HOST" --port "$PROXY_PORT")

if [ "${DRY_RUN:-0}" = 1 ]; then
  for command in "${commands[@]}"; do
    echo "+ ${command% }"
    eval "$command --print"
  done
  printf '+'; printf ' %q' "${proxy[@]}"; echo
  exit 0
fi

[ "$MODEL" != .models/tiny-llama-f32 ] || "$PD_TRANSFER" make-model "$MODEL" --dtype float32 > /dev/null

mkdir -p "$LOGS"
pids=()
trap 'for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM

wait_healthy() {  # NAME PID URL: GET URL/health until 200; fails if the process dies or STARTUP_SECONDS pass
  local name=$1 pid=$2 url=$3 deadline=$((SECONDS + STARTUP_SECONDS))
  until python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url/health" \
    2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "$name exited; see $LOGS/$name.log" >&2; tail -n 30 "$LOGS/$name.log" >&2; exit 1; }
    [ $SECONDS -lt $deadline ] || { echo "$name not healthy after $STARTUP_SECONDS s" >&2; exit 1; }
    sleep 2
  done
  echo "$name healthy at $url"
}

for k in "${!names[@]}"; do
  eval "${commands[$k]}" > "$LOGS/${names[$k]}.log" 2>&1 &
  pids+=($!)
done
echo "starting ${names[*]} (logs in $LOGS)"
for k in "${!names[@]}"; do
  wait_healthy "${names[$k]}" "${pids[$k]}" "${urls[$k]}"
done
"${proxy[@]}" > "$LOGS/proxy.log" 2>&1 &
pids+=($!)
wait_healthy proxy $! "http://$HOST:$PROXY_PORT"
echo "2P1D cluster up: http://$HOST:$PROXY_PORT, prefills ${prefill_urls[*]} (Ctrl-C stops it)"
wait -n "${pids[@]}" || true
echo "a process exited; stopping the others" >&2
