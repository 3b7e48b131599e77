#!/usr/bin/env bash
# The peers side by side: round_robin, prefix_match, SMG's cache_aware, llm-d's default profile, Dynamo's KV router
# cost and dprouter's cache_aware on the same requests, on closed-loop agent workloads (ample cache, cache
# pressure, bursts of subagents) at dp 8 and dp 32, and on the two Mooncake traces at dp 8. Seed 0, preset
# h100-8b; cache_aware learns its costs (it is not given the preset's). docs/measurements.md ("Agents and the
# peers") has the results. About 3 minutes with a release build (`cargo build --release`) on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DPROUTER:-target/release/dprouter}
policies='round_robin;prefix_match;smg_cache_aware;llm_d;dynamo_kv;cache_aware'
run() {
    "$bin" simulate --quiet --seed 0 --policy "$policies" "$@"
    echo
}
for dp in 8 32; do
    scale=$((dp / 8))
    programs=$((64 * scale))
    rate=$scale
    run --workload "agentic:programs=$programs,rate=$rate" --dp-size "$dp" --kv-capacity 2000000
    run --workload "agentic:programs=$programs,rate=$rate" --dp-size "$dp" --kv-capacity 150000
    run --workload "agentic:programs=$programs,rate=$rate,fork_p=0.25,fanout=8" --dp-size "$dp"
done
run --workload trace:traces/mooncake_conversation_trace.jsonl --dp-size 8
run --workload trace:traces/mooncake_synthetic_trace.jsonl --dp-size 8
