#!/usr/bin/python3
"""Conformance probe: checks the emulated Sync peripherals against PROTOCOL.md §1-4, through
the REAL bluetoothd (D-Bus org.bluez), inside the test bed guest.

Run by `scripts/testbed selftest`. Uses Debian's python3-dbus (no main loop needed: every
call is synchronous with a timeout, DATA comes through AcquireNotify's socket). Exit 0 only
if every check passed; prints 'probe: N passed, M failed' last.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

import dbus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import syncproto as sp  # noqa: E402

BLUEZ = "org.bluez"
CALL_TIMEOUT = 20  # seconds, every D-Bus call

passed = 0
failed = 0
report: dict = {"checks": [], "timings": {}}


def check(ok: bool, what: str) -> bool:
    global passed, failed
    if ok:
        passed += 1
        print(f"ok    {what}", flush=True)
    else:
        failed += 1
        print(f"FAIL  {what}", flush=True)
    report["checks"].append({"ok": bool(ok), "what": what})
    return ok


class ProbeAbort(Exception):
    pass


def require(ok: bool, what: str) -> None:
    if not check(ok, what):
        raise ProbeAbort(what)


def wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


class Bluez:
    def __init__(self, adapter: str):
        self.bus = dbus.SystemBus()
        self.adapter_path = f"/org/bluez/{adapter}"
        self.om = dbus.Interface(self.bus.get_object(BLUEZ, "/"), "org.freedesktop.DBus.ObjectManager")
        self.adapter = dbus.Interface(self.bus.get_object(BLUEZ, self.adapter_path), "org.bluez.Adapter1")

    def objects(self) -> dict:
        return self.om.GetManagedObjects(timeout=CALL_TIMEOUT)

    def device_path(self, address: str) -> str:
        return f"{self.adapter_path}/dev_{address.replace(':', '_')}"

    def prop(self, path: str, iface: str, name: str):
        props = dbus.Interface(self.bus.get_object(BLUEZ, path), "org.freedesktop.DBus.Properties")
        return props.Get(iface, name, timeout=CALL_TIMEOUT)

    def iface(self, path: str, iface: str):
        return dbus.Interface(self.bus.get_object(BLUEZ, path), iface)


def to_bytes(value) -> bytes:
    return bytes(int(b) for b in value)


class SyncLink:
    """One connected peripheral: STREAM_INFO reads, CONTROL writes, DATA via AcquireNotify."""

    def __init__(self, bz: Bluez, address: str):
        self.bz = bz
        self.address = address
        self.path = bz.device_path(address)
        self.decoder = sp.StreamDecoder()
        self.fd = -1
        self.mtu = 0
        self.notifications = 0

    def connect(self) -> None:
        t0 = time.monotonic()
        if self.path not in self.bz.objects():
            # bluetoothd drops a device it has not seen for 30 s once discovery stopped (TemporaryTimeout): under a
            # slow VM the probe reaches the second peripheral later than that. Find it again first.
            self.bz.adapter.StartDiscovery(timeout=CALL_TIMEOUT)
            found = wait_for(lambda: self.path in self.bz.objects(), 30, 0.2)
            self.bz.adapter.StopDiscovery(timeout=CALL_TIMEOUT)
            require(bool(found), f"{self.address}: found again by discovery (bluetoothd had dropped it)")
        self.bz.iface(self.path, "org.bluez.Device1").Connect(timeout=CALL_TIMEOUT)
        resolved = wait_for(lambda: bool(self.bz.prop(self.path, "org.bluez.Device1", "ServicesResolved")), 20)
        require(bool(resolved), f"{self.address}: connected and services resolved")
        report["timings"][f"{self.address} connect+resolve s"] = round(time.monotonic() - t0, 2)
        objs = self.bz.objects()
        service = next((p for p, i in objs.items() if p.startswith(self.path + "/")
                        and "org.bluez.GattService1" in i
                        and str(i["org.bluez.GattService1"]["UUID"]) == sp.SYNC_SERVICE_UUID), None)
        require(service is not None, f"{self.address}: Sync service {sp.SYNC_SERVICE_UUID} present")
        self.chars = {}
        for p, i in objs.items():
            c = i.get("org.bluez.GattCharacteristic1")
            if c is not None and str(c["Service"]) == service:
                self.chars[str(c["UUID"])] = (p, [str(f) for f in c["Flags"]])
        for uuid, name, flags in ((sp.DATA_UUID, "DATA", ["notify"]),
                                  (sp.CONTROL_UUID, "CONTROL", ["write", "write-without-response"]),
                                  (sp.STREAM_INFO_UUID, "STREAM_INFO", ["read"])):
            have = self.chars.get(uuid)
            require(have is not None and all(f in have[1] for f in flags),
                    f"{self.address}: {name} characteristic with {'+'.join(flags)} (has {have and have[1]})")

    def char(self, uuid: str):
        return self.bz.iface(self.chars[uuid][0], "org.bluez.GattCharacteristic1")

    def stream_info(self) -> tuple[int, int, int, int, int]:
        value = to_bytes(self.char(sp.STREAM_INFO_UUID).ReadValue({}, timeout=CALL_TIMEOUT))
        return sp.decode_stream_info(value)

    def write(self, frame: bytes, with_response: bool) -> None:
        self.char(sp.CONTROL_UUID).WriteValue(
            dbus.Array([dbus.Byte(b) for b in frame], signature="y"),
            {"type": dbus.String("request" if with_response else "command")}, timeout=CALL_TIMEOUT)

    def subscribe(self) -> None:
        fd, mtu = self.char(sp.DATA_UUID).AcquireNotify({}, timeout=CALL_TIMEOUT)
        self.fd = fd.take()
        self.mtu = int(mtu)
        check(self.mtu >= 23, f"{self.address}: AcquireNotify gave a socket, mtu {self.mtu}")

    def frames(self, idle: float, until=None, limit_s: float = 60.0) -> list[sp.Frame]:
        """Collect DATA frames until `until(frames)` is true or nothing arrives for `idle` s."""
        out: list[sp.Frame] = []
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if until is not None and until(out):
                break
            ready, _, _ = select.select([self.fd], [], [], idle)
            if not ready:
                out += self.decoder.on_idle()
                break
            chunk = os.read(self.fd, 4096)
            if not chunk:
                raise ProbeAbort(f"{self.address}: DATA socket closed (link lost)")
            self.notifications += 1
            out += self.decoder.feed(chunk)
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.bz.iface(self.path, "org.bluez.Device1").Disconnect(timeout=CALL_TIMEOUT)
        except dbus.DBusException as e:
            print(f"note  {self.address}: Disconnect: {e}")


def seqs(frames: list[sp.Frame]) -> list[int]:
    return [f.seq for f in frames]


def check_payloads(address: str, frames: list[sp.Frame], epoch: int, payload_bytes: int) -> None:
    bad = [f.seq for f in frames if f.payload != sp.event_payload(epoch, 0, f.seq, payload_bytes)]
    check(not bad and all(f.type == sp.TYPE_DATA for f in frames),
          f"{address}: DATA frames carry the stored event bytes (bad: {bad[:5]})")


def probe_peripheral(bz: Bluez, address: str, events: int, payload_bytes: int, negative: bool) -> None:
    link = SyncLink(bz, address)
    link.connect()
    try:
        version, flags, epoch, oldest, head = link.stream_info()
        check((version, flags) == (1, 0) and epoch != 0,
              f"{address}: STREAM_INFO is 26 bytes, version 1, flags 0, epoch {epoch} != 0")
        check((oldest, head) == (1, events), f"{address}: STREAM_INFO oldest 1 head {events} (got {oldest}, {head})")
        link.subscribe()

        # 1. The window bounds an unacknowledged replay.
        link.write(sp.sync_req(0, 5), with_response=True)
        got = link.frames(idle=1.5)
        check(seqs(got) == [1, 2, 3, 4, 5], f"{address}: SYNC_REQ(0, window 5) -> exactly seq 1..5 (got {seqs(got)})")
        check_payloads(address, got, epoch, payload_bytes)
        check(link.decoder.crc_errors == 0 and link.decoder.resync_bytes == 0,
              f"{address}: every DATA byte belonged to a frame with a valid CRC")

        # 2. An ACK deletes and opens the window again (write-without-response).
        link.write(sp.sync_ack(5), with_response=False)
        got = link.frames(idle=1.5)
        check(seqs(got) == [6, 7, 8, 9, 10], f"{address}: SYNC_ACK(5) -> seq 6..10 (got {seqs(got)})")
        _, _, _, oldest, head = link.stream_info()
        check((oldest, head) == (6, events), f"{address}: after SYNC_ACK(5) oldest 6 (got {oldest}, head {head})")

        # 3. Replay starts from the requested seq, not where the last replay stopped.
        link.write(sp.sync_req(7, 3), with_response=True)
        got = link.frames(idle=1.5)
        check(seqs(got) == [8, 9, 10], f"{address}: SYNC_REQ(7, window 3) -> replay 8..10 (got {seqs(got)})")

        # 4. Drain the rest the way a gateway does: window 20, ACK every 20 frames.
        t0 = time.monotonic()
        cursor = 10
        link.write(sp.sync_req(cursor, 20), with_response=True)
        received: list[int] = []
        ordered = True
        while cursor < events:
            batch = link.frames(idle=2.0, until=lambda fs: len(fs) >= min(20, events - cursor))
            if not batch:
                break
            for f in batch:
                if f.seq != cursor + 1:
                    ordered = False
                cursor = max(cursor, f.seq)
                received.append(f.seq)
            link.write(sp.sync_ack(cursor), with_response=False)
        elapsed = time.monotonic() - t0
        check(received == list(range(11, events + 1)) and ordered,
              f"{address}: window-20 drain delivered 11..{events} in order, once each "
              f"({len(received)} frames in {elapsed:.2f} s)")
        report["timings"][f"{address} drain frames/s"] = round(len(received) / elapsed, 1) if elapsed else None
        time.sleep(0.5)  # the last ACK was a command write: give it time to land
        _, _, _, oldest, head = link.stream_info()
        check((oldest, head) == (0, events), f"{address}: all acknowledged -> oldest 0 head {events} "
                                             f"(got {oldest}, {head})")

        if negative:
            # The peripheral must catch a misbehaving gateway: a corrupt write, an ACK past what was sent.
            bad = bytearray(sp.sync_ack(events))
            bad[-1] ^= 0xFF
            link.write(bytes(bad), with_response=True)
            link.write(sp.sync_ack(events + 100), with_response=True)
    finally:
        link.close()


def control(line: str) -> None:
    with open(os.environ["FERRY_TESTBED_CONTROL"], "w") as f:
        f.write(line + "\n")


def probe_restart(bz: Bluez, address: str, events: int, payload_bytes: int) -> None:
    """Live events and a peripheral reboot: the store (epoch, head, deletions) must survive."""
    link = SyncLink(bz, address)
    link.connect()
    try:
        _, _, epoch, _, _ = link.stream_info()
        control(f"add {address} 10")
        grown = wait_for(lambda: link.stream_info()[3:] == (events + 1, events + 10), 10, 0.2)
        check(bool(grown), f"{address}: control 'add 10' -> oldest {events + 1} head {events + 10}")
        control(f"restart {address}")
        dropped = wait_for(lambda: not bool(bz.prop(link.path, "org.bluez.Device1", "Connected")), 15, 0.2)
        check(bool(dropped), f"{address}: control 'restart' dropped the link")
    finally:
        link.close()
    link = SyncLink(bz, address)
    link.connect()
    try:
        _, _, epoch2, oldest, head = link.stream_info()
        check((epoch2, oldest, head) == (epoch, events + 1, events + 10),
              f"{address}: after restart the store survived: same epoch, oldest {events + 1}, head {events + 10} "
              f"(got {epoch2 == epoch}, {oldest}, {head})")
        link.subscribe()
        link.write(sp.sync_req(events, 20), with_response=True)
        got = link.frames(idle=1.5)
        check(seqs(got) == list(range(events + 1, events + 11)),
              f"{address}: after restart SYNC_REQ({events}) -> {events + 1}..{events + 10} (got {seqs(got)})")
        check_payloads(address, got, epoch, payload_bytes)
        link.write(sp.sync_ack(events + 10), with_response=True)
    finally:
        link.close()


def peripheral_stats(results: str, address: str) -> dict:
    path = os.path.join(results, f"peripheral-{address}.json")
    with open(path) as f:
        return json.load(f)


def main() -> int:
    peripherals = os.environ.get("FERRY_TESTBED_PERIPHERALS", "").split()
    adapter = os.environ.get("FERRY_TESTBED_ADAPTER", "hci0")
    results = os.environ.get("FERRY_TESTBED_RESULTS", ".")
    events = int(os.environ.get("FERRY_TESTBED_EVENTS", "0"))
    payload_bytes = int(os.environ.get("FERRY_TESTBED_PAYLOAD_BYTES", "20"))
    if not peripherals or events < 12:
        print("probe: needs FERRY_TESTBED_PERIPHERALS and FERRY_TESTBED_EVENTS >= 12 (run it via scripts/testbed)")
        return 2
    t_start = time.monotonic()
    try:
        bz = Bluez(adapter)
        check(bool(bz.prop(bz.adapter_path, "org.bluez.Adapter1", "Powered")), f"{adapter} powered")
        bz.adapter.SetDiscoveryFilter({"UUIDs": dbus.Array([sp.SYNC_SERVICE_UUID], signature="s"),
                                       "Transport": dbus.String("le")}, timeout=CALL_TIMEOUT)
        t0 = time.monotonic()
        bz.adapter.StartDiscovery(timeout=CALL_TIMEOUT)

        def read_tree():
            try:
                return bz.objects()
            except dbus.DBusException as e:
                if e.get_dbus_name() != "org.freedesktop.DBus.Error.NoReply":
                    raise
            # bluetoothd answers calls from an idle main loop, which the bed's advertising flood can keep busy
            # on a slow host: pause discovery (ending the flood) for the read, as Ferry's discovery does.
            try:
                bz.adapter.StopDiscovery(timeout=CALL_TIMEOUT)
            except dbus.DBusException:
                pass
            objs = bz.objects()
            bz.adapter.StartDiscovery(timeout=CALL_TIMEOUT)
            return objs

        def all_seen():
            objs = read_tree()
            for a in peripherals:
                dev = objs.get(bz.device_path(a), {}).get("org.bluez.Device1")
                if dev is None or sp.SYNC_SERVICE_UUID not in [str(u) for u in dev.get("UUIDs", [])]:
                    return False
            return True

        seen = wait_for(all_seen, 60, 0.2)
        report["timings"]["discovery s"] = round(time.monotonic() - t0, 2)
        bz.adapter.StopDiscovery(timeout=CALL_TIMEOUT)
        require(bool(seen), f"discovery by service UUID found all of {peripherals} "
                            f"in {report['timings']['discovery s']} s")
        for i, address in enumerate(peripherals):
            negative = i == len(peripherals) - 1
            restart = i == 0
            try:
                probe_peripheral(bz, address, events, payload_bytes, negative)
                if restart:
                    probe_restart(bz, address, events, payload_bytes)
            except ProbeAbort:
                pass
            time.sleep(1.0)  # final stats are written every 0.5 s
            stats = peripheral_stats(results, address)
            kinds = [v["kind"] for v in stats["violation_list"]]
            if negative:
                check(sorted(kinds) == ["ack_beyond_sent", "malformed_write"],
                      f"{address}: the peripheral flagged the probe's deliberate violations (got {kinds})")
            else:
                check(stats["violations"] == 0, f"{address}: no protocol violations recorded (got {kinds})")
            expected_deleted = events + 10 if restart else events
            expected_highest = events + 100 if negative else expected_deleted
            check(stats["deleted"] == expected_deleted and stats["highest_ack"] == expected_highest,
                  f"{address}: peripheral stats: deleted {stats['deleted']}, highest ack {stats['highest_ack']}")
    except ProbeAbort:
        pass
    except dbus.DBusException as e:
        check(False, f"D-Bus error: {e.get_dbus_name()}: {e}")
    report["timings"]["probe total s"] = round(time.monotonic() - t_start, 2)
    report["passed"], report["failed"] = passed, failed
    with open(os.path.join(results, "probe.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("timings: " + ", ".join(f"{k} {v}" for k, v in report["timings"].items()))
    print(f"probe: {passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
