#!/usr/bin/env bash
# The gateway's memory and responsiveness with large bodies: peak RSS growth over idle for one and for two
# concurrent `input_ids` bodies of TOKENS ids (default 10,000,000: about 66 MiB each), and the slowest `/health`
# answer while they are in flight. Starts a zero-cost mock engine and a gateway on free loopback ports and stops
# them (by their ids) on exit. Uses `dprouter` from PATH.
set -euo pipefail
tokens=${TOKENS:-10000000}
source "$(dirname "$0")/lib.sh"

start mock-engine --listen 127.0.0.1:0 --preset zero --dp-size 2
engine=$URL
printf 'max_body_bytes = 1073741824\n' > "$tmp/gateway.toml"
start serve --listen 127.0.0.1:0 --worker "$engine" --policy round_robin --config "$tmp/gateway.toml"
gateway=$URL
gateway_pid=$PID
python3 -c "
import sys
sys.stdout.write('{\"input_ids\": [' + ','.join(['123456'] * $tokens) + '], \"sampling_params\": {\"max_new_tokens\": 1}}')
" > "$tmp/body.json"
size=$(stat -c %s "$tmp/body.json")
peak() { awk '/VmHWM/ {print $2 * 1024}' "/proc/$gateway_pid/status"; }

idle=$(peak)
for n in 1 2; do
  senders=()
  for _ in $(seq "$n"); do
    curl -s -o /dev/null "$gateway/generate" -H 'content-type: application/json' --data-binary "@$tmp/body.json" &
    senders+=($!)
  done
  slowest=0
  while kill -0 "${senders[@]}" 2>/dev/null; do
    t=$(curl -s -o /dev/null -w '%{time_total}' "$gateway/health")
    slowest=$(python3 -c "print(max($slowest, $t))")
    sleep 0.05
  done
  wait "${senders[@]}" || true
  after=$(peak)
  python3 -c "print(f'$n x {$size / 2**20:.0f} MiB: peak RSS growth {($after - $idle) / 2**20:.0f} MiB over idle = {($after - $idle) / ($n * $size):.2f}x the bodies; slowest /health {$slowest * 1000:.0f} ms')"
done
