#!/usr/bin/python3
"""Pairing probe: the emulated peripherals' pairing modes against the REAL bluetoothd, without Ferry.

Needs the bed booted with three peripherals: 1 Just Works, 2 passkey 123456, 3 open:

  scripts/testbed run --peripherals 3 --events 30 \\
      --pairing 1:justworks --pairing 2:passkey=123456 --pairing 3:none \\
      -- /usr/bin/python3 scripts/testbed.d/pair_probe.py

Checks (python3-dbus; an Agent1 from pair_agent.py in its own process):
  - passkey peripheral, no bond: STREAM_INFO read, StartNotify and a CONTROL write fail fast, the link is
    never encrypted and no DATA frame leaves the peripheral (AcquireNotify is NOT tried on such a link:
    bluetoothd 5.66 never answers it and crashes ~30 s later);
  - Just Works: Device1.Pair succeeds with a NoInputNoOutput agent, the link is encrypted, a sync round
    (AcquireNotify, SYNC_REQ, ACK) moves every event and none over a clear link;
  - passkey: the wrong number -> org.bluez.Error.AuthenticationFailed; the right one pairs (MITM key);
  - a peripheral reboot (`restart`) keeps the bond: the reconnect re-encrypts without pairing again;
  - the peripheral forgetting its keys (`forget`): what bluetoothd does is recorded (not judged);
  - open peripheral: readable on a clear link, as before.
Writes RESULTS/pair-probe.json (checks, timings, observations). Prints 'pair_probe: N passed, M failed'.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import dbus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import syncproto as sp  # noqa: E402
from probe import Bluez, SyncLink, to_bytes, wait_for  # noqa: E402
import probe  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.environ["FERRY_TESTBED_RESULTS"]
PASSKEY = 123456
WRONG_PASSKEY = 654321
DEVICE = "org.bluez.Device1"

checks: list[dict] = []
timings: dict[str, float] = {}
observations: dict[str, object] = {}


def check(ok: bool, what: str, detail: str = "") -> bool:
    checks.append({"ok": bool(ok), "what": what, "detail": detail})
    print(f"{'ok   ' if ok else 'FAIL '} {what}" + (f" — {detail}" if detail else ""), flush=True)
    return bool(ok)


def stats(address: str) -> dict:
    with open(os.path.join(RESULTS, f"peripheral-{address}.json")) as f:
        return json.load(f)


def stats_when(address: str, predicate, limit: float = 3.0) -> dict:
    """The stats file is rewritten within 0.5 s of a change: poll for the expected state."""
    deadline = time.monotonic() + limit
    while True:
        s = stats(address)
        if predicate(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def control(line: str) -> None:
    with open(os.environ["FERRY_TESTBED_CONTROL"], "w") as f:
        f.write(line + "\n")


class AgentProcess:
    def __init__(self, capability: str, passkey: int | None):
        ready = os.path.join("/tmp", f"pair-agent-{os.getpid()}-{time.monotonic_ns()}.ready")
        cmd = ["/usr/bin/python3", os.path.join(HERE, "pair_agent.py"), "--capability", capability,
               "--ready", ready, "--log", os.path.join(RESULTS, "pair-agent.log")]
        if passkey is not None:
            cmd += ["--passkey", str(passkey)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ok = wait_for(lambda: os.path.exists(ready) or self.proc.poll() is not None, 15)
        if not (ok and os.path.exists(ready)):
            raise RuntimeError(f"agent did not register: {self.proc.stderr.read() if self.proc.poll() is not None else 'timeout'}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def timed(fn):
    t0 = time.monotonic()
    try:
        fn()
        return None, time.monotonic() - t0
    except dbus.DBusException as e:
        return e, time.monotonic() - t0


def err_text(e) -> str:
    return "ok" if e is None else f"{e.get_dbus_name()}: {e.get_dbus_message()}"


def discover(bz: Bluez, addresses: list[str]) -> None:
    bz.adapter.SetDiscoveryFilter({"UUIDs": dbus.Array([sp.SYNC_SERVICE_UUID], signature="s"),
                                   "Transport": "le"}, timeout=10)
    bz.adapter.StartDiscovery(timeout=10)
    found = wait_for(lambda: all(bz.device_path(a) in bz.objects() for a in addresses), 30)
    bz.adapter.StopDiscovery(timeout=10)
    check(bool(found), f"discovered {' '.join(addresses)}")


def device(bz: Bluez, address: str):
    return bz.iface(bz.device_path(address), DEVICE)


def prop(bz: Bluez, address: str, name: str):
    try:
        return bz.prop(bz.device_path(address), DEVICE, name)
    except dbus.DBusException:
        return None


def disconnect(bz: Bluez, address: str) -> None:
    try:
        device(bz, address).Disconnect(timeout=20)
    except dbus.DBusException:
        pass
    wait_for(lambda: not prop(bz, address, "Connected"), 10)


def is_false(value) -> bool:
    return value is not None and not bool(value)


def bluetoothd_alive() -> bool:
    return subprocess.run(["pidof", "bluetoothd"], capture_output=True).returncode == 0


def probe_unbonded_passkey(bz: Bluez, addr: str) -> None:
    """Each clear-link access on a fresh connection: the first refused access makes bluetoothd try to pair,
    the peripheral refuses, and the link drops, so later accesses on the same link prove nothing."""
    accesses = [
        ("StartNotify on DATA", "subscribe", lambda link: link.char(sp.DATA_UUID).StartNotify(timeout=20)),
        ("STREAM_INFO read", "read", lambda link: link.stream_info()),
        ("SYNC_REQ write-with-response", "write",
         lambda link: link.write(sp.encode_frame(sp.TYPE_SYNC_REQ, 0, b"\x00\x1e"), True)),
    ]
    for name, key, access in accesses:
        link = SyncLink(bz, addr)
        e, _ = timed(link.connect)
        check(e is None, f"{addr} (passkey, no bond): connect + services resolved", err_text(e))
        e, dt = timed(lambda: access(link))
        timings[f"clear-link {key} refused s"] = round(dt, 3)
        observations[f"clear-link {name}"] = f"{err_text(e)} after {dt:.3f} s"
        check(e is not None and dt < 5, f"{addr}: {name} on a clear link fails fast", f"{err_text(e)} after {dt:.3f} s")
        link.close()
        disconnect(bz, addr)
    time.sleep(1.0)
    s = stats_when(addr, lambda s: s["pairing_failures"] >= 3)
    check(not s["last_link_encrypted"] and s["encrypted_connections"] == 0 and s["frames_sent"] == 0
          and s["frames_sent_unencrypted"] == 0 and s["subscriptions"] == 0,
          f"{addr}: link never encrypted, never subscribed, 0 DATA frames sent",
          f"encrypted connections {s['encrypted_connections']}, subscriptions {s['subscriptions']}, "
          f"frames {s['frames_sent']}, refusals {s['clear_link_refusal_list']}")
    check(any("DATA CCCD" in r for r in s["clear_link_refusal_list"])
          and any("STREAM_INFO" in r for r in s["clear_link_refusal_list"])
          and any("CONTROL" in r for r in s["clear_link_refusal_list"]),
          f"{addr}: the peripheral refused the CCCD write, the STREAM_INFO read and the CONTROL write",
          str(s["clear_link_refusal_list"]))
    check(s["pairing_failures"] >= 1 and set(s["pairing_failure_reasons"]) == {"AUTHENTICATION_REQUIREMENTS"},
          f"{addr}: bluetoothd's automatic pairings (NoInputNoOutput) were all refused by the peripheral",
          f"failures {s['pairing_failures']} {s['pairing_failure_reasons']}")
    check(is_false(prop(bz, addr, "Paired")), f"{addr}: not Paired on D-Bus", str(prop(bz, addr, "Paired")))
    check(bluetoothd_alive(), "bluetoothd alive after the refused clear-link accesses")


def pair(bz: Bluez, addr: str):
    return timed(lambda: device(bz, addr).Pair(timeout=30))


def sync_round(bz: Bluez, addr: str, events: int) -> None:
    link = SyncLink(bz, addr)
    link.connect()
    link.stream_info()
    link.subscribe()
    link.write(sp.encode_frame(sp.TYPE_SYNC_REQ, 0, events.to_bytes(2, "big")), True)
    frames = link.frames(idle=2.0, until=lambda fs: len([f for f in fs if f.type == sp.TYPE_DATA]) >= events)
    got = sorted({f.seq for f in frames if f.type == sp.TYPE_DATA})
    check(got == list(range(1, events + 1)), f"{addr}: sync over the encrypted link delivered seqs 1..{events}",
          f"{len(got)} distinct seqs")
    if got:
        link.write(sp.encode_frame(sp.TYPE_SYNC_ACK, got[-1], b""), True)
    link.close()
    s = stats_when(addr, lambda s: s["acks_received"] >= 1)
    check(s["frames_sent"] >= events and s["frames_sent_unencrypted"] == 0 and s["violations"] == 0,
          f"{addr}: every frame went over an encrypted link",
          f"frames_sent {s['frames_sent']}, unencrypted {s['frames_sent_unencrypted']}, violations {s['violations']}")


def main() -> int:
    bz = Bluez(os.environ.get("FERRY_TESTBED_ADAPTER", "hci0"))
    addrs = os.environ["FERRY_TESTBED_PERIPHERALS"].split()
    events = int(os.environ.get("FERRY_TESTBED_EVENTS", "30"))
    jw, pk, open_ = addrs[0], addrs[1], addrs[2]
    probe.CALL_TIMEOUT = 20
    discover(bz, addrs)
    agent = AgentProcess("NoInputNoOutput", None)
    try:
        # 1. passkey peripheral, no bond, clear link
        probe_unbonded_passkey(bz, pk)

        # 2. Just Works
        e, dt = pair(bz, jw)
        timings["Just Works Pair s"] = round(dt, 3)
        check(e is None, f"{jw} (Just Works): Device1.Pair with a NoInputNoOutput agent", f"{err_text(e)} {dt:.3f} s")
        device_props = bz.iface(bz.device_path(jw), "org.freedesktop.DBus.Properties")
        device_props.Set(DEVICE, "Trusted", dbus.Boolean(True), timeout=10)
        check(bool(prop(bz, jw, "Paired")), f"{jw}: Paired on D-Bus")
        observations["Bonded property (5.66)"] = str(prop(bz, jw, "Bonded"))
        s = stats_when(jw, lambda s: s["pairings_completed"] == 1 and s["bonds"] == 1)
        check(s["pairings_completed"] == 1 and s["bonds"] == 1 and s["last_link_encrypted"]
              and not s["last_link_authenticated"],
              f"{jw}: peripheral saw one Just Works pairing, a stored bond, an encrypted (unauthenticated) link",
              f"pairings {s['pairings_completed']}, bonds {s['bonds']}, encrypted {s['last_link_encrypted']}, "
              f"authenticated {s['last_link_authenticated']}")
        sync_round(bz, jw, events)
        disconnect(bz, jw)

        # 3. passkey: wrong number, then the right one
        agent.stop()
        agent = AgentProcess("KeyboardDisplay", WRONG_PASSKEY)
        e, dt = pair(bz, pk)
        timings["wrong passkey Pair fails s"] = round(dt, 3)
        check(e is not None and e.get_dbus_name() == "org.bluez.Error.AuthenticationFailed",
              f"{pk}: wrong passkey -> org.bluez.Error.AuthenticationFailed", f"{err_text(e)} after {dt:.3f} s")
        check(is_false(prop(bz, pk, "Paired")), f"{pk}: not Paired after the wrong passkey")
        s = stats_when(pk, lambda s: s["pairing_failures"] >= 2)
        check(s["pairings_completed"] == 0 and s["bonds"] == 0, f"{pk}: peripheral stored no bond",
              f"failures {s['pairing_failure_reasons']}")
        disconnect(bz, pk)
        agent.stop()
        agent = AgentProcess("KeyboardDisplay", PASSKEY)
        e, dt = pair(bz, pk)
        timings["passkey Pair s"] = round(dt, 3)
        check(e is None, f"{pk}: right passkey pairs", f"{err_text(e)} {dt:.3f} s")
        s = stats_when(pk, lambda s: s["pairings_completed"] == 1)
        check(s["pairings_completed"] == 1 and s["last_link_authenticated"] and s["bonds"] == 1,
              f"{pk}: peripheral holds an authenticated (MITM) bond",
              f"pairings {s['pairings_completed']}, authenticated {s['last_link_authenticated']}, bonds {s['bonds']}")
        link = SyncLink(bz, pk)
        e, dt = timed(link.connect)
        e2, _ = timed(link.stream_info) if e is None else (e, 0)
        check(e is None and e2 is None, f"{pk}: STREAM_INFO readable on the passkey-encrypted link", err_text(e or e2))
        link.close()
        disconnect(bz, pk)

        # 4. peripheral reboot keeps the bond: re-encrypt without pairing again
        before = stats(jw)
        control(f"restart {jw}")
        time.sleep(1.0)
        link = SyncLink(bz, jw)
        t0 = time.monotonic()
        e, _ = timed(link.connect)
        e2, _ = timed(link.stream_info) if e is None else (e, 0)
        timings["bonded reconnect + STREAM_INFO s"] = round(time.monotonic() - t0, 3)
        s = stats_when(jw, lambda s: s["encrypted_connections"] > before["encrypted_connections"])
        check(e is None and e2 is None and s["encrypted_connections"] > before["encrypted_connections"]
              and s["pairings_completed"] == before["pairings_completed"],
              f"{jw}: after a peripheral restart the reconnect re-encrypts from the stored key (no new pairing)",
              f"{err_text(e or e2)}; encrypted connections {before['encrypted_connections']} -> "
              f"{s['encrypted_connections']}, pairings {s['pairings_completed']}")
        link.close()
        disconnect(bz, jw)

        # 5. open peripheral, as before
        link = SyncLink(bz, open_)
        e, _ = timed(link.connect)
        e2, _ = timed(link.stream_info) if e is None else (e, 0)
        s = stats(open_)
        check(e is None and e2 is None and not s["last_link_encrypted"],
              f"{open_} (open): STREAM_INFO readable on a clear link", err_text(e or e2))
        link.close()
        check(bluetoothd_alive(), "bluetoothd alive before the key-loss experiment")

        # 6. last, because of what it did here once (a kernel BUG in hci_chan_del, bluetoothd killed): the
        #    peripheral forgets its keys; what bluetoothd does is recorded
        control(f"forget {jw}")
        stats_when(jw, lambda s: s["bonds"] == 0)
        link = SyncLink(bz, jw)
        t0 = time.monotonic()
        e = None
        try:
            link.connect()
            e, _ = timed(link.stream_info)
        except Exception as x:  # noqa: BLE001 — recorded, not judged
            e = x
        observations["after peripheral forget: STREAM_INFO"] = (
            err_text(e) if isinstance(e, (dbus.DBusException, type(None))) else repr(e))
        observations["after peripheral forget: seconds"] = round(time.monotonic() - t0, 3)
        time.sleep(1.0)
        s = stats(jw)
        observations["after peripheral forget: Paired"] = str(prop(bz, jw, "Paired"))
        observations["after peripheral forget: peripheral stats"] = {
            k: s[k] for k in ("pairings_completed", "pairing_failures", "pairing_failure_reasons", "bonds",
                              "last_link_encrypted", "frames_sent_unencrypted")}
        check(s["frames_sent_unencrypted"] == 0, f"{jw}: still 0 frames over a clear link after the key loss")
        link.close()
        disconnect(bz, jw)

        time.sleep(3.0)
        observations["after peripheral forget: bluetoothd alive 3 s later"] = bluetoothd_alive()
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
        observations["after peripheral forget: kernel BUG in dmesg"] = "kernel BUG" in dmesg
    except Exception as x:  # a crash is a failure with its reason
        import traceback
        traceback.print_exc()
        check(False, "probe ran to the end", repr(x))
    finally:
        agent.stop()
    passed = sum(c["ok"] for c in checks)
    failed = len(checks) - passed
    with open(os.path.join(RESULTS, "pair-probe.json"), "w") as f:
        json.dump({"checks": checks, "timings": timings, "observations": observations}, f, indent=1)
    print("timings:", json.dumps(timings))
    print("observations:", json.dumps(observations, default=str))
    print(f"pair_probe: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
