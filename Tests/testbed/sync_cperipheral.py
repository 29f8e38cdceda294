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

Host: python3 Tests/testbed/sync_cperipheral.py [--results DIR]   (builds the C parts; build ferry first)
"""
import os
import signal
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


LINUX_PERIPHERAL_ADDR = "F0:E0:D0:00:00:04"  # vhci_pair.py's second controller (public address)


def linux_payload(seq: int, size: int = 20) -> bytes:
    """What ferry-peripheral --generate puts in event seq (its generate())."""
    return bytes((seq >> (8 * (i % 8))) & 0xFF for i in range(size))


def start_linux_peripheral(state: str, generate: int) -> subprocess.Popen:
    exe = os.path.join(b.ROOT, ".build", "ferry-peripheral", "ferry-peripheral")
    log = open(os.path.join(b.results_dir(), "ferry-peripheral.log"), "a")
    return subprocess.Popen([exe, "--adapter", "hci2", "--state", state, "--generate", str(generate)],
                            stdout=log, stderr=subprocess.STDOUT)


def wait_registered(count: int, limit: float) -> bool:
    """The peripheral logged its count-th 'RegisterAdvertisement ok' (bluetoothd accepted app and ad)."""
    path = os.path.join(b.results_dir(), "ferry-peripheral.log")
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with open(path) as f:
            text = f.read()
        if text.count("RegisterAdvertisement ok") >= count and text.count("RegisterApplication ok") >= count:
            return True
        if "failed" in text:
            return False
        time.sleep(0.3)
    return False


def check_linux_content(c: b.Checks, label: str, db: str, epoch: str, last: int) -> None:
    store = b.Store(db)
    frames = store.frames(LINUX_PERIPHERAL_ADDR, epoch)
    wrong = [q for q in range(1, last + 1) if frames.get(q) != linux_payload(q)]
    c.check(f"{label} store holds seqs 1..{last} exactly once with the peripheral's bytes, no GAP",
            len(frames) == last and not wrong and not store.events(LINUX_PERIPHERAL_ADDR, "GAP"),
            f"{len(frames)} rows, {len(wrong)} missing/wrong (first {wrong[:5]}), "
            f"gaps {store.events(LINUX_PERIPHERAL_ADDR, 'GAP')}")
    store.close()


def scenario_linux_peripheral(c: b.Checks, procs: list[subprocess.Popen]) -> None:
    """Appends every process it starts to procs (the caller stops them, also after a crash)."""
    ready = os.path.join(b.scratch(), "vhci-pair.ready")
    pair = subprocess.Popen([b.bed_venv_python(), os.path.join(os.path.dirname(os.path.abspath(__file__)), "vhci_pair.py"),
                             ready], stdout=open(os.path.join(b.results_dir(), "vhci-pair.log"), "w"),
                            stderr=subprocess.STDOUT)
    procs.append(pair)
    deadline = time.monotonic() + 90
    while not os.path.exists(ready) and pair.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
    up = os.path.exists(ready) and b.power_on_adapter("hci1", 30) and b.power_on_adapter("hci2", 30)
    c.check("5 two more adapters (hci1 gateway, hci2 peripheral) on their own emulated link, powered", up,
            f"vhci_pair exit {pair.poll()}")
    if not up:
        return
    state = os.path.join(b.scratch(), "linux-peripheral")
    lp = start_linux_peripheral(state, 300)
    procs.append(lp)
    c.check("5 ferry-peripheral: bluetoothd accepted its GATT application and advertisement (hci2)",
            wait_registered(1, 60), f"exit {lp.poll()}; see ferry-peripheral.log")
    db = os.path.join(b.scratch(), "linux.sqlite")
    args = ["sync", "--address", LINUX_PERIPHERAL_ADDR, "--adapter", "hci1", "--db", db, "--json", "--timeout", "150"]
    r = b.ferry(args, limit=180)
    j = r.json or {}
    c.check("5 ferry sync (hci1) drains the Linux peripheral (hci2) through bluetoothd: caught up at 300",
            r.rc == 0 and j.get("cursor") == "300" and j.get("frames_stored") == 300, r.brief())
    epoch = j.get("epoch", "")
    check_linux_content(c, "5", db, epoch, 300)

    lp.send_signal(signal.SIGKILL)  # a power cut: only what it persisted survives
    lp.wait(10)
    lp = start_linux_peripheral(state, 200)
    procs.append(lp)
    c.check("5 restarted from its --state dir after SIGKILL, registered again", wait_registered(2, 60),
            f"exit {lp.poll()}")
    r = b.ferry(args, limit=180)
    j = r.json or {}
    c.check("5 after the restart: same epoch, 200 new events stored, caught up at 500",
            r.rc == 0 and j.get("epoch") == epoch and j.get("cursor") == "500" and j.get("frames_stored") == 200,
            r.brief())
    check_linux_content(c, "5", db, epoch, 500)


def guest() -> int:
    c = b.Checks(SCENARIO)
    addr = b.peripherals()[0]
    db = os.path.join(b.scratch(), "ferry.sqlite")
    procs: list[subprocess.Popen] = []
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
        # The final ACK's deletion reaches the stats file within 0.5 s, possibly after ferry has exited.
        s = b.stats_when(addr, lambda st: st["deleted"] == total)
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

        # 5. the Linux peripheral, real bluetoothd on both sides
        scenario_linux_peripheral(c, procs)
    except Exception as e:  # a crash in the scenario is a failure, with its reason in checks.json
        c.crashed(e)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    return c.finish()


def build_library() -> bool:
    """The guest runs the host's build (it sees the host's files): build the shared object the emulator loads
    and the Linux peripheral first."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    out = os.path.join(root, ".build", "ferry-peripheral")
    os.makedirs(out, exist_ok=True)
    src = os.path.join(root, "Hardware", "peripheral")
    lib = [os.path.join(src, "ferry_sync.c"), os.path.join(src, "ferry_ram_store.c")]
    strict = ["cc", "-Wall", "-Wextra", "-Werror", "-std=c99", "-O2"]
    dbus = subprocess.run(["pkg-config", "--cflags", "--libs", "dbus-1"], capture_output=True, text=True)
    builds = [strict + ["-pedantic", "-fPIC", "-shared", *lib, os.path.join(src, "tests", "ffi.c"),
                        "-o", os.path.join(out, "libferrysync.so")],
              strict + ["-D_POSIX_C_SOURCE=200809L", os.path.join(src, "linux", "ferry-peripheral.c"), *lib,
                        *dbus.stdout.split(), "-o", os.path.join(out, "ferry-peripheral")]]
    for cmd in builds:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or dbus.returncode != 0:
            print(f"FAIL {SCENARIO}: building {cmd[-1]} failed: {(r.stderr or dbus.stderr).strip()[:500]}", flush=True)
            print(f"{SCENARIO}: 0 passed, 1 failed")
            return False
    return True


if __name__ == "__main__":
    if "--guest" in sys.argv:
        sys.exit(guest())
    if not build_library():
        sys.exit(1)
    sys.exit(b.host_main(__file__, SCENARIO, ["--peripherals", "1", "--events", str(EVENTS), "--engine", "c"],
                         bed_timeout=900))
