#!/usr/bin/env python3
"""Guest side of scripts/bench-bluez: in ONE boot, Ferry and bleak alternate, each against its own fresh
emulated peripheral with the same events (all peripherals get the same --events; unpaced, MTU 517):

  ferry-w20        ferry sync --window 20 --ack-every 20    (stop-and-wait, the comparison with bleak)
  ferry-pipelined  ferry sync --window W --ack-every 20     (Ferry's default: W = 2000)
  bleak-w20        bleak_reader.py --window 20 --ack-every 20 (AcquireNotify, ACKs without response)

`--rounds R` runs the three R times, in a rotating order (R × 3 peripherals needed). One session at a time:
they never share the two emulated CPUs.

Measured per session:
- data phase, on the PERIPHERAL's clock: first to last DATA frame it put on the air (its stats file); the
  same yardstick for every central, start-up and connect excluded. frames/s = frames sent / data phase.
- link held: the peripheral's connection to disconnection; overhead = link held − data phase (connect,
  service resolution, STREAM_INFO, subscribe, final ACK, disconnect: what limits sessions per hour).
- CPU: Ferry's whole process, user + sys from wait4() (start-up, BlueZ object tree, connect included; all
  ferry sessions sync into one store, as on a gateway: the first creates it);
  bleak's sync phase only (time.process_time() from subscribe to the final ACK, interpreter start-up, scan
  and connect excluded: that favours bleak). Each also split into user and system time (informational).
  Also bluetoothd's and dbus-daemon's CPU over the session.
`--no-aslr` starts every central (ferry and bleak's Python alike) without address-space randomisation
(personality ADDR_NO_RANDOMIZE, as `setarch -R`): the bed's QEMU (7.2, TCG) keys the code it has translated by
virtual address, so a process whose code lands at new addresses has all of it translated again, a cost a
Raspberry Pi never pays. With it, what remains is closer to the code's own cost; the default keeps ASLR.
`--bonded` pairs the gateway with each peripheral (Just Works, `ferry pair`, before its session and not measured;
the bed's peripherals then want encryption): both centrals connect to a bonded peripheral over an encrypted
link, the production path (`ferry run` syncs only bonded peripherals), where Ferry subscribes to DATA during
its STREAM_INFO read. Without it the peripherals are open and unbonded, and Ferry reads STREAM_INFO first.
Before every session (any central, not measured) the guest's free memory is written once: see
scrub_free_memory; `--no-scrub` leaves that out.
Writes RESULTS/bench.json.
"""
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bedlib as b  # noqa: E402
import ctypes  # noqa: E402

BLEAK_PYTHON = os.environ.get("BENCH_BLEAK_PYTHON", os.path.join(b.ROOT, ".testbed", "bench-venv", "bin", "python"))
HZ = os.sysconf("SC_CLK_TCK")
ADDR_NO_RANDOMIZE = 0x0040000
NO_ASLR = "--no-aslr" in sys.argv
BONDED = "--bonded" in sys.argv
NO_SCRUB = "--no-scrub" in sys.argv
SCRUB_MARGIN = 128 << 20  # free memory left untouched by the scrub, for whatever else the guest allocates meanwhile


