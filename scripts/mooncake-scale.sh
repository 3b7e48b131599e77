#!/usr/bin/env bash
# cache_aware against prefix_match on both Mooncake traces (h100-8b), at 500,000 tokens per rank and the preset's
# own capacity, at dp 8, 16 and 32: hit rates, each one's mean and p99 TTFT against cache_aware's queue-free floor,
# and cache_aware's busiest rank over the mean; beside its mean, the queueing (over the floor) its own requests, at
# its hit rate, would have had in one queue that every rank takes from as soon as it is free: first come first served
# ("pooled"), and shortest prefill first ("shortest"). Simulated, so exact; about 30 s with a release build. Uses
# `dprouter` from PATH and python3 (to read the JSON). CACHE_AWARE sets the cache_aware spec to compare, with its
# options (e.g. CACHE_AWARE='cache_aware:eviction_weight=4').
set -euo pipefail
cd "$(dirname "$0")/.."
cache_aware=${CACHE_AWARE:-cache_aware}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
printf '| trace | KV/rank | dp | hit: cache_aware / prefix_match | mean TTFT ms: cache_aware (floor: over it; pooled, shortest) / prefix_match | p99 TTFT ms: cache_aware (floor) / prefix_match | cache_aware max/mean |\n'
printf '|---|---|---|---|---|---|---|\n'
for trace in conversation synthetic; do
  for capacity in 500000 default; do
    for dp in 8 16 32; do
      args=(--workload "trace:traces/mooncake_${trace}_trace.jsonl" --dp-size "$dp" -q --policy "prefix_match;$cache_aware")
      [ "$capacity" != default ] && args+=(--kv-capacity "$capacity")
      dprouter simulate "${args[@]}" --json "$out" > /dev/null
      python3 - "$trace" "$capacity" "$dp" "$out" <<'PY'
import json, sys
trace, capacity, dp, path = sys.argv[1:]
pm, ca = json.load(open(path))["results"]
floor = ca['floor_mean_ms']
print(f"| {trace} | {capacity} | {dp} | {ca['hit_rate']:.3f} / {pm['hit_rate']:.3f} "
      f"| {ca['ttft_mean_ms']:.0f} ({floor:.0f}: {ca['ttft_mean_ms'] / floor - 1:+.1%}; "
      f"{ca['pooled_wait_mean_ms'] / floor:+.1%}, {ca['pooled_shortest_wait_mean_ms'] / floor:+.1%}) / {pm['ttft_mean_ms']:.0f} "
      f"| {ca['ttft_p99_ms']:.0f} ({ca['floor_p99_ms']:.0f}, {ca['ttft_p99_ms'] / ca['floor_p99_ms'] - 1:+.1%}) / {pm['ttft_p99_ms']:.0f} "
      f"| {ca['max_mean_load']:.2f} |")
PY
    done
  done
done
