#!/usr/bin/env python3
"""Field faults of issue 12 against real bluetoothd, in ONE boot of the test bed, all through `ferry run`.

 a. stall: P1 stalls after 300 frames with the link up (nothing new; each SYNC_REQ answered with ONE stale
    duplicate). `ferry run` with ONE slot: the stalled session ends within the documented bound
    (no_progress_seconds, here 15 s; a peripheral answering only with stale frames ends after 3 SYNC_REQs),
    the log names the reason, `peripheral_sync_state` records it, the slot goes to P2 which drains, and a
    later P1 session completes every event exactly once; 0 peripheral violations.
 b. bonds are the operator's: P3 (Just Works, encryption required) is paired with `ferry pair`. Then it goes
    out of range (`hide`) while another D-Bus client keeps a Device1.Connect pending on it, so every
    connect of `ferry run` fails with org.bluez.Error.InProgress. Afterwards the bond is still in BlueZ
    (Paired), ferry never called RemoveDevice, and once P3 is back the next session is encrypted from the
    stored key (no new pairing) and drains it.
 c. private addresses: P4 advertises on a resolvable private address (bumble LE privacy, its own IRK).
    `ferry pair --address <RPA>` bonds it (the pairing distributes the IRK and the static identity address);
    `ferry run` (require_bond) then finds it by its identity address although BlueZ's object path still
    names the RPA, and drains it over the encrypted link.

Host: python3 Tests/testbed/sync_field.py [--results DIR]      (build ferry first: swift build)
"""
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bedlib as b  # noqa: E402

SCENARIO = "sync_field"
EVENTS = 600
STALL_AFTER = 300
NO_PROGRESS = 15
MORE = 100
BED_ARGS = ["--peripherals", "4", "--events", str(EVENTS), "--fault", f"1:stall={STALL_AFTER}",
            "--pairing", "3:justworks", "--pairing", "4:justworks", "--privacy", "4"]


def cursor_of(db: str, addr: str) -> int:
    store = b.Store(db)
    try:
        streams = [s for s in store.streams(addr) if s["active"]]
        return int(streams[0]["cursor"]) if streams else 0
    except Exception:  # no table yet
        return 0
    finally:
        store.close()


def last_result(db: str, addr: str) -> str | None:
    import sqlite3
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            row = con.execute("SELECT last_result FROM peripheral_sync_state WHERE peripheral = ?", (addr,)).fetchone()
            return row[0] if row else None
        finally:
            con.close()
    except sqlite3.Error:
        return None


def check_drained(c: b.Checks, label: str, db: str, addr: str, seqs: range) -> None:
    s = b.stats(addr)
    epoch = int(s["epoch"])
    store = b.Store(db)
    try:
        b.check_stream_content(c, label, store, addr, str(epoch), epoch, s["generation"], seqs)
    finally:
        store.close()


