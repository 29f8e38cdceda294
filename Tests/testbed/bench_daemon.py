#!/usr/bin/env python3
"""Guest side of scripts/bench-daemon (a benchmark, not a test): `ferry run` draining 1, 3 and 5 peripherals at
once, then idle.

For each count N (default 1, 3, 5) a new daemon gets N fresh emulated peripherals (the bed's --events each,
unpaced, MTU 517) on its allowlist, N connection slots, no uplink and no re-sync, with Ferry's default window
and ACK cadence (or --window / --ack-every). Measured per N:
  - aggregate frames/s: every frame the N peripherals put on the air / (last DATA frame of any − first DATA
    frame of any), on the peripherals' own clock;
  - the daemon's CPU (user+sys of the process, /proc/PID/stat) from its start until every peripheral got its
    final SYNC_ACK, per frame; and the part between the first DATA frame and that end (the drain);
  - bluetoothd's and dbus-daemon's CPU over the same span;
  - lossless: every event in the store exactly once, 0 protocol violations at the peripherals;
  - the daemon's peak resident set by then (VmHWM in /proc/PID/status), and its resident set at the end.
After the last N, the daemon stays up with nothing to do (every peripheral caught up, the next sync an hour
away) for two windows of --idle-seconds (default 60) each: its CPU over each, as a share of one core.
  - "after the drains": from 2 s after the last link was released. It holds what follows a drain: bluetoothd
    removes each unbonded peripheral's device and GATT objects TemporaryTimeout (30 s) after it disconnected,
    and the daemon's object cache receives every removal.
  - "steady": the next window, once that is over: the daemon's own turns (scheduling loop, storage watch,
    trusted re-read, every 5 s) and the Swift runtime's.
  Per 10 s, and per thread of the daemon (/proc/PID/task), for both. Thread names are the kernel's: at most 15
  characters, and libdispatch's workers keep the end of their queue's name ("-qos.overcommit" is
  com.apple.root.default-qos.overcommit). Threads that exit within a window count in its total only.

Usage (in the bed): bench_daemon.py --ferry BIN [--counts 1,3,5] [--idle-seconds 60] [--window N] [--ack-every N]
Writes RESULTS/bench-daemon.json and prints one JSON line per N.
"""
import json
import os
import signal
import subprocess
import sys
import time

import bedlib as b
from bench_guest import HZ, arg, daemon_cpu, use_local_copy_of_ferry


def stat_cpu(path: str) -> tuple[str, float] | None:
    """(name, user+system CPU seconds) from a /proc stat file, of a process or of one of its threads."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / HZ


def process_cpu(pid: int) -> float | None:
    found = stat_cpu(f"/proc/{pid}/stat")
    return found[1] if found else None


def memory_kb(pid: int) -> dict[str, int]:
    """The process's resident set now (VmRSS) and at its peak (VmHWM), in kB."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return found


