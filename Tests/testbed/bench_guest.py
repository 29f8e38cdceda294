#!/usr/bin/env python3
"""Guest side of scripts/bench-bluez: in ONE boot (one --notify-rate), four readers of the same stream, one
peripheral each, one after the other (so they never share the 2 emulated CPUs):

  ferry-acquire  ferry sync --notify acquire --window W   (the Sync protocol: ACK per 20, gap re-request)
  ferry-start    ferry sync --notify start   --window W
  bleak-start    bleak_reader.py (bleak's default StartNotify), one SYNC_REQ(0, 65535), no ACK, no re-request
  bleak-acquire  bleak_reader.py --acquire

Rates come from the peripheral's stats JSON, polled every 0.1 s (the peripheral rewrites it within 0.5 s of
a change): data phase = first poll with frames_sent > 0 to the first poll where the reader is done.
Writes RESULTS/bench.json.
"""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bedlib as b  # noqa: E402

BLEAK_PYTHON = os.environ.get("BENCH_BLEAK_PYTHON", os.path.join(b.ROOT, ".testbed", "bench-venv", "bin", "python"))


def watch(addr: str, proc: subprocess.Popen, limit: float) -> dict:
    """Polls the peripheral's stats while `proc` runs; returns the data-phase timing."""
    t_first = t_last_change = None
    deadline = time.monotonic() + limit
    last = None
    while proc.poll() is None and time.monotonic() < deadline:
        s = b.stats(addr)
        if t_first is None and s["frames_sent"] > 0:
            t_first = time.monotonic()
        if last is None or s["frames_sent"] != last["frames_sent"]:
            t_last_change = time.monotonic()
        last = s
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    s = b.stats(addr)
    if last is None or s["frames_sent"] != last["frames_sent"]:
        t_last_change = time.monotonic()
    return {"stats": s, "data_seconds": (t_last_change - t_first) if t_first and t_last_change else None}


def run_reader(name: str, addr: str, events: int, window: int) -> dict:
    if name.startswith("ferry"):
        db = os.path.join(b.scratch(), f"{name}.sqlite")
        cmd = ["timeout", "-k", "5", "300", b.FERRY, *b.sync_args(addr, db, "--notify", name.split("-")[1],
                                                                    "--window", str(window), timeout=280)]
    else:
        cmd = ["timeout", "-k", "5", "300", BLEAK_PYTHON, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                         "bleak_reader.py"), addr, str(events),
               "--adapter", b.adapter()] + (["--acquire"] if name == "bleak-acquire" else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timing = watch(addr, proc, 310)
    out, err = proc.communicate()
    wall = time.monotonic() - t0
    with open(os.path.join(b.results_dir(), f"{name}.log"), "w") as f:
        f.write(f"$ {' '.join(cmd)}\n# rc={proc.returncode} {wall:.2f}s\n{out}\n{err}\n")
    lines = [l for l in out.splitlines() if l.startswith("{")]
    reported = json.loads(lines[-1]) if lines else {}
    s = timing["stats"]
    row = {"reader": name, "rc": proc.returncode, "events": events, "wall_seconds": round(wall, 2),
           "data_seconds": round(timing["data_seconds"], 2) if timing["data_seconds"] else None,
           "peripheral_frames_sent": s["frames_sent"], "peripheral_notifications_sent": s["notifications_sent"],
           "peripheral_violations": s["violations"], "reported": reported}
    if name.startswith("ferry"):
        store = b.Store(os.path.join(b.scratch(), f"{name}.sqlite"))
        frames = store.frames(addr, s["epoch"])
        store.close()
        row["delivered"] = len(frames)  # distinct seqs durably stored
        row["first_pass_lost"] = s["frames_sent"] - events  # frames the peripheral had to send again
        row["corrupt_runs"] = reported.get("corrupt")
        row["gaps_recorded"] = reported.get("gaps")
    else:
        row["delivered"] = reported.get("distinct", 0)
        row["first_pass_lost"] = events - reported.get("distinct", 0)
        row["corrupt_runs"] = reported.get("crc_errors")
        row["gaps_recorded"] = None
    row["lost"] = events - row["delivered"]
    row["frames_per_second"] = round(row["delivered"] / row["data_seconds"], 1) if row["data_seconds"] else None
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    events = int(os.environ["FERRY_TESTBED_EVENTS"])
    # The guest does not inherit the host's environment: the window comes as `--window W`.
    window = int(sys.argv[sys.argv.index("--window") + 1]) if "--window" in sys.argv else 20
    readers = ["ferry-acquire", "ferry-start", "bleak-start", "bleak-acquire"]
    addrs = b.peripherals()
    rows = []
    for name, addr in zip(readers, addrs):
        try:
            rows.append(run_reader(name, addr, events, window))
        except Exception as e:  # one broken reader must not hide the others' numbers
            rows.append({"reader": name, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(b.results_dir(), "bench.json"), "w") as f:
        json.dump({"events": events, "window": window, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
