#!/usr/bin/env python3
"""Real-BlueZ scenarios 1, 3 and 4 in ONE boot of the test bed (boot costs ~1-2 min under TCG):

 1. one peripheral with 5000 buffered events: `ferry sync` stores all 5000 exactly once (seqs 1..5000, the
    peripheral's bytes), cursor == head, 0 violations; a second sync transfers nothing.
 3. 2000 more events; bluetoothd SIGKILLed mid-sync and restarted: ferry recovers or fails with a clear
    one-line error within its --timeout (never hangs), never acknowledges uncommitted frames (store cursor
    >= the peripheral's highest ACK, 0 violations); a sync after the restart completes to 7000.
 4. unknown address, --adapter hci9, a peripheral without the Sync service: one-line errors, exit 1.
 5. a slow but healthy link (P2 sends 3 notifications of 20 bytes a second, so every frame spans notifications
    that come more than the 250 ms idle apart): a sync of 25 s stores frames steadily, with no corrupt run,
    no stall and no gap (a half frame waits for its rest), and acknowledges nothing uncommitted.

Host: python3 Tests/testbed/sync_clean.py [--results DIR]      (build ferry first: swift build)
"""
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bedlib as b  # noqa: E402

SCENARIO = "sync_clean"
EVENTS = 5000
MORE = 2000


def scenario_bulk(c: b.Checks, addr: str, db: str) -> None:
    r = b.ferry(b.sync_args(addr, db, timeout=240), limit=280)
    j = r.json or {}
    c.check("1 first sync exits 0, caught up", r.rc == 0 and j.get("result") == "caught up", r.brief())
    c.note(f"first sync: {j.get('frames_stored')} frames in {j.get('duration_seconds')} s via "
           f"{j.get('notify_path')} MTU {j.get('mtu')}; duplicates {j.get('duplicates')}, corrupt {j.get('corrupt')}")
    c.check("1 JSON reports 5000 frames stored, 0 gaps", j.get("frames_stored") == EVENTS and j.get("gaps") == 0, str(j))
    # The final SYNC_ACK precedes the disconnection: stats that show the disconnection show that ACK too.
    s = b.stats_when(addr, lambda st: st["disconnections"] >= 1 and st["connected"] == 0)
    epoch = int(s["epoch"])
    store = b.Store(db)
    streams = store.streams(addr)
    c.check("1 one stream, keyed by the peripheral's epoch, cursor == head",
            len(streams) == 1 and streams[0]["epoch"] == str(epoch) and streams[0]["cursor"] == s["head"] == EVENTS,
            f"streams {streams}, peripheral head {s['head']}")
    b.check_stream_content(c, "1", store, addr, str(epoch), epoch, s["generation"], range(1, EVENTS + 1))
    c.check("1 no GAP or REGRESSION events", not store.events(addr, "GAP") and not store.events(addr, "REGRESSION"))
    c.check("1 peripheral: 0 violations, everything acknowledged and deleted",
            s["violations"] == 0 and s["highest_ack"] == EVENTS and s["deleted"] == EVENTS,
            f"violations {s['violations']} {s['violation_list'][:3]}, highest_ack {s['highest_ack']}, deleted {s['deleted']}")
    store.close()

    sent_before = s["frames_sent"]
    r2 = b.ferry(b.sync_args(addr, db, timeout=60), limit=90)
    j2 = r2.json or {}
    s2 = b.stats_when(addr, lambda st: st["disconnections"] > s["disconnections"] and st["connected"] == 0)
    store = b.Store(db)
    c.check("1 second sync: caught up, 0 frames stored, nothing sent",
            r2.rc == 0 and j2.get("frames_stored") == 0 and j2.get("cursor") == str(EVENTS)
            and s2["frames_sent"] == sent_before and store.frame_rows(addr) == EVENTS,
            f"{r2.brief()}; frames_sent {sent_before} -> {s2['frames_sent']}; rows {store.frame_rows(addr)}")
    store.close()