def thread_cpu(pid: int) -> dict[str, tuple[str, float]]:
    """Thread id → (name, CPU seconds), for the threads alive now."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    found = {tid: stat_cpu(f"/proc/{pid}/task/{tid}/stat") for tid in tids}
    return {tid: value for tid, value in found.items() if value is not None}


def idle_window(pid: int, seconds: float) -> dict | None:
    """The process's CPU over `seconds`, per 10 s, and per thread name: what the threads alive at the end used in
    the window (threads that exited meanwhile are in the total only). Per thread id first, then summed by name, so
    a worker that exited and another of the same name that started do not cancel out."""
    cpu0, threads0 = process_cpu(pid), thread_cpu(pid)
    profile = []
    last, left = cpu0, seconds
    while left > 0:
        step = min(10.0, left)
        time.sleep(step)
        left -= step
        now_cpu = process_cpu(pid)
        if last is not None and now_cpu is not None:
            profile.append(round(now_cpu - last, 3))
        last = now_cpu
    threads1 = thread_cpu(pid)
    if cpu0 is None or last is None:
        return None
    per_name: dict[str, float] = {}
    for tid, (name, cpu) in threads1.items():
        per_name[name] = per_name.get(name, 0.0) + cpu - threads0.get(tid, (name, 0.0))[1]
    return {"seconds": seconds, "cpu_seconds": round(last - cpu0, 3),
            "percent_of_a_core": round(100 * (last - cpu0) / seconds, 3), "cpu_seconds_per_10s": profile,
            "cpu_seconds_per_thread": {k: round(v, 3) for k, v in sorted(per_name.items(), key=lambda kv: -kv[1])
                                       if v > 0}}


def run_daemon(n: int, addrs: list[str], events: int, idle_seconds: float, cadence: dict) -> dict:
    state = os.path.join(b.scratch(), f"daemon-{n}")
    os.makedirs(state, mode=0o700, exist_ok=True)
    config = os.path.join(b.scratch(), f"daemon-{n}.json")
    with open(config, "w") as f:
        json.dump({"state_dir": state, "adapter": b.adapter(), "peripherals": addrs, "require_bond": False,
                   "max_connections": n, "sync_interval_seconds": 3600, "log_level": "info", **cadence}, f)
    log_path = os.path.join(b.results_dir(), f"bench-daemon-{n}.log")
    before = daemon_cpu()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([b.FERRY, "run", "--config", config], stdout=log, stderr=subprocess.STDOUT)
    row: dict = {"sessions": n, "peripherals": addrs, "events_each": events}
    cpu_at_first_data = None
    bus_at_first_data = None
    done = False
    deadline = t0 + 120 + events * n / 20  # a bound against a hang, not a timing
    while time.monotonic() < deadline and proc.poll() is None:
        stats = [b.stats(a) for a in addrs]
        if cpu_at_first_data is None and any(s.get("frames_sent", 0) > 0 for s in stats):
            cpu_at_first_data = process_cpu(proc.pid)
            bus_at_first_data = daemon_cpu()
        if all(s.get("highest_ack", 0) >= events for s in stats):
            done = True
            break
        time.sleep(0.2)
    end_cpu = process_cpu(proc.pid)
    after = daemon_cpu()
    memory = memory_kb(proc.pid)
    if "VmHWM" in memory:
        row["peak_rss_kb"] = memory["VmHWM"]
    row["wall_seconds"] = round(time.monotonic() - t0, 3)
    row["caught_up"] = done
    # The peripherals write their stats within 0.5 s of a change: wait for the last DATA times to settle.
    time.sleep(1.0)
    stats = [b.stats(a) for a in addrs]
    firsts = [s["first_data_at"] for s in stats if s.get("first_data_at") is not None]
    lasts = [s["last_data_at"] for s in stats if s.get("last_data_at") is not None]
    sent = sum(s.get("frames_sent", 0) for s in stats)
    row["frames_sent"] = sent
    row["violations"] = sum(s.get("violations", 0) for s in stats)
    if firsts and lasts and max(lasts) > min(firsts):
        row["data_seconds"] = round(max(lasts) - min(firsts), 3)
        row["aggregate_frames_per_second"] = round(sent / row["data_seconds"], 1)
    total_frames = n * events
    if end_cpu is not None:
        row["cpu_seconds"] = round(end_cpu, 3)
        row["cpu_ms_per_frame"] = round(1000 * end_cpu / total_frames, 4)
        if cpu_at_first_data is not None:
            row["drain_cpu_seconds"] = round(end_cpu - cpu_at_first_data, 3)
            row["drain_cpu_ms_per_frame"] = round(1000 * (end_cpu - cpu_at_first_data) / total_frames, 4)
    row["bluetoothd_cpu_seconds"] = round(after["bluetoothd"] - before["bluetoothd"], 3)
    row["dbus_daemon_cpu_seconds"] = round(after["dbus-daemon"] - before["dbus-daemon"], 3)
    if bus_at_first_data is not None:
        row["bluetoothd_drain_cpu_seconds"] = round(after["bluetoothd"] - bus_at_first_data["bluetoothd"], 3)
    if idle_seconds > 0 and done and proc.poll() is None:
        # Idle: every link released (sync and release), nothing due for an hour.
        b.wait_stats(addrs[-1], lambda s: s.get("connected", 0) == 0, 15)
        time.sleep(2.0)
        for key in ("idle", "idle_steady"):
            window = idle_window(proc.pid, idle_seconds)
            if window is None:
                break
            row[f"{key}_seconds"] = window["seconds"]
            row[f"{key}_cpu_seconds"] = window["cpu_seconds"]
            row[f"{key}_cpu_percent_of_a_core"] = window["percent_of_a_core"]
            row[f"{key}_cpu_seconds_per_10s"] = window["cpu_seconds_per_10s"]
            row[f"{key}_cpu_seconds_per_thread"] = window["cpu_seconds_per_thread"]
    if "VmRSS" in memory_kb(proc.pid):
        row["rss_kb_at_end"] = memory_kb(proc.pid)["VmRSS"]
    proc.send_signal(signal.SIGTERM)
    try:
        row["exit"] = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        row["exit"] = "killed after 30 s"
    delivered = 0
    store = b.Store(os.path.join(state, "ferry.sqlite"))
    for a, s in zip(addrs, stats):
        delivered += len(store.frames(a, s["epoch"])) if s.get("epoch") is not None else 0
    store.close()
    row["delivered"] = delivered
    row["lost"] = total_frames - delivered
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    events = int(os.environ["FERRY_TESTBED_EVENTS"])
    b.FERRY = arg("--ferry", b.FERRY)
    counts = [int(c) for c in arg("--counts", "1,3,5").split(",")]
    idle_seconds = float(arg("--idle-seconds", "60"))
    # Ferry's defaults unless given: the config keys `window` and `ack_every`.
    given = {"window": arg("--window", ""), "ack_every": arg("--ack-every", "")}
    cadence = {key: int(value) for key, value in given.items() if value}
    addrs = b.peripherals()
    if len(addrs) < sum(counts):
        print(f"bench-daemon: {sum(counts)} peripherals needed, the bed has {len(addrs)}", flush=True)
        return 2
    use_local_copy_of_ferry()
    rows = []
    for i, n in enumerate(counts):
        start = sum(counts[:i])
        last = i == len(counts) - 1
        try:
            rows.append(run_daemon(n, addrs[start:start + n], events, idle_seconds if last else 0, cadence))
        except Exception as e:  # one broken run must not hide the others' numbers
            rows.append({"sessions": n, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(b.results_dir(), "bench-daemon.json"), "w") as f:
        json.dump({"events_each": events, "ferry": b.FERRY, **cadence, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