def without_aslr() -> None:
    """Runs in the child between fork and exec: the exec'd program and its libraries load at fixed addresses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.personality(ADDR_NO_RANDOMIZE) == -1:
        raise OSError(ctypes.get_errno(), "personality(ADDR_NO_RANDOMIZE) failed")


def scrub_free_memory() -> None:
    """Writes once to every page of the guest's free memory but SCRUB_MARGIN, then gives it back.

    The bed's QEMU (TCG) most likely keeps the code it translated from a page until the page is written, so the pages
    the previous process ran code from (bleak's interpreter and libraries, read over 9p) come back from the free
    lists still holding translations, which the next process pays to discard: Ferry right after bleak cost ~0.25 s
    more a session (measured: Hardware/TESTBED.md). A real CPU has nothing of the kind, so this runs before every
    session of every central, outside the measurement. `--no-scrub` leaves it out."""
    free = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemFree:"))
    pages = max(0, free - SCRUB_MARGIN) // mmap.PAGESIZE
    if pages == 0:
        return
    area = mmap.mmap(-1, pages * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area[::mmap.PAGESIZE] = b"\1" * pages  # one byte per page: the kernel zeroes the rest of it
    finally:
        area.close()


def launch_options() -> dict:
    return {"preexec_fn": without_aslr} if NO_ASLR else {}


def arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def daemon_cpu() -> dict:
    """user+sys seconds so far (/proc/PID/stat fields 14+15) of bluetoothd, dbus-daemon and the bed's emulated
    peripherals (peripheral.py: bumble's controller, link and GATT in Python, in this same TCG guest: what it
    uses is taken from the centrals and bluetoothd)."""
    out = {"bluetoothd": 0.0, "dbus-daemon": 0.0, "peripherals": 0.0}
    seen = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        if b"peripheral.py" in cmdline:
            name = "peripherals"
        if name in out:
            fields = stat[stat.rindex(")") + 2:].split()
            out[name] += (int(fields[11]) + int(fields[12])) / HZ
            seen.add(name)
    # Peripherals on the host (scripts/testbed --peripherals-on host): not this guest's CPU, not measured here.
    return {k: (v if k in seen or k != "peripherals" else None) for k, v in out.items()}


def run_measured(cmd: list[str], log_name: str, limit: float) -> tuple[int, str, float, resource.struct_rusage]:
    """Runs cmd; returns (rc, stdout, wall seconds, the resource usage of the process and its children)."""
    out_path = os.path.join(b.scratch(), f"{log_name}.out")
    err_path = os.path.join(b.scratch(), f"{log_name}.err")
    t0 = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, **launch_options())
        killer = threading.Timer(limit, proc.kill)
        killer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        killer.cancel()
    wall = time.monotonic() - t0
    rc = os.waitstatus_to_exitcode(status)
    stdout = open(out_path).read()
    stderr = open(err_path).read()
    with open(os.path.join(b.results_dir(), f"{log_name}.log"), "w") as f:
        f.write(f"$ {' '.join(cmd)}\n# rc={rc} {wall:.2f}s cpu={usage.ru_utime + usage.ru_stime:.3f}s\n{stdout}\n{stderr}\n")
    return rc, stdout, wall, usage


def ferry_store() -> str:
    """Every ferry session syncs into the same store, as a gateway does: the first one creates it (its creation
    is in that session's CPU), the others find it. A new file per session charged each of them the creation
    (schema, WAL switch, a dozen fsyncs): about 2.6 M of the 12 M instructions of a start-up, measured natively
    with callgrind, which no gateway pays per sync."""
    return os.path.join(b.scratch(), "ferry.sqlite")


def link_ended_since(connections_before: int):
    """A stats predicate: a connection after `connections_before` of them was made and the link is down again
    (the stats file can lag the event by 0.5 s)."""
    return lambda x: (x.get("connections", 0) > connections_before and not x.get("connected")
                      and x.get("disconnected_at") is not None
                      and x["disconnected_at"] >= (x.get("last_connected_at") or 0))


def pair(addr: str) -> None:
    """--bonded: bonds the gateway with `addr` (Just Works) and waits for the pairing's link to go down, so the
    session starts from a bonded, disconnected peripheral. Its own store: the sessions' store stays as without."""
    before = b.stats(addr).get("connections", 0)
    run = b.ferry(["pair", "--address", addr, "--adapter", b.adapter(), "--db",
                   os.path.join(b.scratch(), "pairing.sqlite"), "--timeout", "90"], 120)
    if run.rc != 0:
        raise RuntimeError(f"ferry pair {addr} exited {run.rc}: {run.stderr.strip()[-300:]}")
    b.stats_when(addr, link_ended_since(before), timeout=10)


def run_session(name: str, addr: str, events: int, window: int, ack_every: int, index: int) -> dict:
    log_name = f"{index:02d}-{name}"
    if BONDED:
        pair(addr)
    if not NO_SCRUB:
        scrub_free_memory()
    if name.startswith("ferry"):
        db = ferry_store()
        cmd = [b.FERRY, *b.sync_args(addr, db, "--notify", "acquire", "--window", str(window),
                                     "--ack-every", str(ack_every), timeout=280)]
    else:
        cmd = [BLEAK_PYTHON, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bleak_reader.py"), addr,
               str(events), "--adapter", b.adapter(), "--window", str(window), "--ack-every", str(ack_every)]
    if name.startswith("ferry"):
        # The shared libraries (libc, libm, libgcc_s; libcurl is loaded only by the uplink) come from the guest's 9p root:
        # after a bleak session (Python reading hundreds of files) they were out of the page cache again, and the
        # next ferry's start-up cost 0.8-1.2 s more CPU re-reading them (measured: 1.37 and 1.76 s against
        # 0.55-0.62 s in the same boot). A gateway loads them from its own disk, usually cached: warm them first.
        subprocess.run([b.FERRY, "--version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                       **launch_options())
    connections_before = b.stats(addr).get("connections", 0)
    before = daemon_cpu()
    rc, stdout, wall, usage = run_measured(cmd, log_name, 300)
    after = daemon_cpu()
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    reported = json.loads(lines[-1]) if lines else {}
    # The peripheral writes its stats within 0.5 s of a change: wait for the disconnection to show.
    # With --bonded the pairing's link came and went before: wait for the end of the session's own link.
    s = b.stats_when(addr, link_ended_since(connections_before), timeout=5)
    row = {"reader": name, "peripheral": addr, "rc": rc, "events": events, "window": window, "ack_every": ack_every,
           "wall_seconds": round(wall, 3), "process_cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
           "process_user_seconds": round(usage.ru_utime, 3), "process_system_seconds": round(usage.ru_stime, 3),
           "bluetoothd_cpu_seconds": round(after["bluetoothd"] - before["bluetoothd"], 3),
           "dbus_daemon_cpu_seconds": round(after["dbus-daemon"] - before["dbus-daemon"], 3),
           "peripherals_cpu_seconds": (round(after["peripherals"] - before["peripherals"], 3)
                                       if after["peripherals"] is not None and before["peripherals"] is not None else None),
           "peripheral_frames_sent": s["frames_sent"], "peripheral_notifications_sent": s["notifications_sent"],
           "peripheral_violations": s["violations"], "peripheral_acks_received": s["acks_received"],
           "peripheral_highest_ack": s["highest_ack"], "mtu": s.get("mtu"),
           "peripheral_window_wait_seconds": s.get("window_wait_seconds"), "reported": reported}
    if s.get("first_data_at") is not None and s.get("last_data_at") is not None:
        row["data_seconds"] = round(s["last_data_at"] - s["first_data_at"], 4)
    connected_at = s.get("last_connected_at", s.get("connected_at"))  # the session's link, not the pairing's
    if connected_at is not None and s.get("disconnected_at") is not None:
        row["link_seconds"] = round(s["disconnected_at"] - connected_at, 4)
    if row.get("data_seconds"):
        row["frames_per_second"] = round(s["frames_sent"] / row["data_seconds"], 1)
    if "data_seconds" in row and "link_seconds" in row:
        row["overhead_seconds"] = round(row["link_seconds"] - row["data_seconds"], 4)
    if name.startswith("ferry"):
        # Read-only: closing a read-write connection deleted the WAL that Ferry keeps between `ferry sync` runs,
        # and every ferry session paid for a new one (~6 % of its CPU in one boot, sessions alternating).
        store = b.Store(ferry_store(), read_only=True)
        frames = store.frames(addr, s["epoch"])
        store.close()
        row["delivered"] = len(frames)  # distinct seqs durably stored
        row["gaps_recorded"] = reported.get("gaps")
        row["cpu_seconds"] = row["process_cpu_seconds"]  # whole process
        row["cpu_user_seconds"], row["cpu_system_seconds"] = row["process_user_seconds"], row["process_system_seconds"]
        row["phases"] = reported.get("phases")
    else:
        row["delivered"] = reported.get("distinct", 0)
        row["gaps_recorded"] = None
        row["cpu_seconds"] = reported.get("cpu_sync_seconds")  # sync phase only
        row["cpu_user_seconds"] = reported.get("cpu_sync_user_seconds")
        row["cpu_system_seconds"] = reported.get("cpu_sync_system_seconds")
    row["lost"] = events - row["delivered"]
    if row.get("cpu_seconds") is not None and row["delivered"]:
        row["cpu_ms_per_frame"] = round(1000 * row["cpu_seconds"] / row["delivered"], 4)
    print(json.dumps(row), flush=True)
    return row


def use_local_copy_of_ferry() -> None:
    """Runs the binary from the guest's own file system, as a gateway runs it from its disk (the .deb installs it
    there). The guest's root is the host's 9p share, mounted without a page cache: every page of the 79 MB binary
    an exec touches is read through 9p again. Measured in one boot: `ferry --version` 0.95 s of CPU from the
    share against 0.37 s from the guest's tmpfs, and the start of a `ferry sync` 1.7–2.4 s against 0.8 s. That
    was the bed's cost, not Ferry's, charged to every session."""
    local = os.path.join(b.scratch(), "ferry")
    shutil.copy2(b.FERRY, local)
    b.FERRY = local
    subprocess.run([b.FERRY, "--version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                       **launch_options())


def main() -> int:
    events = int(os.environ["FERRY_TESTBED_EVENTS"])
    # The guest does not inherit the host's environment: the knobs come as arguments.
    rounds = int(arg("--rounds", "3"))
    b.FERRY = arg("--ferry", b.FERRY)  # scripts/bench-bluez passes the release build
    pipelined = int(arg("--pipelined-window", "2000"))
    readers = [("ferry-w20", 20, 20), ("bleak-w20", 20, 20), ("ferry-pipelined", pipelined, 20)]
    plan = []
    for r in range(rounds):
        k = r % len(readers)
        plan += readers[k:] + readers[:k]  # rotate: no central always first after a boot or a bleak run
    addrs = b.peripherals()
    if len(addrs) < len(plan):
        print(f"bench: {len(plan)} sessions need as many peripherals, the bed has {len(addrs)}", flush=True)
        return 2
    use_local_copy_of_ferry()
    rows = []
    for i, ((name, window, ack), addr) in enumerate(zip(plan, addrs)):
        try:
            rows.append(run_session(name, addr, events, window, ack, i))
        except Exception as e:  # one broken session must not hide the others' numbers
            rows.append({"reader": name, "peripheral": addr, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(b.results_dir(), "bench.json"), "w") as f:
        json.dump({"events": events, "rounds": rounds, "pipelined_window": pipelined, "ferry": b.FERRY,
                   "aslr": not NO_ASLR, "bonded": BONDED, "scrub": not NO_SCRUB,
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
