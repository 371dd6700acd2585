#!/usr/bin/env bash
# The acceptance report of a model: the example contract (replaykv/accept/contracts/example.yaml,
# concurrency 1 / normal / saturated) run in process, against two `replaykv serve` endpoints of
# the same model (replay off and on), and with a deliberately broken candidate that it must fail.
#
#   scripts/acceptance_report.sh [MODEL_DIR] [OUT_DIR]      (defaults: replaykv/weights/small, results/accept)
#
# Writes OUT_DIR/{in-process,endpoints,broken}/report.{json,md,html} and OUT_DIR/summary.txt (each
# run's verdict, exit status and wall time). Exit status 0 when the honest runs pass and the broken
# one fails. Needs the `serve` and `accept` extras (scripts/install.sh serve,accept).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-replaykv/weights/small}
OUT=${2:-results/accept}
PY=${PYTHON:-.venv/bin/python}
CONTRACT=replaykv/accept/contracts/example.yaml
ADMIN=acceptance-admin
mkdir -p "$OUT"
: > "$OUT/summary.txt"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

run() {  # name, then the accept arguments
  local name=$1; shift
  local t0=$SECONDS
  "$PY" -m replaykv accept --contract "$CONTRACT" --out "$OUT/$name" --no-progress "$@"
  local rc=$?
  echo "$name: exit $rc ($(grep -m1 -o 'Verdict: [A-Z]*' "$OUT/$name/report.md" 2>/dev/null)), $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  return $rc
}

run in-process --model "$MODEL"; honest=$?
run broken --model "$MODEL" --inject-fault window_untruncated; broken=$?

# two servers of the same model: replay off (baseline) and the contract stage's switches (candidate)
BP=$(free_port); CP=$(free_port)
"$PY" -m replaykv serve --model "$MODEL" --port "$BP" --admin-key "$ADMIN" --cache-dir "$OUT/.cache-baseline" \
  --disable-encoder-swa-bounded-replay --disable-decoder-swa-bounded-replay > "$OUT/baseline-server.log" 2>&1 &
B=$!
"$PY" -m replaykv serve --model "$MODEL" --port "$CP" --admin-key "$ADMIN" --cache-dir "$OUT/.cache-candidate" \
  --enable-encoder-swa-bounded-replay --enable-decoder-swa-bounded-replay > "$OUT/candidate-server.log" 2>&1 &
C=$!
trap 'kill $B $C 2>/dev/null' EXIT
for port in "$BP" "$CP"; do
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
done
WINDOW=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1] + '/config.json'))['sliding_window'])" "$MODEL")
run endpoints --baseline-url "http://127.0.0.1:$BP" --candidate-url "http://127.0.0.1:$CP" --admin-key "$ADMIN" \
  --window "$WINDOW"; remote=$?

[ $honest -eq 0 ] && [ $remote -eq 0 ] && [ $broken -eq 1 ]