def scenario_bluetoothd_kill(c: b.Checks, addr: str, db: str) -> subprocess.Popen | None:
    b.control(f"add {addr} {MORE}")
    c.check(f"3 peripheral has {MORE} new events",
            b.wait_stats(addr, lambda s: s["head"] == EVENTS + MORE, 15) is not None)
    ferry_timeout = 60
    bg = b.FerryBackground(b.sync_args(addr, db, "--verbose", timeout=ferry_timeout), limit=ferry_timeout + 30)
    progressed = b.wait_stats(addr, lambda s: s["highest_ack"] >= EVENTS + 300 or not bg.running(), 60)
    old = b.pids_named("bluetoothd")
    c.check("3 sync under way before the kill (peripheral acked past 5300), one bluetoothd",
            progressed is not None and progressed["highest_ack"] >= EVENTS + 300 and bg.running() and len(old) == 1,
            f"highest_ack {progressed and progressed['highest_ack']}, ferry running {bg.running()}, bluetoothd {old}")
    killed_at = time.monotonic()
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    time.sleep(1.0)
    released = b.wait_bluez_released(15)
    c.check("3 the bus released org.bluez after the kill", released, "" if released else b.bluez_owner_report())
    # Restart while ferry may still be running: the command sees the name come back.
    log = open(os.path.join(b.results_dir(), "bluetoothd-restarted.log"), "w")
    restarted = subprocess.Popen([b.bluetoothd_path(), "-n", "-d"], stdout=log, stderr=subprocess.STDOUT)
    powered = b.power_on_adapter(b.adapter(), 30)
    c.check("3 bluetoothd restarted, adapter powered again", powered)
    r = bg.wait(ferry_timeout + 40)
    since_kill = time.monotonic() - killed_at
    j = r.json or {}
    c.note(f"after SIGKILL: ferry exit {r.rc} {since_kill:.1f} s after the kill; json {j}; "
           f"stderr tail {r.error_lines[-3:]}")
    c.check("3 ferry did not hang: exited on its own within --timeout",
            r.rc not in (124, 137, -9) and r.seconds <= ferry_timeout + 10, r.brief())
    failure_lines = [l for l in r.error_lines if l.startswith("ferry: ")]
    c.check("3 recovered (exit 0) or failed with one 'ferry: ...' line that names bluetoothd",
            r.rc == 0 or (r.rc == 1 and len(failure_lines) == 1 and "bluetoothd" in failure_lines[0]),
            f"rc {r.rc}, error lines {failure_lines}")
    s = b.stats(addr)
    store = b.Store(db)
    cursor = store.streams(addr)[0]["cursor"]
    c.check("3 never acknowledged uncommitted frames: store cursor >= peripheral highest_ack, 0 violations",
            cursor >= s["highest_ack"] and s["violations"] == 0,
            f"cursor {cursor}, highest_ack {s['highest_ack']}, violations {s['violations']} {s['violation_list'][:3]}")
    store.close()

    r2 = b.ferry(b.sync_args(addr, db, timeout=120), limit=150)
    j2 = r2.json or {}
    c.check("3 sync after the restart completes to 7000",
            r2.rc == 0 and j2.get("cursor") == str(EVENTS + MORE), r2.brief())
    s = b.stats(addr)
    epoch = int(s["epoch"])
    store = b.Store(db)
    b.check_stream_content(c, "3", store, addr, str(epoch), epoch, s["generation"], range(1, EVENTS + MORE + 1))
    c.check("3 no GAP events, 0 violations", not store.events(addr, "GAP") and s["violations"] == 0,
            f"gaps {store.events(addr, 'GAP')}, violations {s['violations']}")
    store.close()
    return restarted


def one_clear_error(r: b.FerryRun) -> bool:
    return r.rc == 1 and len(r.error_lines) == 1 and r.error_lines[0].startswith("ferry: ")


