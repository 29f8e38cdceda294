#!/usr/bin/env python3
"""Real-BlueZ proof of the C peripheral library (Hardware/peripheral) in ONE boot of the test bed.

The bed's bumble peripheral runs with `--engine c`: CONTROL parsing, SYNC_REQ/SYNC_ACK, the window, framing,
CRC, notification packing, STREAM_INFO, seq/epoch and restart-from-persisted-meta are the C library's
(through ctypes, scripts/testbed.d/cengine.py); bumble only does GATT and the link. `ferry sync` drains it
through the real bluetoothd:

 1. 300 buffered events: all stored exactly once, cursor == head, everything acknowledged and deleted, the
    library refused/clamped nothing; a second sync transfers nothing.
 2. link drop: 900 more events, the peripheral drops the link mid-sync (control `disconnect`); nothing
    acknowledged that is not committed; the next sync resumes and ends with 1..1200 exactly once, no GAP.
 3. peripheral restart: 600 more, mid-sync the peripheral reboots (control `restart`: link dropped, the C
    library re-initialised from the persisted head/epoch/deleted_through); the next sync resumes: 1..1800
    exactly once, same epoch, no GAP.
 4. store wipe (control `wipe`): the library draws a new epoch, seq restarts at 1; Ferry opens a new stream
    with the 300 new events, the old rows are kept.

Host: python3 Tests/testbed/sync_cperipheral.py [--results DIR]   (builds the .so; build ferry first)
"""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bedlib as b  # noqa: E402

SCENARIO = "sync_cperipheral"
EVENTS = 300
DROP_MORE = 900
RESTART_MORE = 600


def check_clean(c: b.Checks, label: str, addr: str) -> dict:
    s = b.stats(addr)
    lib = s.get("c_library", {})
    c.check(f"{label} C library refused or clamped nothing (0 malformed writes, 0 ACKs beyond sent)",
            s["violations"] == 0, f"violations {s['violations']} {s['violation_list'][:3]}; library {lib}")
    return s


def sync_until(c: b.Checks, label: str, addr: str, db: str, target: int, tries: int = 3) -> dict:
    """`ferry sync` to the head; a run that ends early under load is retried (each try is a resume)."""
    j: dict = {}
    r = None
    for _ in range(tries):
        r = b.ferry(b.sync_args(addr, db, timeout=150), limit=180)
        j = r.json or {}
        if r.rc == 0 and j.get("cursor") == str(target):
            break
        c.note(f"{label}: sync ended early, resuming: {r.brief()}")
    c.check(f"{label} sync exits 0, caught up at {target}", r is not None and r.rc == 0 and j.get("cursor") == str(target),
            r.brief() if r else "")
    return j



def interrupted_sync(c: b.Checks, label: str, addr: str, db: str, command: str, past: int) -> None:
    """Starts a sync, waits until the peripheral has released events past `past`, sends the control
    command that cuts the link, and checks ferry ended on its own without acknowledging uncommitted frames."""
    bg = b.FerryBackground(b.sync_args(addr, db, "--verbose", timeout=120), limit=150)
    progressed = b.wait_stats(addr, lambda s: s["highest_ack"] >= past or not bg.running(), 90)
    c.check(f"{label} sync under way (acknowledged past {past}) before the {command.split()[0]}",
            progressed is not None and progressed["highest_ack"] >= past and bg.running(),
            f"highest_ack {progressed and progressed['highest_ack']}, ferry running {bg.running()}")
    b.control(f"{command} {addr}")
    r = bg.wait(160)
    c.note(f"{label} interrupted sync: {r.brief()}")
    c.check(f"{label} ferry ended on its own after the link loss (exit 0 after resuming, or 1 with one line)",
            r.rc == 0 or (r.rc == 1 and len([l for l in r.error_lines if l.startswith("ferry: ")]) == 1), r.brief())
    s = b.stats_when(addr, lambda st: st["disconnections"] >= 1)
    store = b.Store(db)
    streams = [x for x in store.streams(addr) if x["active"]]
    cursor = streams[0]["cursor"] if streams else -1
    c.check(f"{label} store cursor >= the library's highest ACK (nothing acknowledged uncommitted)",
            cursor >= s["highest_ack"], f"cursor {cursor}, highest_ack {s['highest_ack']}")
    store.close()


