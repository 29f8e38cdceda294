#!/usr/bin/env python3
"""Checks for the `ferry run` test-bed scenarios (runs in the guest, stdlib only).

  daemon_check.py drained --allowed A,B,C --gateway-db G --backend-db B [--timeout S]
      wait until every allowed peripheral is drained end to end: its head acknowledged, the backend holding
      every seq 1..head of its epoch, and the gateway outbox without PENDING/IN_FLIGHT events.
      Prints {"seconds": ..., "frames": ...} as JSON; exit 1 on timeout (with what was missing).
  daemon_check.py acked-committed --allowed A,B,C --gateway-db G
      every peripheral's highest_ack <= the gateway's committed cursor (never ACK what is not committed).
  daemon_check.py final --allowed A,B,C --stranger D --gateway-db G --backend-db B
      the end-of-scenario assertions; prints one 'PASS name' / 'FAIL name: why' line each; exit 1 if any failed.
  daemon_check.py notify --log L --frozen-from T0 --frozen-to T1
      sd_notify as systemd would see it (L from notify_listener.py): READY=1 came, a STATUS= with the slots, and
      WATCHDOG=1 pings before T0, none while the process was stopped (SIGSTOP at T0, SIGCONT at T1), and pings
      again after T1. Prints one 'PASS name' / 'FAIL name: why' line each; exit 1 if any failed.
  daemon_check.py metrics --url http://127.0.0.1:PORT --allowed A,B,C --gateway-db G --backend-db B [--ferry F]
      the daemon's metrics endpoint after a drain by ONE daemon process (its counters start at 0): /metrics in
      the text format with ferry_frames_stored_total equal to the frames in the store and in the backend, sessions
      counted, the outbox and uplink gauges as the store has them; /healthz 200; 404 elsewhere; and `ferry status
      --json` showing the running daemon's live view. One 'PASS name' / 'FAIL name: why' line each.
  daemon_check.py scan --expect A,B,C < `ferry scan --json` output
      every expected peripheral is listed with an address type (and the RSSIs seen are printed).

Peripheral stats come from $FERRY_TESTBED_RESULTS/peripheral-<ADDR>.json (Hardware/TESTBED.md).
"""

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.environ.get("FERRY_TESTBED_DIR", "scripts/testbed.d"))
import syncproto  # noqa: E402  (event_payload: the bytes seq N must carry)

RESULTS = os.environ.get("FERRY_TESTBED_RESULTS", ".")


def peripheral_stats(address):
    with open(os.path.join(RESULTS, f"peripheral-{address}.json")) as f:
        return json.load(f)


def connect(path):
    # Read-only URI: the checker must never create or change the store it judges.
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    return db


def backend_seqs(db, address, epoch):
    rows = db.execute("SELECT seq FROM frames WHERE peripheral = ? AND epoch = ?", (address, str(epoch))).fetchall()
    return [int(r[0]) for r in rows]


def outbox_counts(db):
    return dict(db.execute("SELECT status, COUNT(*) FROM outbox_events GROUP BY status").fetchall())


def gateway_cursor(db, address, device_epoch):
    row = db.execute(
        "SELECT MAX(cursor) FROM stream_cursors WHERE peripheral = ? AND device_epoch = ? AND active = 1",
        (address, str(device_epoch))).fetchone()
    return row[0] or 0


