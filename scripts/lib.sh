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
