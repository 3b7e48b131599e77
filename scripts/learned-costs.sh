#!/usr/bin/env bash
# cache_aware with the engine's costs unknown: given the preset's prefill rate and base (`learn_costs=false`, the
# right constants), given constants 3 times off in either direction (the rate 3 times lower and the base 3 times
# higher, or the reverse) and kept, or given those and learning the engine's from its requests (the default).
# docs/measurements.md ("Learned prefill costs") has the results. About a minute with a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DPROUTER:-target/release/dprouter}
run() {
    local preset=$1 rate=$2 base_ms=$3
    shift 3
    local slow fast
    slow="prefill_tokens_per_s=$(printf '%.0f' "$(echo "$rate / 3" | bc -l)"),base_ms=$(printf '%.0f' "$(echo "$base_ms * 3" | bc -l)")"
    fast="prefill_tokens_per_s=$(printf '%.0f' "$(echo "$rate * 3" | bc -l)"),base_ms=$(printf '%.0f' "$(echo "$base_ms / 3" | bc -l)")"
    "$bin" simulate --quiet --preset "$preset" "$@" --policy "cache_aware:learn_costs=false;\
cache_aware:learn_costs=false,$slow;cache_aware:learn_costs=false,$fast;cache_aware:$slow;cache_aware:$fast"
    echo
}
run h100-8b 25000 25 --workload agentic:programs=64,rate=1 --dp-size 8 --kv-capacity 150000
run h100-8b 25000 25 --workload trace:traces/mooncake_conversation_trace.jsonl --dp-size 8
run seed-moe 3674 1235 --workload agent:agents=16 --dp-size 8
run seed-moe 3674 1235 --workload agent:agents=32,prefixes=32 --dp-size 16