def drained_state(args):
    """(all drained?, frames in backend for the allowed peripherals, what is missing)."""
    missing = []
    frames = 0
    try:
        backend = connect(args.backend_db)
        gateway = connect(args.gateway_db)
        for address in args.allowed:
            st = peripheral_stats(address)
            head = st["head"]
            seqs = backend_seqs(backend, address, st["epoch"])
            frames += len(seqs)
            # Seqs forwarded as a recorded GAP count as arrived here (the wait must end); `final` fails on them.
            gapped = backend.execute(
                "SELECT COALESCE(SUM(CAST(last_seq AS INTEGER) - CAST(first_seq AS INTEGER) + 1), 0) FROM gaps "
                "WHERE peripheral = ? AND epoch = ?", (address, str(st["epoch"]))).fetchone()[0]
            if st["highest_ack"] < head:
                missing.append(f"{address}: acked {st['highest_ack']} of head {head}")
            if len(seqs) + gapped < head:
                missing.append(f"{address}: backend has {len(seqs)} (+{gapped} in gaps) of {head}")
        counts = outbox_counts(gateway)
        open_events = counts.get("PENDING", 0) + counts.get("IN_FLIGHT", 0)
        if open_events:
            missing.append(f"outbox: {open_events} events not yet delivered")
        backend.close()
        gateway.close()
    except (OSError, sqlite3.Error, KeyError, ValueError) as error:
        missing.append(f"not readable yet: {error}")
    return not missing, frames, missing


def cmd_drained(args):
    start = time.monotonic()
    missing = []
    while time.monotonic() - start < args.timeout:
        done, frames, missing = drained_state(args)
        if done:
            print(json.dumps({"seconds": round(time.monotonic() - start, 2), "frames": frames}))
            return 0
        time.sleep(0.5)
    print(json.dumps({"seconds": None, "missing": missing}))
    return 1


def cmd_acked_committed(args):
    gateway = connect(args.gateway_db)
    bad = []
    for address in args.allowed:
        st = peripheral_stats(address)
        cursor = gateway_cursor(gateway, address, st["epoch"])
        if st["highest_ack"] > cursor:
            bad.append(f"{address}: peripheral saw ACK {st['highest_ack']} but the store committed only {cursor}")
    print("; ".join(bad) if bad else "every ACK is committed")
    return 1 if bad else 0