def scenario_errors(c: b.Checks, db: str) -> None:
    r = b.ferry(["sync", "--address", "C0:FF:EE:00:09:99", "--db", db, "--timeout", "8"], limit=30)
    c.check("4 unknown address: exit 1, one line saying not found",
            one_clear_error(r) and "not found" in r.stderr, r.brief())
    r = b.ferry(["sync", "--address", b.peripherals()[0], "--adapter", "hci9", "--db", db, "--timeout", "20"],
                limit=45)
    c.check("4 --adapter hci9: exit 1, one line naming the adapter",
            one_clear_error(r) and "hci9" in r.stderr, r.brief())

    # A device that advertises the Sync UUID but has no Sync service, on its own adapter hci1.
    ready = os.path.join(b.scratch(), "foreign.ready")
    foreign_addr = "C0:FF:EE:00:0F:01"
    venv_python = b.bed_venv_python()
    log = open(os.path.join(b.results_dir(), "foreign-peripheral.log"), "w")
    foreign = subprocess.Popen([venv_python, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                          "foreign_peripheral.py"), foreign_addr, ready],
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while not os.path.exists(ready) and foreign.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
    up = os.path.exists(ready) and b.power_on_adapter("hci1", 30)
    c.check("4 foreign (non-Sync) peripheral up on hci1", up, f"exit {foreign.poll()}")
    if up:
        r = b.ferry(["sync", "--address", foreign_addr, "--adapter", "hci1", "--db", db, "--timeout", "40"],
                    limit=70)
        c.check("4 not a Sync peripheral: exit 1, one line saying so",
                one_clear_error(r) and "not a Sync peripheral" in r.stderr, r.brief())
    foreign.terminate()
    try:
        foreign.wait(10)
    except subprocess.TimeoutExpired:
        foreign.kill()


SLOW_SECONDS = 25


def scenario_slow_link(c: b.Checks, addr: str, db: str) -> None:
    r = b.ferry(b.sync_args(addr, db, timeout=SLOW_SECONDS), limit=SLOW_SECONDS + 30)
    j = r.json or {}
    c.note(f"5: {r.brief()}")
    c.check("5 slow link: the sync ran until its --timeout (exit 1, 'timeout after ...')",
            r.rc == 1 and str(j.get("result", "")).startswith("timeout"), r.brief())
    # 3 notifications/s of 20 bytes carry ~1.7 frames/s: ~20 s of data after connecting is ~35 frames.
    c.check("5 slow link: frames stored steadily (>= 15), no corrupt run, no stall, no gap",
            (j.get("frames_stored") or 0) >= 15 and j.get("corrupt") == 0 and j.get("stalls") == 0
            and j.get("gaps") == 0, str({k: j.get(k) for k in ("frames_stored", "corrupt", "stalls", "gaps", "duplicates")}))
    s = b.stats_when(addr, lambda st: st["connected"] == 0)
    store = b.Store(db)
    streams = store.streams(addr)
    store.close()
    cursor = streams[0]["cursor"] if streams else -1
    c.check("5 slow link: store cursor == frames stored >= the peripheral's highest ACK, 0 violations",
            cursor == j.get("frames_stored") and cursor >= s["highest_ack"] and s["violations"] == 0,
            f"cursor {cursor}, highest_ack {s['highest_ack']}, violations {s['violations']}")


def guest() -> int:
    c = b.Checks(SCENARIO)
    addr = b.peripherals()[0]
    db = os.path.join(b.scratch(), "ferry.sqlite")
    restarted = None
    try:
        scenario_bulk(c, addr, db)
        restarted = scenario_bluetoothd_kill(c, addr, db)
        scenario_errors(c, os.path.join(b.scratch(), "errors.sqlite"))
        scenario_slow_link(c, b.peripherals()[1], os.path.join(b.scratch(), "slow.sqlite"))
    except Exception as e:  # a crash in the scenario is a failure, with its reason in checks.json
        c.crashed(e)
    finally:
        if restarted is not None:  # the bluetoothd this scenario started (the bed stops its own)
            restarted.terminate()
            try:
                restarted.wait(10)
            except subprocess.TimeoutExpired:
                restarted.kill()
    return c.finish()


if __name__ == "__main__":
    if "--guest" in sys.argv:
        sys.exit(guest())
    sys.exit(b.host_main(__file__, SCENARIO, ["--peripherals", "2", "--events", str(EVENTS), "--fault", "2:slow=3"],
                         bed_timeout=900))