class Daemon:
    """`ferry run` in the background with its log in the results dir."""

    def __init__(self, name: str, config: dict):
        self.config_path = os.path.join(b.scratch(), f"{name}.json")
        with open(self.config_path, "w") as f:
            json.dump(config, f, indent=2)
        self.log_path = os.path.join(b.results_dir(), f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(["timeout", "-k", "5", "400", b.FERRY, "run", "--config", self.config_path],
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        return rc

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()


# ---------------------------------------------------------------- a

def scenario_a(c: b.Checks, p1: str, p2: str, state_dir: str, db: str) -> None:
    daemon = Daemon("ferry-run-stall", {
        "state_dir": state_dir, "adapter": b.adapter(), "peripherals": [p1, p2], "require_bond": False,
        "max_connections": 1, "no_progress_seconds": NO_PROGRESS, "sync_interval_seconds": 3,
        "backoff_base_seconds": 1, "backoff_cap_seconds": 4, "log_level": "info"})
    s = b.wait_stats(p1, lambda s: s["faults_injected"].get("stall") == 1, 120)
    stalled_at = time.monotonic()
    # New events on P2 while P1 holds the only slot: P2 can only get them once P1's session has ended.
    b.control(f"add {p2} {MORE}")
    c.check(f"a P1 stalled after {STALL_AFTER} frames with the link up", s is not None and s["connected"] == 1,
            str(s and {k: s[k] for k in ("faults_injected", "connected", "frames_sent")}))
    s = b.wait_stats(p1, lambda s: s["connected"] == 0, NO_PROGRESS + 30)
    released = time.monotonic() - stalled_at
    c.note(f"a stalled session released the link {released:.1f} s after the stall")
    c.check(f"a the stalled session ended within the bound ({NO_PROGRESS} s + 5 s for the bed)",
            s is not None and released <= NO_PROGRESS + 5,
            f"{released:.1f} s; stale answers {s and s['stale_answers']}, SYNC_REQs {s and s['sync_reqs_received']}")
    c.check("a P1 answered SYNC_REQs with stale duplicates meanwhile", (s or {}).get("stale_answers", 0) >= 1,
            str(s and s["stale_answers"]))
    time.sleep(1.0)
    result = last_result(db, p1)
    c.check("a peripheral_sync_state records the stalled session's end (noResponse or noProgress)",
            result in ("noResponse", "noProgress"), f"last_result {result}")
    cursor_after_stall = cursor_of(db, p1)
    c.check("a the committed part of P1 is kept", STALL_AFTER - 40 <= cursor_after_stall <= STALL_AFTER,
            f"cursor {cursor_after_stall}")

    deadline = time.monotonic() + 150
    while ((cursor_of(db, p2) < EVENTS + MORE or cursor_of(db, p1) < EVENTS) and daemon.alive()
           and time.monotonic() < deadline):
        time.sleep(1.0)
    c.check("a the only slot was freed: P2 got the events added during P1's stall",
            cursor_of(db, p2) == EVENTS + MORE, f"P2 cursor {cursor_of(db, p2)}")
    c.check("a a later P1 session completed every event", cursor_of(db, p1) == EVENTS, f"P1 cursor {cursor_of(db, p1)}")
    alive = daemon.alive()
    rc = daemon.stop()
    c.check("a ferry run was running until SIGTERM and exited 0", alive and rc == 0, f"alive {alive}, exit {rc}")
    text = daemon.text()
    lines = [l for l in text.splitlines() if p1 in l and ("noResponse" in l or "no new frame committed" in l)]
    c.check("a the log names P1 and why its session ended", bool(lines), lines[0] if lines else daemon.log_path)
    check_drained(c, "a P1", db, p1, range(1, EVENTS + 1))
    check_drained(c, "a P2", db, p2, range(1, EVENTS + MORE + 1))
    for name, addr in (("P1", p1), ("P2", p2)):
        s = b.stats(addr)
        c.check(f"a {name}: 0 violations", s["violations"] == 0, f"{s['violations']} {s['violation_list'][:3]}")


# ---------------------------------------------------------------- b

def device_path(addr: str) -> str:
    return f"/org/bluez/{b.adapter()}/dev_{addr.replace(':', '_')}"


def stale_recoveries(text: str, addr: str) -> list[str]:
    """The daemon's debug lines for a connect that failed on BlueZ's stale state and what it did about it.
    bluetoothd 5.66 says `org.bluez.Error.Failed: Operation already in progress` (not Error.InProgress)."""
    return [l for l in text.splitlines() if addr in l and "resetDeviceThenRetry" in l
            and ("InProgress" in l or "already in progress" in l)]


def scenario_b(c: b.Checks, p3: str, state_dir: str, db: str) -> None:
    r = b.ferry(["pair", "--address", p3, "--adapter", b.adapter(), "--db", db, "--timeout", "60", "--json"], limit=90)
    c.check("b ferry pair P3 (Just Works): exit 0, bonded", r.rc == 0 and (r.json or {}).get("bonded") is True, r.brief())
    s = b.wait_stats(p3, lambda s: s["connected"] == 0 and s["pairings_completed"] == 1, 15)
    pairings = (s or b.stats(p3))["pairings_completed"]
    b.control(f"hide {p3}")
    b.wait_stats(p3, lambda s: s.get("hidden") is True, 10)
    # Another D-Bus client keeps a Device1.Connect pending on P3 (it is out of range, so the LE connect waits):
    # bluetoothd answers every other Connect on the device with org.bluez.Error.InProgress meanwhile.
    stop_file = os.path.join(b.scratch(), "stop-blocker")
    blocker = subprocess.Popen(
        ["bash", "-c", f"while [ ! -e {stop_file} ]; do dbus-send --system --print-reply --reply-timeout=60000 "
                       f"--dest=org.bluez {device_path(p3)} org.bluez.Device1.Connect >/dev/null 2>&1; sleep 0.05; done"])
    time.sleep(1.5)
    daemon = Daemon("ferry-run-bond", {
        "state_dir": state_dir, "adapter": b.adapter(), "peripherals": [], "max_connections": 1,
        "sync_interval_seconds": 3, "backoff_base_seconds": 1, "backoff_cap_seconds": 4,
        "connect_timeout_seconds": 10, "log_level": "debug"})
    paired_seen = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        paired_seen.add(b.device_prop(p3, "Paired"))
        text = daemon.text()
        stale = stale_recoveries(text, p3)
        if len(stale) >= 2:
            break
        time.sleep(0.5)
    text = daemon.text()
    stale = stale_recoveries(text, p3)
    c.note(f"b {len(stale)} stale-connect recoveries seen; Paired values seen {sorted(map(str, paired_seen))}")
    c.check("b ferry run's connects to P3 failed with 'Operation already in progress' repeatedly (>= 2 recoveries)",
            len(stale) >= 2, stale[0] if stale else daemon.log_path)
    c.check("b every recovery only disconnected (remove: false)", stale and all("remove: false" in l for l in stale),
            next((l for l in stale if "remove: false" not in l), ""))
    c.check("b BlueZ kept the bond throughout (Paired true at every poll)", paired_seen == {"true"},
            str(sorted(map(str, paired_seen))))
    with open(stop_file, "w"):
        pass
    try:
        blocker.wait(70)
    except subprocess.TimeoutExpired:
        blocker.kill()
    b.control(f"show {p3}")
    deadline = time.monotonic() + 120
    while cursor_of(db, p3) < EVENTS and daemon.alive() and time.monotonic() < deadline:
        time.sleep(1.0)
    c.check("b once P3 is back, ferry run drains it", cursor_of(db, p3) == EVENTS, f"cursor {cursor_of(db, p3)}")
    alive = daemon.alive()
    rc = daemon.stop()
    c.check("b ferry run was running until SIGTERM and exited 0", alive and rc == 0, f"alive {alive}, exit {rc}")
    s = b.stats(p3)
    c.check("b the session was encrypted from the stored key: no new pairing, 0 frames over a clear link",
            s["pairings_completed"] == pairings and s["last_link_encrypted"] and s["frames_sent_unencrypted"] == 0
            and s["frames_sent"] >= EVENTS,
            f"pairings {pairings} -> {s['pairings_completed']}, encrypted {s['last_link_encrypted']}, "
            f"clear frames {s['frames_sent_unencrypted']}, frames {s['frames_sent']}")
    c.check("b P3 still bonded in BlueZ afterwards", b.device_prop(p3, "Paired") == "true", str(b.device_prop(p3, "Paired")))
    c.check("b no RemoveDevice by ferry (no removal line in the log)",
            "Adapter1.RemoveDevice" not in daemon.text() and "remove C0" not in daemon.text())
    check_drained(c, "b P3", db, p3, range(1, EVENTS + 1))
    c.check("b P3: 0 violations", s["violations"] == 0, f"{s['violations']} {s['violation_list'][:3]}")


# ---------------------------------------------------------------- c

def is_rpa(addr: str) -> bool:
    return (int(addr.split(":")[0], 16) & 0xC0) == 0x40


def device_paths_with_address(addr: str) -> list[str]:
    """Device objects whose Address property is `addr` (via busctl-free dbus-send introspection of the tree)."""
    p = subprocess.run(["dbus-send", "--system", "--print-reply", "--reply-timeout=5000", "--dest=org.bluez", "/",
                        "org.freedesktop.DBus.ObjectManager.GetManagedObjects"], capture_output=True, text=True)
    paths, current = [], None
    lines = p.stdout.splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith("object path \"/org/bluez/") and "/dev_" in line and line.count("/") == 4:
            current = line.split('"')[1]
        if current and line == 'string "Address"' and i + 1 < len(lines) and f'"{addr}"' in lines[i + 1]:
            paths.append(current)
    return sorted(set(paths))


def scenario_c(c: b.Checks, p4: str, state_dir: str, db: str) -> None:
    s = b.stats(p4)
    rpa = s.get("advertising_address", p4).upper()
    c.check("c P4 advertises on a resolvable private address (not its identity)",
            s.get("privacy") is True and is_rpa(rpa) and rpa != p4, f"advertising {rpa}, identity {p4}")
    r = b.ferry(["pair", "--address", rpa, "--adapter", b.adapter(), "--db", db, "--timeout", "60", "--json"], limit=90)
    j = r.json or {}
    c.note(f"c pair: {r.brief()}")
    c.check("c ferry pair --address <RPA>: exit 0, bonded, identity address = P4's static address",
            r.rc == 0 and j.get("bonded") is True and j.get("identity_address") == p4, r.brief())
    paths = device_paths_with_address(p4)
    c.note(f"c BlueZ device objects with Address {p4}: {paths}")
    b.wait_stats(p4, lambda s: s["connected"] == 0, 15)
    pairings = b.stats(p4)["pairings_completed"]
    b.control(f"add {p4} {MORE}")
    b.wait_stats(p4, lambda s: s["head"] == EVENTS + MORE, 10)
    daemon = Daemon("ferry-run-rpa", {
        "state_dir": state_dir, "adapter": b.adapter(), "peripherals": [], "max_connections": 2,
        "sync_interval_seconds": 3, "backoff_base_seconds": 1, "backoff_cap_seconds": 4, "log_level": "debug"})
    deadline = time.monotonic() + 120
    while cursor_of(db, p4) < EVENTS + MORE and daemon.alive() and time.monotonic() < deadline:
        time.sleep(1.0)
    alive = daemon.alive()
    rc = daemon.stop()
    c.check("c ferry run (require_bond) drains the RPA peripheral by its identity address",
            cursor_of(db, p4) == EVENTS + MORE, f"cursor {cursor_of(db, p4)}; see {daemon.log_path}")
    c.check("c ferry run was running until SIGTERM and exited 0", alive and rc == 0, f"alive {alive}, exit {rc}")
    s = b.stats(p4)
    c.check("c encrypted from the stored key: no new pairing, 0 frames over a clear link",
            s["pairings_completed"] == pairings and s["last_link_encrypted"] and s["frames_sent_unencrypted"] == 0,
            f"pairings {pairings} -> {s['pairings_completed']}, encrypted {s['last_link_encrypted']}, "
            f"clear frames {s['frames_sent_unencrypted']}")
    refused = [l for l in daemon.text().splitlines() if p4 in l and "not bonded" in l]
    c.check("c never refused as 'not bonded'", not refused, refused[0] if refused else "")
    check_drained(c, "c P4", db, p4, range(1, EVENTS + MORE + 1))
    c.check("c P4: 0 violations", s["violations"] == 0, f"{s['violations']} {s['violation_list'][:3]}")


def guest() -> int:
    c = b.Checks(SCENARIO)
    p1, p2, p3, p4 = b.peripherals()[:4]
    state_dir = os.path.join(b.scratch(), "state")
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    db = os.path.join(state_dir, "ferry.sqlite")
    try:
        scenario_a(c, p1, p2, state_dir, db)
        scenario_b(c, p3, state_dir, db)
        scenario_c(c, p4, state_dir, db)
    except Exception as e:  # a crash in the scenario is a failure, with its reason in checks.json
        c.crashed(e)
    return c.finish()


if __name__ == "__main__":
    if "--guest" in sys.argv:
        sys.exit(guest())
    sys.exit(b.host_main(__file__, SCENARIO, BED_ARGS, bed_timeout=600))
