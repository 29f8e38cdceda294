#!/usr/bin/env python3
"""Benchmark reference central (bleak): syncs one peripheral with the Sync protocol the way a small Python
gateway would — SYNC_REQ(0, window), a SYNC_ACK (write without response) every `ack-every` in-order DATA
frames, a final SYNC_ACK when the expected count is reached, disconnect — but stores nothing (no SQLite, no
durability: that favours bleak). Runs in the test-bed guest with a venv python that has bleak installed.

Usage: bleak_reader.py ADDRESS EXPECTED [--acquire | --start-notify] [--adapter hci0] [--window W]
                       [--ack-every A] [--idle S]
Prints one JSON line: {"reader", "expected", "intact", "distinct", "lost", "crc_errors", "notifications",
"seconds", "frames_per_second", "acks", "cpu_sync_seconds", "cpu_sync_user_seconds", "cpu_sync_system_seconds"};
seconds: first to last DATA notification; cpu_sync_seconds: time.process_time() from subscribing to the final ACK
(interpreter start-up, scan and connect excluded), and the same span split into user and system time (os.times()).
"""
import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.environ["FERRY_TESTBED_DIR"])
import syncproto as sp  # noqa: E402


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("expected", type=int)
    ap.add_argument("--acquire", action="store_true", help="AcquireNotify (default)")
    ap.add_argument("--start-notify", action="store_true", help="StartNotify instead of AcquireNotify")
    ap.add_argument("--adapter", default="hci0")
    ap.add_argument("--idle", type=float, default=3.0, help="stop after this long without notifications")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--ack-every", type=int, default=20)
    a = ap.parse_args()

    from bleak import BleakClient, BleakScanner
    from bleak.exc import BleakDBusError

    # Not find_device_by_address: when bluetoothd already knows the device (an earlier reader discovered
    # it) that returns at once and its StopDiscovery, sent while StartDiscovery is still completing, fails
    # with org.bluez.Error.InProgress (seen every time in the bed). Scan for a fixed short time instead.
    device = None
    scanner = BleakScanner(bluez={"adapter": a.adapter})
    await scanner.start()
    deadline = time.monotonic() + 20
    while device is None and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        device = next((d for d in scanner.discovered_devices if d.address.upper() == a.address.upper()), None)
    for attempt in range(5):
        try:
            await scanner.stop()
            break
        except BleakDBusError as e:
            print(f"bleak_reader: StopDiscovery attempt {attempt + 1}: {e}", file=sys.stderr, flush=True)
            await asyncio.sleep(0.5)
    if device is None:
        raise SystemExit(f"bleak_reader: {a.address} not found")
    decoder = sp.StreamDecoder()
    seqs: set[int] = set()
    counts = {"intact": 0, "notifications": 0, "acks": 0}
    state = {"cursor": 0, "unacked": 0}
    first = last = None
    last_rx = time.monotonic()
    done = asyncio.Event()
    pending_acks: list[int] = []
    wake = asyncio.Event()

    def on_data(_char, data: bytearray) -> None:
        nonlocal first, last, last_rx
        now = time.monotonic()
        last_rx = now
        first = first or now
        last = now
        counts["notifications"] += 1
        for f in decoder.feed(bytes(data)):
            if f.type != sp.TYPE_DATA:
                continue
            counts["intact"] += 1
            seqs.add(f.seq)
            if f.seq == state["cursor"] + 1:
                state["cursor"] = f.seq
                state["unacked"] += 1
                if state["unacked"] >= a.ack_every or state["cursor"] >= a.expected:
                    state["unacked"] = 0
                    pending_acks.append(state["cursor"])
                    wake.set()
        if state["cursor"] >= a.expected:
            done.set()

    async with BleakClient(device, timeout=30, bluez={"adapter": a.adapter}) as client:
        cpu0, times0 = time.process_time(), os.times()
        await client.start_notify(sp.DATA_UUID, on_data, bluez={"use_start_notify": a.start_notify})
        await client.write_gatt_char(sp.CONTROL_UUID, sp.sync_req(0, a.window), response=True)
        last_rx = time.monotonic()
        while not (done.is_set() and not pending_acks) and time.monotonic() - last_rx < a.idle:
            try:
                await asyncio.wait_for(wake.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
            wake.clear()
            while pending_acks:
                seq = pending_acks.pop(0)
                await client.write_gatt_char(sp.CONTROL_UUID, sp.sync_ack(seq), response=False)
                counts["acks"] += 1
        cpu, times1 = time.process_time() - cpu0, os.times()
        decoder.on_idle()
    seconds = (last - first) if first and last and last > first else 0.0
    print(json.dumps({
        "reader": "bleak-start" if a.start_notify else "bleak-acquire", "expected": a.expected,
        "intact": counts["intact"], "distinct": len(seqs), "lost": a.expected - len(seqs),
        "crc_errors": decoder.crc_errors, "notifications": counts["notifications"], "seconds": round(seconds, 3),
        "frames_per_second": round(len(seqs) / seconds, 1) if seconds else None, "acks": counts["acks"],
        "cpu_sync_seconds": round(cpu, 3), "cpu_sync_user_seconds": round(times1.user - times0.user, 3),
        "cpu_sync_system_seconds": round(times1.system - times0.system, 3)}), flush=True)


async def bounded() -> None:
    # Every wait bounded: a wedged connect/disconnect must end the benchmark row, not the whole run.
    await asyncio.wait_for(main(), 150)


if __name__ == "__main__":
    asyncio.run(bounded())