def cmd_final(args):
    results = []

    def check(name, ok, why=""):
        results.append(ok)
        print(f"PASS {name}" if ok else f"FAIL {name}: {why}")

    backend = connect(args.backend_db)
    gateway = connect(args.gateway_db)
    for address in args.allowed:
        st = peripheral_stats(address)
        epoch, head, generation = int(st["epoch"]), st["head"], st.get("generation", 0)
        rows = backend.execute(
            "SELECT seq, payload FROM frames WHERE peripheral = ? AND epoch = ?", (address, str(epoch))).fetchall()
        seqs = sorted(int(r[0]) for r in rows)
        check(f"{address} backend holds every event 1..{head} exactly once",
              seqs == list(range(1, head + 1)),
              f"{len(seqs)} rows, {len(set(seqs))} distinct, missing "
              f"{sorted(set(range(1, head + 1)) - set(seqs))[:10]}, extra {[s for s in seqs if s > head][:10]}")
        size = args.payload_bytes
        wrong = [int(s) for s, p in rows if bytes(p) != syncproto.event_payload(epoch, generation, int(s), size)]
        check(f"{address} payloads are the peripheral's bytes", not wrong, f"{len(wrong)} differ, e.g. {wrong[:5]}")
        check(f"{address} acknowledged through its head", st["highest_ack"] == head,
              f"highest_ack {st['highest_ack']} head {head}")
        check(f"{address} no protocol violations", st["violations"] == 0, json.dumps(st.get("violation_list", [])[:3]))
        cursor = gateway_cursor(gateway, address, epoch)
        check(f"{address} gateway cursor == head", cursor == head, f"cursor {cursor} head {head}")
    if args.stranger:
        st = peripheral_stats(args.stranger)
        check(f"{args.stranger} (not on the allowlist) never connected", st["connections"] == 0,
              f"connections {st['connections']}")
        n = backend.execute("SELECT COUNT(*) FROM frames WHERE peripheral = ?", (args.stranger,)).fetchone()[0]
        g = gateway.execute("SELECT COUNT(*) FROM staged_frames WHERE peripheral = ?", (args.stranger,)).fetchone()[0]
        check(f"{args.stranger} nothing stored or forwarded", n == 0 and g == 0, f"backend {n}, gateway {g}")
    counts = outbox_counts(gateway)
    check("gateway outbox all COMPLETED", set(counts) <= {"COMPLETED"} and counts.get("COMPLETED", 0) > 0,
          json.dumps(counts))
    stats = json.loads(os.popen(f"{args.backend} stats --db {args.backend_db}").read())
    check("backend: no event in two batches, no idempotency conflict, no gaps or regressions",
          stats["events_in_multiple_batches"] == 0 and stats["idempotency_conflicts"] == 0
          and stats["gaps"] == 0 and stats["regressions"] == 0,
          json.dumps({k: stats[k] for k in ("events_in_multiple_batches", "idempotency_conflicts", "gaps",
                                            "regressions")}))
    print(f"final: {sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


def cmd_notify(args):
    results = []

    def check(name, ok, why=""):
        results.append(ok)
        print(f"PASS {name}" if ok else f"FAIL {name}: {why}")

    entries = [json.loads(line) for line in open(args.log)]
    pings = [e["t"] for e in entries if "WATCHDOG=1" in e["msg"].split("\n")]
    t0, t1 = args.frozen_from, args.frozen_to
    check("systemd notify: READY=1 sent", any("READY=1" in e["msg"].split("\n") for e in entries),
          f"{len(entries)} datagrams")
    statuses = [line for e in entries for line in e["msg"].split("\n") if line.startswith("STATUS=")]
    check("systemd notify: STATUS= shows the slots in use and the backlog",
          any("slots in use" in st and "backlog" in st for st in statuses), json.dumps(statuses[-3:]))
    before = [t for t in pings if t < t0]
    check("systemd notify: WATCHDOG=1 pings while running", len(before) >= 2, f"{len(before)} before the freeze")
    # 0.3 s grace: a datagram sent just before SIGSTOP may be read by the listener just after.
    during = [round(t - t0, 2) for t in pings if t0 + 0.3 < t < t1]
    check(f"systemd notify: no WATCHDOG=1 while the process was stopped ({t1 - t0:.1f} s)", not during,
          f"pings at +{during} s")
    after = [t for t in pings if t >= t1]
    check("systemd notify: WATCHDOG=1 again after SIGCONT", bool(after) and after[0] - t1 < 5,
          f"first at +{after[0] - t1:.1f} s" if after else "none")
    return 0 if all(results) else 1


def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return None, str(error)


def parse_exposition(text):
    """{'name{labels}': value} of every sample line."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def cmd_metrics(args):
    results = []

    def check(name, ok, why=""):
        results.append(ok)
        print(f"PASS {name}" if ok else f"FAIL {name}: {why}")

    # The drain is judged from the peripherals' ACKs: a sync-and-release session may still be disconnecting
    # (and so not yet counted as ended) for a moment after its last ACK.
    deadline = time.monotonic() + 15
    while True:
        status, text = fetch(args.url + "/metrics")
        if time.monotonic() > deadline or 'ferry_sessions_total{outcome="caught_up"} 0' not in text:
            break
        time.sleep(0.5)
    check("metrics: /metrics answers 200 in the Prometheus text format",
          status == 200 and "# TYPE ferry_frames_stored_total counter" in text, f"status {status}: {text[:200]}")
    samples = parse_exposition(text) if status == 200 else {}
    counter = samples.get("ferry_frames_stored_total")
    gateway = connect(args.gateway_db)
    stored = gateway.execute("SELECT COUNT(*) FROM staged_frames").fetchone()[0]
    outbox = outbox_counts(gateway)
    gateway.close()
    backend = connect(args.backend_db)
    delivered = sum(len(backend_seqs(backend, a, peripheral_stats(a)["epoch"])) for a in args.allowed)
    backend.close()
    check(f"metrics: ferry_frames_stored_total {counter} = frames in the store {stored} = frames in the backend {delivered}",
          counter is not None and counter == stored == delivered and stored > 0)
    caught_up = samples.get('ferry_sessions_total{outcome="caught_up"}', 0)
    sessions = sum(v for k, v in samples.items() if k.startswith("ferry_sessions_total{"))
    check(f"metrics: sessions counted by outcome ({int(sessions)} ended, {int(caught_up)} caught up)", caught_up >= 1)
    gauges = {s: samples.get(f'ferry_outbox_events{{status="{s.lower()}"}}') for s in ("PENDING", "IN_FLIGHT", "COMPLETED")}
    check(f"metrics: outbox gauges as in the store {gauges}",
          all(gauges[s] == outbox.get(s, 0) for s in gauges), f"store {outbox}")
    check("metrics: uplink online, store readable, slots and connect latency reported",
          samples.get('ferry_uplink_state{state="online"}') == 1 and samples.get("ferry_store_readable") == 1
          and samples.get("ferry_slots") == 3 and samples.get("ferry_connect_seconds_count", 0) >= 1,
          json.dumps({k: v for k, v in samples.items() if "uplink" in k or "slots" in k or "connect_seconds_count" in k
                      or "readable" in k}))
    backlog = {k: v for k, v in samples.items() if k.startswith("ferry_peripheral_backlog_frames")}
    # A stay-connected peripheral's first session has not ended yet: no head recorded, no backlog sample.
    check(f"metrics: per-peripheral backlog 0 after the drain ({len(backlog)} peripherals with a finished session)",
          backlog and all(v == 0 for v in backlog.values()), json.dumps(backlog))
    status, body = fetch(args.url + "/healthz")
    check("metrics: /healthz 200 while the daemon runs", status == 200, f"{status} {body.strip()}")
    status, _ = fetch(args.url + "/nope")
    check("metrics: 404 for another path", status == 404, f"{status}")
    live = subprocess.run([args.ferry, "status", "--db", args.gateway_db, "--json"], capture_output=True, text=True)
    try:
        daemon = json.loads(live.stdout).get("daemon", {})
    except ValueError:
        daemon = {"stdout": live.stdout[:200], "stderr": live.stderr[:200]}
    check("ferry status --json shows the running daemon's live view (adapter, slots, sessions)",
          daemon.get("running") is True and daemon.get("adapter") and daemon.get("max_connections") == 3
          and isinstance(daemon.get("sessions"), list), json.dumps(daemon))
    return 0 if all(results) else 1


def cmd_scan(args):
    try:
        report = json.load(sys.stdin)
    except ValueError as error:
        print(f"FAIL ferry scan --json printed no JSON: {error}")
        return 1
    listed = {p["address"]: p for p in report.get("peripherals", [])}
    missing = [a for a in args.expect if a not in listed]
    bad = [a for a, p in listed.items() if p.get("address_type") not in ("public", "random")]
    rssi = sorted({p.get("rssi") for p in listed.values()}, key=str)
    ok = not missing and not bad
    print(f"PASS ferry scan lists the bed's {len(args.expect)} Sync peripherals (address types ok, RSSI {rssi})"
          if ok else f"FAIL ferry scan lists the bed's peripherals: missing {missing}, malformed {bad}; got {sorted(listed)}")
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["drained", "acked-committed", "final", "notify", "scan", "metrics"])
    p.add_argument("--url")
    p.add_argument("--ferry", default=".build/debug/ferry")
    p.add_argument("--allowed", type=lambda s: s.split(","))
    p.add_argument("--expect", type=lambda s: s.split(","))
    p.add_argument("--stranger")
    p.add_argument("--gateway-db")
    p.add_argument("--log")
    p.add_argument("--frozen-from", type=float)
    p.add_argument("--frozen-to", type=float)
    p.add_argument("--backend-db")
    p.add_argument("--backend", default="scripts/backend/ferry-backend")
    p.add_argument("--payload-bytes", type=int, default=20)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    return {"drained": cmd_drained, "acked-committed": cmd_acked_committed, "final": cmd_final, "notify": cmd_notify,
            "scan": cmd_scan, "metrics": cmd_metrics}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