def guest() -> int:
    c = b.Checks(SCENARIO)
    addr = b.peripherals()[0]
    db = os.path.join(b.scratch(), "ferry.sqlite")
    try:
        s = b.stats(addr)
        c.check("0 the peripheral runs the C library (--engine c)", "c_library" in s, str(sorted(s)[:8]))

        # 1. bulk
        j = sync_until(c, "1", addr, db, EVENTS, tries=1)
        c.note(f"1: {j.get('frames_stored')} frames in {j.get('duration_seconds')} s, MTU {j.get('mtu')}, "
               f"duplicates {j.get('duplicates')}, corrupt {j.get('corrupt')}")
        s = b.stats_when(addr, lambda st: st["highest_ack"] == EVENTS)
        epoch = int(s["epoch"])
        store = b.Store(db)
        b.check_stream_content(c, "1", store, addr, str(epoch), epoch, s["generation"], range(1, EVENTS + 1))
        c.check("1 everything acknowledged and deleted by the library, STREAM_INFO oldest 0",
                s["highest_ack"] == EVENTS and s["deleted"] == EVENTS and s["oldest"] == 0,
                f"highest_ack {s['highest_ack']}, deleted {s['deleted']}, oldest {s['oldest']}")
        store.close()
        check_clean(c, "1", addr)
        sent = s["frames_sent"]
        r = b.ferry(b.sync_args(addr, db, timeout=60), limit=90)
        s = b.stats(addr)
        c.check("1 second sync: caught up, nothing sent", r.rc == 0 and (r.json or {}).get("frames_stored") == 0
                and s["frames_sent"] == sent, f"{r.brief()}; frames_sent {sent} -> {s['frames_sent']}")

        # 2. link drop mid-sync
        total = EVENTS + DROP_MORE
        b.control(f"add {addr} {DROP_MORE}")
        c.check(f"2 peripheral head {total}", b.wait_stats(addr, lambda st: st["head"] == total, 20) is not None)
        interrupted_sync(c, "2", addr, db, "disconnect", EVENTS + 200)
        sync_until(c, "2", addr, db, total)
        s = b.stats(addr)
        store = b.Store(db)
        b.check_stream_content(c, "2", store, addr, str(epoch), epoch, s["generation"], range(1, total + 1))
        c.check("2 no GAP, one stream", not store.events(addr, "GAP") and len(store.streams(addr)) == 1,
                f"gaps {store.events(addr, 'GAP')}, streams {store.streams(addr)}")
        store.close()
        check_clean(c, "2", addr)

        # 3. peripheral restart mid-sync (state reloaded from what the library persisted)
        total += RESTART_MORE
        b.control(f"add {addr} {RESTART_MORE}")
        c.check(f"3 peripheral head {total}", b.wait_stats(addr, lambda st: st["head"] == total, 20) is not None)
        interrupted_sync(c, "3", addr, db, "restart", total - RESTART_MORE + 200)
        s = b.stats(addr)
        c.check("3 after the restart: same epoch, head kept", int(s["epoch"]) == epoch and s["head"] == total,
                f"epoch {s['epoch']} (was {epoch}), head {s['head']}")
        sync_until(c, "3", addr, db, total)
        s = b.stats(addr)
        store = b.Store(db)
        b.check_stream_content(c, "3", store, addr, str(epoch), epoch, s["generation"], range(1, total + 1))
        c.check("3 no GAP or REGRESSION, one stream", not store.events(addr, "GAP")
                and not store.events(addr, "REGRESSION") and len(store.streams(addr)) == 1,
                f"gaps {store.events(addr, 'GAP')}, streams {store.streams(addr)}")
        c.check("3 the library deleted exactly what was acknowledged", s["deleted"] == total and s["oldest"] == 0,
                f"deleted {s['deleted']}, oldest {s['oldest']}")
        store.close()
        check_clean(c, "3", addr)

        # 4. store wipe: a new epoch from the library's random callback, seq from 1
        b.control(f"wipe {addr}")
        s = b.wait_stats(addr, lambda st: int(st["epoch"]) != epoch and st["head"] == EVENTS, 20)
        c.check(f"4 wipe: new nonzero epoch, head = the {EVENTS} new events", s is not None and int(s["epoch"]) != 0,
                str(s and (s["epoch"], s["head"])))
        if s is not None:
            epoch2 = int(s["epoch"])
            sync_until(c, "4", addr, db, EVENTS)
            s = b.stats(addr)
            store = b.Store(db)
            new = [x for x in store.streams(addr) if x["epoch"] == str(epoch2)]
            c.check(f"4 a new stream keyed by the new epoch at cursor {EVENTS}; the old stream's rows are kept",
                    len(new) == 1 and new[0]["cursor"] == EVENTS and len(store.frames(addr, str(epoch))) == total,
                    f"streams {store.streams(addr)}")
            b.check_stream_content(c, "4", store, addr, str(epoch2), epoch2, s["generation"], range(1, EVENTS + 1))
            store.close()
            check_clean(c, "4", addr)
    except Exception as e:  # a crash in the scenario is a failure, with its reason in checks.json
        c.crashed(e)
    return c.finish()


def build_library() -> bool:
    """The guest loads the host's build (it sees the host's files): build the shared object first."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    out = os.path.join(root, ".build", "ferry-peripheral")
    os.makedirs(out, exist_ok=True)
    src = os.path.join(root, "Hardware", "peripheral")
    cmd = ["cc", "-Wall", "-Wextra", "-Werror", "-std=c99", "-pedantic", "-O2", "-fPIC", "-shared",
           os.path.join(src, "ferry_sync.c"), os.path.join(src, "ferry_ram_store.c"), os.path.join(src, "tests", "ffi.c"),
           "-o", os.path.join(out, "libferrysync.so")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"FAIL {SCENARIO}: building libferrysync.so failed: {r.stderr.strip()[:500]}", flush=True)
        print(f"{SCENARIO}: 0 passed, 1 failed")
    return r.returncode == 0


if __name__ == "__main__":
    if "--guest" in sys.argv:
        sys.exit(guest())
    if not build_library():
        sys.exit(1)
    sys.exit(b.host_main(__file__, SCENARIO, ["--peripherals", "1", "--events", str(EVENTS), "--engine", "c"],
                         bed_timeout=900))
