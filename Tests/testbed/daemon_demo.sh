#!/usr/bin/env bash
# The README's main job without Bluetooth hardware, run inside the test bed guest by scripts/run-gateway:
# the operator's flow on a Pi: `ferry pair` each peripheral (all but the last; the last one is a stranger
# advertising the Sync UUID, pairable but never paired), then `ferry run` with the production defaults
# (bonded peripherals only, encrypted links) against the reference backend on 127.0.0.1, until everything
# that was buffered has reached the backend; then SIGTERM and a short report of what arrived where.
set -uo pipefail
FERRY="${FERRY_BIN:-.build/debug/ferry}"
BACKEND=scripts/backend/ferry-backend
R="$FERRY_TESTBED_RESULTS"; S="$FERRY_TESTBED_SCRATCH"
read -r -a ALL <<<"$FERRY_TESTBED_PERIPHERALS"
N=${#ALL[@]}; STRANGER="${ALL[$((N - 1))]}"; ALLOWED=("${ALL[@]:0:$((N - 1))}")
ALLOWED_CSV=$(IFS=,; echo "${ALLOWED[*]}")

"$BACKEND" serve --db "$S/backend.sqlite" --host 127.0.0.1 --port 0 --port-file "$S/port" --quiet >"$R/backend.log" 2>&1 &
BACKEND_PID=$!
for _ in $(seq 100); do [[ -s "$S/port" ]] && break; sleep 0.1; done
mkdir -p -m 700 "$S/state"
for A in "${ALLOWED[@]}"; do
    echo "== ferry pair --address $A --db $S/state/ferry.sqlite"
    "$FERRY" pair --address "$A" --db "$S/state/ferry.sqlite" --timeout 90 </dev/null || { kill "$BACKEND_PID"; exit 1; }
done
# No allowlist: the paired (trusted) peripherals are what ferry run syncs.
cat >"$S/ferry.json" <<JSON
{ "state_dir": "$S/state", "peripherals": [],
  "uplink": { "endpoint": "http://127.0.0.1:$(cat "$S/port")/ingest", "gateway_id": "testbed" } }
JSON
echo "== config ($S/ferry.json)"; cat "$S/ferry.json"
echo "== ferry run --config $S/ferry.json   (log: $R/ferry-run.log)"
T0=$(date +%s.%N)
"$FERRY" run --config "$S/ferry.json" 2> >(tee "$R/ferry-run.log" >&2) &
PID=$!
/usr/bin/python3 Tests/testbed/daemon_check.py drained --allowed "$ALLOWED_CSV" --gateway-db "$S/state/ferry.sqlite" \
    --backend-db "$S/backend.sqlite" --timeout 300 >"$S/drained.json"
RC=$?
kill -TERM "$PID"; wait "$PID"
SECONDS_TOTAL=$(python3 -c "print(round($(date +%s.%N) - $T0, 1))")
echo
echo "== what arrived where (after ${SECONDS_TOTAL} s)"
python3 - "$S/state/ferry.sqlite" "$S/backend.sqlite" "$R" "$STRANGER" "${ALLOWED[@]}" <<'PY'
import json, sqlite3, sys
gw, be, results, stranger, *allowed = sys.argv[1:]
g = sqlite3.connect(f"file:{gw}?mode=ro", uri=True); b = sqlite3.connect(f"file:{be}?mode=ro", uri=True)
print(f"{'peripheral':<19} {'generated':>9} {'acked':>6} {'gateway':>8} {'backend':>8}  note")
for a in allowed + [stranger]:
    st = json.load(open(f"{results}/peripheral-{a}.json"))
    ng = g.execute("SELECT COUNT(*) FROM staged_frames WHERE peripheral=?", (a,)).fetchone()[0]
    nb = b.execute("SELECT COUNT(*) FROM frames WHERE peripheral=?", (a,)).fetchone()[0]
    note = ("not paired: %d connections" % st["connections"] if a == stranger else
            "%d violations, %d frames sent in clear" % (st["violations"], st.get("frames_sent_unencrypted", 0)))
    print(f"{a:<19} {st['events_generated']:>9} {st['highest_ack']:>6} {ng:>8} {nb:>8}  {note}")
print("paired:", [r[0] + " (" + r[1] + ")" for r in g.execute("SELECT address, pairing_method FROM trusted_peripherals")])
print("gateway outbox:", dict(g.execute("SELECT status, COUNT(*) FROM outbox_events GROUP BY status").fetchall()))
PY
echo "drain: $(cat "$S/drained.json")"
kill "$BACKEND_PID" 2>/dev/null
exit $RC
