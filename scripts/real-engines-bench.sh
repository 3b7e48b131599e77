#!/usr/bin/env bash
# TTFT and hit rate per policy on real engines: two llama.cpp servers (SmolLM2-135M, one thread and SLOTS slots
# each, host-RAM prompt cache off), one gateway per policy in front of them (`--backend openai`, each worker
# declared to hold CAPACITY tokens), and `dprouter bench --api completions --route server` with WORKLOAD through
# each (token ids mapped into SmolLM2's 49,152-token vocabulary). The engines restart for every policy, so each starts cold. Installs the engine into VENV (default
# target/llama-venv) the first time; uses `dprouter` from PATH. Everything started here is stopped on exit.
set -euo pipefail
venv=${VENV:-target/llama-venv}
slots=${SLOTS:-1}
capacity=${CAPACITY:-800}
policies=${POLICIES:-round_robin prefix_match prefix_affinity cache_aware}
workload=${WORKLOAD:-agent:agents=2,prefixes=2,prefix_len=600,turns=4,user_tokens=20,output_tokens=4,think_s=0}
here=$(dirname "$0")
source "$here/lib.sh"

[ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import xllamacpp' 2>/dev/null \
  || python3 "$here/llama_servers.py" install "$venv" > /dev/null

header=1
for policy in $policies; do
  mkfifo "$tmp/llama-$policy.in"
  "$venv/bin/python" "$here/llama_servers.py" run --quiet --count 2 --slots "$slots" \
    < "$tmp/llama-$policy.in" > "$tmp/llama-$policy.out" &
  llama=$!
  pids+=("$llama")
  exec 3> "$tmp/llama-$policy.in"
  for _ in $(seq 600); do grep -q '^ready' "$tmp/llama-$policy.out" 2>/dev/null && break; sleep 0.1; done
  grep -q '^ready' "$tmp/llama-$policy.out" || { echo "llama.cpp servers did not start" >&2; exit 1; }
  {
    printf '[routing]\npolicy = "%s"\n' "$policy"
    for url in $(awk '/listening on/ {print $NF}' "$tmp/llama-$policy.out"); do
      printf '[[workers]]\nurl = "%s"\nbackend = "openai"\nkv_capacity_tokens = %s\n' "$url" "$capacity"
    done
  } > "$tmp/$policy.toml"
  start serve --listen 127.0.0.1:0 --config "$tmp/$policy.toml"
  gateway_pid=$PID
  dprouter bench --workload "$workload" --target "$URL" --route server --api completions --vocab 49152 \
    --time-scale 1 --quiet > "$tmp/$policy.txt"
  if [ "$header" = 1 ]; then sed -n 1,2p "$tmp/$policy.txt"; header=0; fi
  printf '%-22s%s\n' "$policy" "$(sed -n 3p "$tmp/$policy.txt" | cut -c23-)"
  kill "$gateway_pid" 2>/dev/null || true
  exec 3>&-
  wait "$llama" 2>/dev/null || true
done
