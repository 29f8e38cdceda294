"""Shared helpers for the real-BlueZ scenarios in Tests/testbed (python3 stdlib only).

A scenario file runs twice: on the host it boots the test bed (scripts/testbed run) with itself as
the guest command (`--guest`); in the guest it drives `ferry sync`, then asserts on ferry's JSON,
the SQLite store and the emulated peripherals' stats JSON. Every check is printed as it happens
(PASS/FAIL) and written to RESULTS/checks.json, which the host side reads back.

Nothing here waits without a bound: every ferry run is wrapped in `timeout`, every poll has a deadline.
"""
from __future__ import annotations

import json
import os
import shlex
import sqlite3
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FERRY = os.environ.get("FERRY_BIN", os.path.join(ROOT, ".build", "debug", "ferry"))
BLUETOOTHD_CANDIDATES = ("/usr/libexec/bluetooth/bluetoothd", "/usr/lib/bluetooth/bluetoothd")
PAYLOAD_BYTES = 20  # the bed's default --payload-bytes


# ---------------------------------------------------------------- checks

class Checks:
    def __init__(self, scenario: str):
        self.scenario = scenario
        self.items: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.items.append({"name": name, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'} {self.scenario}: {name}" + (f" — {detail}" if detail else ""), flush=True)
        return bool(ok)

    def note(self, text: str) -> None:
        print(f"     {self.scenario}: {text}", flush=True)

    @property
    def failed(self) -> int:
        return sum(1 for c in self.items if not c["ok"])

    def write(self) -> None:
        path = os.path.join(results_dir(), "checks.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"scenario": self.scenario, "checks": self.items}, f, indent=1)
        os.replace(path + ".tmp", path)

    def crashed(self, e: Exception) -> None:
        """A crash in a scenario is a failure, with its reason in checks.json and the traceback in the log."""
        import traceback
        traceback.print_exc()
        self.check("scenario ran to the end", False, f"{type(e).__name__}: {e}")

    def finish(self) -> int:
        """Writes checks.json; the guest's exit status (1 if any check failed)."""
        self.write()
        return 1 if self.failed else 0


# ---------------------------------------------------------------- host side

def host_main(scenario_file: str, scenario: str, bed_args: list[str], bed_timeout: int,
              guest_args: list[str] | None = None) -> int:
    """Boots the bed with this scenario as the guest command (with `guest_args` after --guest); returns the
    process exit status."""
    results = None
    argv = sys.argv[1:]
    if "--results" in argv:
        results = argv[argv.index("--results") + 1]
    if results is None:
        results = os.path.join(ROOT, ".testbed", "results", f"{scenario}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    os.makedirs(results, exist_ok=True)
    for stale in ("checks.json", "ferry-commands.log"):
        if os.path.exists(os.path.join(results, stale)):
            os.remove(os.path.join(results, stale))
    if not os.access(FERRY, os.X_OK):
        print(f"FAIL {scenario}: no ferry binary at {FERRY} (run `swift build` first)", flush=True)
        print(f"{scenario}: 0 passed, 1 failed")
        return 1
    cmd = [os.path.join(ROOT, "scripts", "testbed"), "run", *bed_args, "--timeout", str(bed_timeout),
           "--results", results, "--", "/usr/bin/python3", os.path.abspath(scenario_file), "--guest",
           *(guest_args or [])]
    print(f"{scenario}: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    t0 = time.monotonic()
    status = subprocess.call(cmd, cwd=ROOT)
    wall = time.monotonic() - t0
    passed = failed = 0
    try:
        with open(os.path.join(results, "checks.json")) as f:
            items = json.load(f)["checks"]
        passed = sum(1 for c in items if c["ok"])
        failed = len(items) - passed
    except (OSError, ValueError, KeyError):
        print(f"FAIL {scenario}: no checks.json from the guest (bed status {status}; see {results})", flush=True)
        failed += 1
    if status != 0 and failed == 0:
        print(f"FAIL {scenario}: guest command / bed exited {status} (see {results})", flush=True)
        failed += 1
    print(f"{scenario}: {passed} passed, {failed} failed ({wall:.0f} s wall; results {results})", flush=True)
    return 0 if failed == 0 else 1


# ---------------------------------------------------------------- guest side: environment

def results_dir() -> str:
    return os.environ["FERRY_TESTBED_RESULTS"]


def scratch() -> str:
    return os.environ["FERRY_TESTBED_SCRATCH"]


def peripherals() -> list[str]:
    return os.environ["FERRY_TESTBED_PERIPHERALS"].split()


def adapter() -> str:
    return os.environ.get("FERRY_TESTBED_ADAPTER", "hci0")


def syncproto():
    """The bed's own frame/payload definitions (the peripheral's event bytes are defined there)."""
    sys.path.insert(0, os.environ["FERRY_TESTBED_DIR"])
    import syncproto as sp  # noqa: E402
    return sp


# ---------------------------------------------------------------- ferry

class FerryRun:
    def __init__(self, args, rc, stdout, stderr, seconds):
        self.args, self.rc, self.stdout, self.stderr, self.seconds = args, rc, stdout, stderr, seconds
        self.json = None
        lines = [l for l in stdout.splitlines() if l.startswith("{")]
        if lines:
            try:
                self.json = json.loads(lines[-1])
            except ValueError:
                pass

    @property
    def error_lines(self) -> list[str]:
        return [l for l in self.stderr.splitlines() if l.strip()]

    def brief(self) -> str:
        return f"rc={self.rc} {self.seconds:.1f}s stdout={self.stdout.strip()[:300]!r} stderr={self.stderr.strip()[-300:]!r}"


def _log_command(run: FerryRun) -> None:
    with open(os.path.join(results_dir(), "ferry-commands.log"), "a") as f:
        f.write(f"$ ferry {' '.join(shlex.quote(a) for a in run.args)}\n# rc={run.rc} {run.seconds:.2f}s\n")
        f.write(run.stdout)
        f.write(run.stderr)
        f.write("\n")


def ferry(args: list[str], limit: float) -> FerryRun:
    """Runs ferry, killed by `timeout` after `limit` s (rc 124 then: a hang)."""
    t0 = time.monotonic()
    p = subprocess.run(["timeout", "-k", "5", str(int(limit)), FERRY, *args], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)  # no terminal: ferry pair must never wait for an operator
    run = FerryRun(args, p.returncode, p.stdout, p.stderr, time.monotonic() - t0)
    _log_command(run)
    return run


class FerryBackground:
    """A ferry run in the background (to do something to the stack while it syncs)."""

    def __init__(self, args: list[str], limit: float):
        self.args = args
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(["timeout", "-k", "5", str(int(limit)), FERRY, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, limit: float) -> FerryRun:
        try:
            out, err = self.proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            err += "\n[scenario: killed, ferry outlived the scenario's wait]"
        run = FerryRun(self.args, self.proc.returncode, out, err, time.monotonic() - self.t0)
        _log_command(run)
        return run


def sync_args(address: str, db: str, *extra: str, timeout: int = 120) -> list[str]:
    return ["sync", "--address", address, "--adapter", adapter(), "--db", db, "--json", "--timeout", str(timeout),
            *extra]


def bed_venv_python() -> str:
    """The bed's bumble venv python: the one scripts/testbed wrote into bed.conf (TESTBED_STATE_DIR may
    point anywhere), else the default state dir's."""
    venv = os.path.join(ROOT, ".testbed", "venv")
    try:
        with open(os.path.join(results_dir(), "bed.conf")) as f:
            for line in f:
                if line.startswith("TB_VENV="):
                    venv = line.strip().split("=", 1)[1]
    except OSError:
        pass
    return os.path.join(venv, "bin", "python")


# ---------------------------------------------------------------- peripherals

def stats(address: str) -> dict:
    path = os.path.join(results_dir(), f"peripheral-{address}.json")
    for _ in range(20):  # rewritten atomically, but be tolerant of a first write in progress
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            time.sleep(0.1)
    raise RuntimeError(f"no readable stats at {path}")


def stats_when(address: str, predicate, timeout: float = 3.0) -> dict:
    """The peripheral's stats once `predicate(stats)` holds, or the last ones after `timeout` seconds: the
    peripheral rewrites its stats file within 0.5 s of a change, so a check right after ferry exits can
    otherwise read the state from before the event it is about."""
    deadline = time.monotonic() + timeout
    while True:
        current = stats(address)
        if predicate(current) or time.monotonic() >= deadline:
            return current
        time.sleep(0.1)


def wait_stats(address: str, predicate, limit: float) -> dict | None:
    """Polls the peripheral's stats JSON until `predicate(stats)` holds; None after `limit` s."""
    deadline = time.monotonic() + limit
    while True:
        s = stats(address)
        if predicate(s):
            return s
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


def control(line: str) -> None:
    with open(os.environ["FERRY_TESTBED_CONTROL"], "w") as f:
        f.write(line + "\n")


def expected_payload(epoch: int, generation: int, seq: int) -> bytes:
    return syncproto().event_payload(epoch, generation, seq, PAYLOAD_BYTES)


# ---------------------------------------------------------------- store

def connect_read_only(path: str, timeout: float = 10) -> sqlite3.Connection:
    """A connection that can neither create nor change the file, nor (as the last connection of a read-write
    kind does when it closes) checkpoint and delete the WAL that Ferry keeps between `ferry sync` runs."""
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout)


class Store:
    """Read-side view of ferry's SQLite store (table names are the contract of PROTOCOL.md §5)."""

    def __init__(self, path: str, read_only: bool = False):
        self.db = connect_read_only(path) if read_only else sqlite3.connect(path, timeout=10)

    def close(self) -> None:
        self.db.close()

    def streams(self, peripheral: str) -> list[dict]:
        rows = self.db.execute(
            "SELECT epoch, device_epoch, cursor, active FROM stream_cursors WHERE peripheral = ? ORDER BY created_at",
            (peripheral,)).fetchall()
        return [{"epoch": r[0], "device_epoch": r[1], "cursor": r[2], "active": bool(r[3])} for r in rows]

    def frames(self, peripheral: str, epoch: str) -> dict[int, bytes]:
        return {seq: bytes(payload) for seq, payload in self.db.execute(
            "SELECT seq, payload FROM staged_frames WHERE peripheral = ? AND epoch = ?", (peripheral, str(epoch)))}

    def frame_rows(self, peripheral: str) -> int:
        return self.db.execute("SELECT count(*) FROM staged_frames WHERE peripheral = ?", (peripheral,)).fetchone()[0]

    def trusted(self) -> list[dict] | None:
        """Rows of `trusted_peripherals` (written by `ferry pair`) as dicts; None if there is no such table."""
        try:
            cur = self.db.execute("SELECT * FROM trusted_peripherals")
        except sqlite3.OperationalError:
            return None
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]

    def events(self, peripheral: str, event_type: str) -> list[dict]:
        rows = self.db.execute(
            "SELECT epoch, first_seq, last_seq, frame_count, payload FROM outbox_events "
            "WHERE peripheral = ? AND event_type = ? ORDER BY created_at", (peripheral, event_type)).fetchall()
        return [{"epoch": r[0], "first_seq": r[1], "last_seq": r[2], "frame_count": r[3], "payload": json.loads(r[4])}
                for r in rows]


def check_stream_content(checks: Checks, label: str, store: Store, peripheral: str, store_epoch: str,
                         device_epoch: int, generation: int, seqs: range) -> None:
    """Exactly the seqs `seqs`, each once, with the peripheral's deterministic bytes; the FRAMES outbox
    events of the stream account for every stored frame."""
    frames = store.frames(peripheral, store_epoch)
    missing = [s for s in seqs if s not in frames]
    extra = sorted(set(frames) - set(seqs))
    checks.check(f"{label}: store holds seqs {seqs.start}..{seqs.stop - 1} exactly once",
                 not missing and not extra and len(frames) == len(seqs),
                 f"{len(frames)} rows, missing {missing[:10]}{'...' if len(missing) > 10 else ''} "
                 f"({len(missing)}), unexpected {extra[:10]} ({len(extra)})")
    bad = [s for s in seqs if s in frames and frames[s] != expected_payload(device_epoch, generation, s)]
    checks.check(f"{label}: payloads are the peripheral's event bytes (epoch {device_epoch}, generation {generation})",
                 not bad, f"{len(bad)} differ, first {bad[:5]}")
    counted = sum(e["frame_count"] for e in store.events(peripheral, "FRAMES") if e["epoch"] == str(store_epoch))
    checks.check(f"{label}: FRAMES outbox events cover every stored frame", counted == len(frames),
                 f"outbox frame_count sum {counted}, rows {len(frames)}")


# ---------------------------------------------------------------- bluetoothd

def bluetoothd_path() -> str:
    for p in BLUETOOTHD_CANDIDATES:
        if os.access(p, os.X_OK):
            return p
    raise RuntimeError("bluetoothd not found")


def pids_named(name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == name:
                        found.append(int(entry))
            except OSError:
                pass
    return found


def bus_owns_bluez() -> bool:
    """Whether some connection owns org.bluez on the system bus (a new bluetoothd cannot start while one does)."""
    return _bus_driver_call("NameHasOwner", "org.bluez") == "true"


def wait_bluez_released(limit: float) -> bool:
    """Waits (bounded) until the bus has let go of org.bluez after bluetoothd died: it does so only once it has
    seen the old connection close, which a loaded guest can take a while to notice."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not bus_owns_bluez():
            return True
        time.sleep(0.1)
    return False


def _bus_driver_call(method: str, name: str) -> str | None:
    """The last token of a bus-driver reply (NameHasOwner → 'true', GetNameOwner → ':1.5',
    GetConnectionUnixProcessID → '123'), or None if the call failed."""
    p = subprocess.run(["dbus-send", "--system", "--print-reply", "--reply-timeout=2000", "--dest=org.freedesktop.DBus",
                        "/org/freedesktop/DBus", f"org.freedesktop.DBus.{method}", f"string:{name}"],
                       capture_output=True, text=True)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines or not lines[-1].split():
        return None
    return lines[-1].split()[-1].strip('"')


def bluez_owner_pid() -> int | None:
    """The process id of the connection that owns org.bluez, as the bus knows it; None if none owns it."""
    owner = _bus_driver_call("GetNameOwner", "org.bluez")
    pid = _bus_driver_call("GetConnectionUnixProcessID", owner) if owner else None
    return int(pid) if pid and pid.isdigit() else None


def process_state(pid: int) -> str:
    """One line on what a process is doing: its state, kernel wait channel and kernel stack (for a bed report)."""
    parts = []
    for name, path in (("state", "status"), ("wchan", "wchan"), ("stack", "stack")):
        try:
            text = open(f"/proc/{pid}/{path}").read()
        except OSError as e:
            parts.append(f"{name}: {e.strerror}")
            continue
        if name == "state":
            text = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("State:")), "?")
        parts.append(f"{name}: " + " | ".join(line for line in text.splitlines() if line))
    return f"pid {pid} " + "; ".join(parts)


def bluez_owner_report() -> str:
    """Why org.bluez is still owned after bluetoothd was killed, for a bed failure: what the owning process is
    doing (a bluetoothd stuck in the guest kernel cannot exit, and the bus keeps the name until its socket closes)
    and the kernel's last BUG lines."""
    pid = bluez_owner_pid()
    dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()
    oops = [l.strip() for l in dmesg if "BUG:" in l or "kernel BUG" in l or "list_del corruption" in l or "Oops:" in l][-3:]
    owner = process_state(pid) if pid is not None else "a connection the bus gives no process id for"
    return f"org.bluez still owned by {owner}; kernel: {oops or 'no BUG line'}"


def dbus_adapter_powered(name: str) -> bool | None:
    """Powered property of /org/bluez/NAME via dbus-send; None if the adapter is not on the bus."""
    p = subprocess.run(["dbus-send", "--system", "--print-reply", "--reply-timeout=2000", "--dest=org.bluez",
                        f"/org/bluez/{name}", "org.freedesktop.DBus.Properties.Get", "string:org.bluez.Adapter1",
                        "string:Powered"], capture_output=True, text=True)
    if p.returncode != 0:
        return None
    return "true" in p.stdout


def power_on_adapter(name: str, limit: float) -> bool:
    """Waits (bounded) for the adapter on D-Bus and powers it on."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        state = dbus_adapter_powered(name)
        if state is True:
            return True
        if state is False:
            subprocess.run(["dbus-send", "--system", "--print-reply", "--reply-timeout=5000", "--dest=org.bluez",
                            f"/org/bluez/{name}", "org.freedesktop.DBus.Properties.Set", "string:org.bluez.Adapter1",
                            "string:Powered", "variant:boolean:true"], capture_output=True)
        time.sleep(0.5)
    return False


def device_prop(address: str, name: str, adapter_name: str | None = None) -> str | None:
    """A Device1 property as dbus-send prints its value ('true', '"Ferry-P01"', ...); None if bluetoothd has
    no such device (or property)."""
    path = f"/org/bluez/{adapter_name or adapter()}/dev_{address.replace(':', '_')}"
    p = subprocess.run(["dbus-send", "--system", "--print-reply", "--reply-timeout=5000", "--dest=org.bluez", path,
                        "org.freedesktop.DBus.Properties.Get", "string:org.bluez.Device1", f"string:{name}"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return None
    return p.stdout.strip().splitlines()[-1].split()[-1]


def remove_device(address: str, adapter_name: str | None = None) -> bool:
    """Adapter1.RemoveDevice behind the gateway's back (bluetoothd forgets the device and its keys)."""
    a = adapter_name or adapter()
    p = subprocess.run(["dbus-send", "--system", "--print-reply", "--reply-timeout=10000", "--dest=org.bluez",
                        f"/org/bluez/{a}", "org.bluez.Adapter1.RemoveDevice",
                        f"objpath:/org/bluez/{a}/dev_{address.replace(':', '_')}"], capture_output=True, text=True)
    return p.returncode == 0
