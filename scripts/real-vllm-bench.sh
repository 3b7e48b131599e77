#!/usr/bin/env bash
# TTFT and hit rate per policy on a real vLLM: vLLM's CPU build serving SmolLM2-135M with --data-parallel-size 2
# (`scripts/vllm_engine.py`, installed on first use into a cache outside the clone), one gateway per policy in front
# of it (`--backend vllm`, the rank in `X-data-parallel-rank`), and `dprouter bench --api completions --route server`
# with WORKLOAD through each (token ids mapped into SmolLM2's 49,152-token vocabulary; streamed, so TTFT is the
# first token's). vLLM starts once; before each policy its prefix cache is reset (and each rank stepped once, so the
# clear is published), so every run starts cold. `cache_aware+precise` is cache_aware following vLLM's KV events:
# vLLM's publishers connect to the gateway, which binds (`kv_events_bind`). POLICIES, WORKLOAD and CACHE_AWARE (the
# cost options given to cache_aware) and SEED (the workload's) may be set; uses `dprouter` from PATH. Everything started here is stopped on
# exit.
set -euo pipefail
policies=${POLICIES:-round_robin prefix_match cache_aware cache_aware+precise}
workload=${WORKLOAD:-agent:agents=4,prefixes=4,prefix_len=400,turns=4,user_tokens=20,output_tokens=8,think_s=0}
cache_aware=${CACHE_AWARE:-prefill_tokens_per_s = 150
base_ms = 300}
here=$(dirname "$0")
source "$here/lib.sh"

python=$(python3 "$here/vllm_engine.py" install | tail -1)
model=$(dirname "$(dirname "$(dirname "$python")")")/smollm2
events=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkfifo "$tmp/vllm.in"
"$python" "$here/vllm_engine.py" run --quiet --dp-size 2 --model "$model" --kv-events "connect:$events" \
  < "$tmp/vllm.in" > "$tmp/vllm.out" &
pids+=("$!")
exec 3> "$tmp/vllm.in"
for _ in $(seq 1200); do grep -q '^ready' "$tmp/vllm.out" 2>/dev/null && break; sleep 0.5; done
grep -q '^ready' "$tmp/vllm.out" || { echo "vLLM did not start" >&2; exit 1; }
vllm=$(awk '/listening on/ {print $NF}' "$tmp/vllm.out")

cold() {
  curl -sf -X POST "$vllm/reset_prefix_cache" > /dev/null
  for rank in 0 1; do
    curl -sf "$vllm/v1/completions" -H 'content-type: application/json' -H "x-data-parallel-rank: $rank" \
      -d '{"model": "smollm2", "prompt": "Hello.", "max_tokens": 1}' > /dev/null
  done
}

header=1
for policy in $policies; do
  cold
  {
    printf '[routing]\npolicy = "%s"\n' "${policy%+precise}"
    if [ "${policy%+precise}" = cache_aware ]; then printf '%s\n' "$cache_aware"; fi
    printf '[[workers]]\nurl = "%s"\nbackend = "vllm"\ndp_size = 2\nkv_capacity_tokens = 20000\n' "$vllm"
    if [ "$policy" != "${policy%+precise}" ]; then
      printf 'kv_events_bind = "tcp://127.0.0.1:%s"\nkv_events_replay = "tcp://127.0.0.1:%s"\n' \
        "$events" "$((events + 100))"
    fi
  } > "$tmp/$policy.toml"
  start serve --listen 127.0.0.1:0 --config "$tmp/$policy.toml"
  gateway_pid=$PID
  if [ "$policy" != "${policy%+precise}" ]; then
    for _ in $(seq 300); do
      curl -sf "$URL/kv_events" | python3 -c 'import json, sys; f = json.load(sys.stdin)["feeds"]; sys.exit(not (len(f) == 2 and all(x["connected"] for x in f)))' && break
      sleep 0.1
    done
  fi
  dprouter bench --workload "$workload" --target "$URL" --route server --api completions --vocab 49152 \
    --model smollm2 --dp-size 2 --time-scale 1 --seed "${SEED:-0}" --quiet > "$tmp/$policy.txt"
  if [ "$header" = 1 ]; then sed -n 1,2p "$tmp/$policy.txt"; header=0; fi
  printf '%-22s%s\n' "$policy" "$(sed -n 3p "$tmp/$policy.txt" | cut -c23-)"
  kill "$gateway_pid" 2>/dev/null || true
  wait "$gateway_pid" 2>/dev/null || true
done
