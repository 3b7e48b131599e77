#!/usr/bin/env bash
# cache_aware in approximate mode (its index guessed from where it sent prompts) and in precise mode (fed by the
# engine's KV events), under cache pressure, with one gateway and with two replicas sharing the requests: a mock
# engine (DP 4, PRESET, KV_CAPACITY tokens per rank, publishing its KV events), started afresh for each run, the
# gateway(s) in front of it, and `dprouter bench --route server` with WORKLOAD through them (with two gateways,
# request i goes to gateway i mod 2). Prints the bench's row per run and the gateways' mean absolute prediction
# error of cached tokens (what cache_aware predicted an endpoint held, minus what the engine reported), from their
# metrics. With BREAKDOWN=1 the gateways also log each request (`[server] access_log`) and each run adds a line that
# splits that error per request: predictions within a block of the report, the rest of requests that arrived
# within 0.1 s of the first (the opening burst), and the rest over and under the report. With FRONT=epp the
# replicas are `dprouter epp` pickers behind one Envoy (deploy/envoy.yaml; $ENVOY, default `envoy` from PATH), which
# shares the requests among them. With DECISIONS=1 each run adds the gateways' routing decisions by branch, summed.
# MODES limits the modes run. Uses `dprouter` from PATH; everything started here is stopped on exit.
set -euo pipefail
preset=${PRESET:-h100-8b}
capacity=${KV_CAPACITY:-16000}
time_scale=${TIME_SCALE:-0.25}
workload=${WORKLOAD:-agent:agents=32,turns=8,prefixes=8,prefix_len=4000}
replica_counts=${REPLICAS:-1 2}
modes=${MODES:-approximate precise}
here=$(dirname "$0")
source "$here/lib.sh"

json() { python3 -c "import json,sys; v = json.load(sys.stdin); print($1)"; }

header=1
if [ "${BREAKDOWN:-0}" = 1 ]; then export START_LOG=dprouter::access=info; fi
for replicas in $replica_counts; do
  for mode in $modes; do
    start mock-engine --listen 127.0.0.1:0 --dp-size 4 --preset "$preset" --kv-capacity "$capacity" \
      --time-scale "$time_scale" --kv-events tcp://127.0.0.1:0 --kv-events-replay tcp://127.0.0.1:0
    engine=$URL
    run_pids=("$PID")
    info=$(curl -sf "$engine/get_server_info")
    {
      printf '[routing]\npolicy = "cache_aware"\nprefill_tokens_per_s = %s\nbase_ms = %s\n%s\n' \
        "$(echo "$info" | json 'v["cost"]["prefill_tokens_per_s"]')" \
        "$(echo "$info" | json 'v["cost"]["base_s"] * 1000')" "${POLICY_OPTIONS:-}"
      if [ "${BREAKDOWN:-0}" = 1 ]; then printf '[server]\naccess_log = true\n'; fi
      printf '[[workers]]\nurl = "%s"\ndp_size = 4\n' "$engine"
      if [ "$mode" = precise ]; then
        printf 'kv_events = %s\nkv_events_replay = %s\n' \
          "$(echo "$info" | json 'json.dumps(v["kv_events_endpoints"])')" \
          "$(echo "$info" | json 'json.dumps(v["kv_events_replay_endpoints"])')"
      fi
    } > "$tmp/$mode.toml"
    gateways=()
    logs=()
    pickers=()
    for _ in $(seq "$replicas"); do
      if [ "${FRONT:-serve}" = epp ]; then
        start_epp --config "$tmp/$mode.toml"
        pickers+=("$GRPC")
      else
        start serve --listen 127.0.0.1:0 --config "$tmp/$mode.toml"
      fi
      gateways+=("$URL")
      logs+=("$OUT")
      run_pids+=("$PID")
      if [ "$mode" = precise ]; then
        for _ in $(seq 100); do
          [ "$(curl -sf "$URL/kv_events" | json 'len(v["feeds"]) == 4 and all(f["connected"] for f in v["feeds"])')" = True ] && break
          sleep 0.1
        done
      fi
    done
    targets=$(IFS=,; echo "${gateways[*]}")
    if [ "${FRONT:-serve}" = epp ]; then
      start_envoy "${pickers[@]}"
      run_pids+=("$PID")
      targets=$URL
    fi
    dprouter bench --workload "$workload" --target "$targets" --route server --preset "$preset" \
      --time-scale "$time_scale" --quiet > "$tmp/run.txt"
    if [ "$header" = 1 ]; then sed -n 1,2p "$tmp/run.txt" | sed '2s/$/  pred_err/'; header=0; fi
    error=$(for g in "${gateways[@]}"; do curl -sf "$g/metrics"; done | awk '
      /^dprouter_cache_prediction_error_tokens_sum/ {sum += $NF}
      /^dprouter_cache_prediction_error_tokens_count/ {count += $NF}
      END {if (count > 0) printf "%.1f", sum / count; else printf "-"}')
    printf '%-22s%s  %8s\n' "$mode x$replicas" "$(sed -n 3p "$tmp/run.txt" | cut -c23-)" "$error"
    if [ "${DECISIONS:-0}" = 1 ]; then
      for g in "${gateways[@]}"; do curl -sf "$g/workers"; echo; done | python3 -c '
import collections, json, sys
total = collections.Counter()
for line in sys.stdin:
    if line.strip():
        total.update(json.loads(line)["decisions"])
print("  decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())))'
    fi
    if [ "${BREAKDOWN:-0}" = 1 ]; then
      python3 - "${logs[@]}" <<'PY'
import datetime, re, sys
rows = []
for path in sys.argv[1:]:
    for line in open(path):
        f = dict(re.findall(r'(\w+)=(\S+)', line))
        if 'predicted_cached_tokens' in f and 'cached_tokens' in f:
            end = datetime.datetime.fromisoformat(line.split()[0].replace('Z', '+00:00')).timestamp()
            at = end - float(f['duration_ms']) / 1e3
            rows.append((at, int(f['predicted_cached_tokens']), int(f['cached_tokens'])))
start = min(r[0] for r in rows)
parts = {'within a block': 0, 'opening burst': 0, 'over': 0, 'under': 0}
for at, predicted, cached in rows:
    error = abs(predicted - cached)
    kind = ('within a block' if error <= 64 else 'opening burst' if at - start < 0.1
            else 'over' if predicted > cached else 'under')
    parts[kind] += error
print('  error per request: ' + ', '.join(f'{k} {v / len(rows):.1f}' for k, v in parts.items()))
PY
    fi
    kill "${run_pids[@]}"
    wait "${run_pids[@]}" 2>/dev/null || true
  done
done
