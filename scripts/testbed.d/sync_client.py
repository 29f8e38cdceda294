#!/usr/bin/python3
"""Reference sync client (a minimal gateway, PROTOCOL.md §4) for the test bed.

Not Ferry: a small, readable python central used to exercise the bed (measure a run of
M peripherals x K events, check that each fault knob does what it says). Drains every
peripheral in $FERRY_TESTBED_PERIPHERALS through real bluetoothd, acknowledging only what
it received intact and in order, and writes $FERRY_TESTBED_RESULTS/sync-client.json.

  scripts/testbed run --peripherals 2 --events 2000 -- /usr/bin/python3 scripts/testbed.d/sync_client.py

Options: --window N (20), --ack-every N (20), --idle S (0.25), --budget S (per peripheral, 300),
--naive (a deliberately buggy gateway that skips gaps), --allow-violations.
Exit 0 when every peripheral was drained to its head and recorded no violations.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time

import dbus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import syncproto as sp  # noqa: E402
from probe import Bluez, ProbeAbort, SyncLink, wait_for  # noqa: E402


class LinkLost(Exception):
    pass


def drain(bz: Bluez, address: str, args, stats: dict) -> None:
    cursor = 0
    epoch = None
    deadline = time.monotonic() + args.budget
    attempts = 0
    while time.monotonic() < deadline:
        attempts += 1
        if attempts > args.max_connects:
            stats["error"] = f"gave up after {args.max_connects} connections"
            return
        link = SyncLink(bz, address)
        try:
            link.connect()
            stats["connections"] += 1
            _, _, info_epoch, oldest, head = link.stream_info()
            if epoch is not None and info_epoch != epoch:
                stats["epoch_changes"] += 1
                cursor = 0  # new stream; the old one's rows would be kept by a real gateway
            elif head < cursor:
                stats["regressions"].append({"cursor": cursor, "head": head})
                cursor = head  # recorded; continue with what follows rather than drop it
            epoch = info_epoch
            link.subscribe()
            stats["cursor"] = cursor
            cursor = sync_session(link, cursor, args, stats)
            _, _, _, oldest, head = link.stream_info()
            if cursor >= head:
                stats["cursor"], stats["head"], stats["epoch"] = cursor, head, str(epoch)
                return
        except (LinkLost, ProbeAbort, dbus.DBusException, OSError) as e:
            stats["link_losses"] += 1
            cursor = stats["cursor"]
            print(f"{address}: link lost/failed ({type(e).__name__}: {e}); cursor {cursor}", flush=True)
            time.sleep(1.0)
        finally:
            try:
                link.close()
            except Exception:
                pass
            stats["cursor"] = cursor
    stats["error"] = "budget exhausted"


def sync_session(link: SyncLink, cursor: int, args, stats: dict) -> int:
    staged = 0
    in_gap = False
    silent_requests = 0
    link.write(sp.sync_req(cursor, args.window), with_response=True)
    stats["sync_reqs"] += 1
    got_since_req = False
    while True:
        ready, _, _ = select.select([link.fd], [], [], args.idle)
        frames = []
        if ready:
            chunk = os.read(link.fd, 4096)
            if not chunk:
                raise LinkLost("DATA socket closed")
            frames = link.decoder.feed(chunk)
        else:
            frames = link.decoder.on_idle()
        for f in frames:
            if f.type != sp.TYPE_DATA:
                stats["unknown_type_frames"] += 1
                continue
            got_since_req = True
            if f.seq <= cursor:
                stats["duplicates"] += 1
            elif f.seq == cursor + 1 and not in_gap:
                cursor += 1
                stats["cursor"] = cursor  # survives a link loss mid-session
                staged += 1
                stats["received"] += 1
                if staged >= args.ack_every:
                    link.write(sp.sync_ack(cursor), with_response=False)
                    stats["acks"] += 1
                    staged = 0
            elif args.naive:
                # A deliberately wrong gateway: takes a gap as "the replay skipped" and moves on.
                # The peripheral must flag its next ACK (ack_of_unreceived).
                cursor = f.seq
                stats["cursor"] = cursor
                staged += 1
                stats["received"] += 1
            else:
                if not in_gap:
                    stats["gaps_seen"] += 1
                in_gap = True  # drop the rest of the old window until idle
        if ready:
            continue
        # Idle.
        if staged:
            link.write(sp.sync_ack(cursor), with_response=False)
            stats["acks"] += 1
            staged = 0
        _, _, _, oldest, head = link.stream_info()
        if cursor >= head and not in_gap:
            link.write(sp.sync_ack(cursor), with_response=False)  # final ACK
            stats["acks"] += 1
            return cursor
        if oldest > cursor + 1:
            stats["gaps_recorded"].append([cursor + 1, oldest - 1])
            cursor = oldest - 1
            stats["cursor"] = cursor
        if not got_since_req:
            silent_requests += 1
            stats["silent_requests"] += 1
            if silent_requests >= 3:
                raise LinkLost("no DATA after 3 SYNC_REQs")
        else:
            silent_requests = 0
        in_gap = False
        got_since_req = False
        link.write(sp.sync_req(cursor, args.window), with_response=True)
        stats["sync_reqs"] += 1
    return cursor


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--ack-every", type=int, default=20)
    ap.add_argument("--idle", type=float, default=0.25)
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--max-connects", type=int, default=20)
    ap.add_argument("--allow-violations", action="store_true")
    ap.add_argument("--naive", action="store_true",
                    help="act as a buggy gateway that skips gaps (to prove the peripheral flags it)")
    args = ap.parse_args()
    peripherals = os.environ.get("FERRY_TESTBED_PERIPHERALS", "").split()
    results = os.environ.get("FERRY_TESTBED_RESULTS", ".")
    bz = Bluez(os.environ.get("FERRY_TESTBED_ADAPTER", "hci0"))
    bz.adapter.SetDiscoveryFilter({"UUIDs": dbus.Array([sp.SYNC_SERVICE_UUID], signature="s"),
                                   "Transport": dbus.String("le")}, timeout=20)
    bz.adapter.StartDiscovery(timeout=20)
    seen = wait_for(lambda: all(bz.device_path(a) in bz.objects() for a in peripherals), 30, 0.2)
    bz.adapter.StopDiscovery(timeout=20)
    if not seen:
        print("sync_client: not all peripherals discovered within 30 s")
        return 1
    report = {}
    ok = True
    t_all = time.monotonic()
    for address in peripherals:
        stats = {"received": 0, "duplicates": 0, "unknown_type_frames": 0, "gaps_seen": 0, "gaps_recorded": [],
                 "acks": 0, "sync_reqs": 0, "silent_requests": 0, "connections": 0, "link_losses": 0,
                 "epoch_changes": 0, "regressions": [], "cursor": 0}
        t0 = time.monotonic()
        drain(bz, address, args, stats)
        stats["seconds"] = round(time.monotonic() - t0, 2)
        stats["frames_per_s"] = round(stats["received"] / stats["seconds"], 1) if stats["seconds"] else None
        time.sleep(1.0)  # the peripheral writes its stats every 0.5 s
        with open(os.path.join(results, f"peripheral-{address}.json")) as f:
            pstats = json.load(f)
        stats["peripheral_violations"] = pstats["violation_list"]
        if "error" in stats or (pstats["violations"] and not args.allow_violations):
            ok = False
        report[address] = stats
        print(f"{address}: {json.dumps(stats)}", flush=True)
    report["total_seconds"] = round(time.monotonic() - t_all, 2)
    with open(os.path.join(results, "sync-client.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"sync_client: {'OK' if ok else 'FAILED'} in {report['total_seconds']} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
