#!/usr/bin/env bash
# The gateway's added latency: one sequential agent against the zero-cost mock engine, directly and through
# `dprouter serve`, in one run. Starts both servers on free loopback ports and stops them (by their ids) on exit.
# Uses `dprouter` from PATH (e.g. after `cargo install --path .`, or PATH=target/release:$PATH).
set -euo pipefail
workload=${WORKLOAD:-agent:turns=100,prefix_len=4000,user_tokens=100,output_tokens=16,think_s=0}
source "$(dirname "$0")/lib.sh"

start mock-engine --listen 127.0.0.1:0 --preset zero --dp-size 4
engine=$URL
start serve --listen 127.0.0.1:0 --worker "$engine" --policy round_robin
gateway=$URL
for target in "direct:$engine" "gateway:$gateway"; do
  name=${target%%:*}
  url=${target#*:}
  dprouter bench --workload "$workload" --target "$url" --route server --time-scale 1 --preset zero \
    --json "$tmp/$name.json" > /dev/null 2>&1
  python3 - "$tmp/$name.json" "$name" <<'PY'
import json, sys
row = json.load(open(sys.argv[1]))["results"][0]
print(f"{sys.argv[2] + ':':8} mean TTFT {row['ttft_mean_ms']:.2f} ms, p50 {row['ttft_p50_ms']:.2f} ms, "
      f"p99 {row['ttft_p99_ms']:.2f} ms over {row['requests']} requests, {row['errors']} errors")
PY
done
