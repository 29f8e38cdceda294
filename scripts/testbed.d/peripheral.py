"""Emulated Sync peripherals (PROTOCOL.md §1-4, peripheral side) on one bumble LocalLink.

One process hosts:
  - a bumble controller attached to the kernel through /dev/vhci (it becomes hci0, driven by
    the real bluetoothd), and
  - M peripheral controllers on the same emulated link, each with a bumble Device serving the
    Sync GATT service from a persistent, file-backed event store.

The peripherals also check the gateway: every protocol violation is logged and counted in
RESULTS/peripheral-<ADDR>.json, so a test can assert there were none. See Hardware/TESTBED.md.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import random
import signal
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import syncproto as sp  # noqa: E402

log = logging.getLogger("peripheral")

# name -> (default value, meaning). A value is a probability per frame/notification, a count or a rate.
FAULTS = {
    "corrupt": (0.02, "flip one byte in a DATA frame with this probability per frame"),
    "drop": (0.02, "drop a whole notification (all bytes in it) with this probability"),
    "duplicate": (0.02, "send a DATA frame twice with this probability per frame"),
    "oversize": (0.01, "insert a bogus header announcing 0xFFFF payload bytes before a frame, this probability"),
    "unknown-type": (0.01, "insert a valid-CRC frame of type 0x7E before a frame, this probability"),
    "disconnect": (50, "drop the link after this many DATA frames were sent on it, once per peripheral"),
    "epoch-reset": (-1, "when the gateway has acked through this seq (default: all initial events): disconnect, "
                        "wipe the store (new epoch), generate --events new events from seq 1; once"),
    "regression": (-1, "when the gateway has acked through this seq (default: all initial events): disconnect, "
                       "set head back to half of it (same epoch, new payload bytes); once"),
    "silence": (1, "ignore this many SYNC_REQs (no DATA in answer)"),
    "slow": (5, "pace notifications at this many per second, 20 bytes each (frames span notifications)"),
    "stall": (300, "after this many DATA frames on one connection, stall with the link up: send nothing new and "
                   "answer each SYNC_REQ with one stale duplicate (the requested seq's frame again); once"),
}

MAX_VIOLATIONS_LISTED = 200


def parse_faults(items: list[str]) -> dict[int, dict[str, float]]:
    """`[N:]NAME[=VALUE]` -> {peripheral index (0 = all): {name: value}}."""
    faults: dict[int, dict[str, float]] = {}
    for item in items:
        target, sep, rest = item.partition(":")
        if sep and target.isdigit():
            index, item = int(target), rest
        else:
            index = 0
        name, _, value = item.partition("=")
        if name not in FAULTS:
            raise SystemExit(f"unknown fault '{name}'; known: {', '.join(FAULTS)}")
        try:
            faults.setdefault(index, {})[name] = float(value) if value else float(FAULTS[name][0])
        except ValueError:
            raise SystemExit(f"fault {name}: value '{value}' is not a number")
    return faults


def faults_for(faults: dict[int, dict[str, float]], index: int) -> dict[str, float]:
    """Faults for all peripherals, overridden by those aimed at this one."""
    return {**faults.get(0, {}), **faults.get(index, {})}


# Pairing modes (`--pairing [N:]MODE[,open|,encrypt]`). The Sync characteristics require an encrypted
# link by default in every mode that can pair; `,open` lifts that (SMP offered, nothing required) and
# `,encrypt` adds it to `none`/`refuse`.
PAIRING_MODES = {
    "none": "today's behaviour: nothing required; a central that asks gets Just Works (bumble's default)",
    "justworks": "LE Secure Connections, bonding, io capability NoInputNoOutput; Sync characteristics need encryption",
    "passkey=NNNNNN": "the peripheral DISPLAYS this fixed passkey (io capability DisplayOnly, MITM required): a "
                      "central must enter it; any pairing that would not be passkey entry is refused "
                      "(SMP 'Authentication Requirements'); Sync characteristics need encryption",
    "refuse": "every pairing request is refused (SMP 'Pairing Not Supported'); Sync characteristics need "
              "encryption, so nothing can ever read them",
}


@dataclass(frozen=True)
class PairingPolicy:
    mode: str = "none"          # none | justworks | passkey | refuse
    passkey: int | None = None  # passkey mode: the number the peripheral displays
    encrypt: bool = False       # DATA (+ its CCCD), CONTROL, STREAM_INFO need an encrypted link

    def describe(self) -> dict:
        return {"mode": self.mode, "passkey": None if self.passkey is None else f"{self.passkey:06d}",
                "encryption_required": self.encrypt}


def parse_pairing_mode(text: str) -> PairingPolicy:
    mode, *flags = text.split(",")
    name, _, value = mode.partition("=")
    passkey = None
    if name == "passkey":
        if not (value.isdigit() and len(value) <= 6):
            raise SystemExit(f"pairing passkey=NNNNNN: '{value}' is not 1-6 digits")
        passkey = int(value)
    elif name not in ("none", "justworks", "refuse") or value:
        raise SystemExit(f"unknown pairing mode '{mode}'; known: none, justworks, passkey=NNNNNN, refuse")
    encrypt = name != "none"
    for flag in flags:
        if flag == "open":
            encrypt = False
        elif flag == "encrypt":
            encrypt = True
        else:
            raise SystemExit(f"unknown pairing flag '{flag}' (open | encrypt)")
    return PairingPolicy(name, passkey, encrypt)


def parse_pairing(items: list[str]) -> dict[int, PairingPolicy]:
    """`[N:]MODE[,FLAG]` -> {peripheral index (0 = all): policy}; like --fault, N: aims at one peripheral."""
    policies: dict[int, PairingPolicy] = {}
    for item in items:
        target, sep, rest = item.partition(":")
        index, text = (int(target), rest) if sep and target.isdigit() else (0, item)
        policies[index] = parse_pairing_mode(text)
    return policies


def pairing_for(policies: dict[int, PairingPolicy], index: int) -> PairingPolicy:
    return policies.get(index, policies.get(0, PairingPolicy()))


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peripherals", type=int, default=1)
    p.add_argument("--events", type=int, default=0, help="events buffered in each store at start")
    p.add_argument("--fault", action="append", default=[],
                   help="[N:]NAME[=VALUE], repeatable; N = only peripheral N (1-based); see --list-faults")
    p.add_argument("--rate", type=float, default=0.0, help="live events per second per peripheral (0: none)")
    p.add_argument("--payload-bytes", type=int, default=20)
    p.add_argument("--notify-rate", type=float, default=250.0,
                   help="max notifications per second per peripheral (TCG loses data above ~300/s); "
                        "0: unpaced (as fast as bumble takes them)")
    p.add_argument("--chunk", type=int, default=0, help="max bytes per notification (0: ATT MTU - 3)")
    p.add_argument("--pairing", action="append", default=[],
                   help="[N:]MODE[,open|,encrypt], repeatable; N = only peripheral N; see --list-pairing")
    p.add_argument("--seed", type=int, default=1, help="fault RNG seed (the address is mixed in)")
    p.add_argument("--max-window", type=int, default=65535, help="SYNC_REQ windows above this are violations")
    p.add_argument("--adv-interval", type=float, default=100.0, help="advertising interval, ms")
    p.add_argument("--privacy", type=int, action="append", default=[],
                   help="N: peripheral N (1-based) advertises on a resolvable private address (RPA) from its own "
                        "IRK; pairing distributes the IRK and its static address as the identity; repeatable")
    p.add_argument("--stats-dir", default=".")
    p.add_argument("--store-dir", default=None, help="default: STATS_DIR/store")
    p.add_argument("--ready-file", default=None)
    p.add_argument("--control", default=None, help="FIFO accepting control lines (see TESTBED.md)")
    p.add_argument("--vhci", default="vhci")
    p.add_argument("--engine", choices=("python", "c"), default="python",
                   help="who answers the protocol: this file, or the C library Hardware/peripheral through "
                        "ctypes (scripts/testbed.d/cengine.py; bumble still does GATT and the link)")
    p.add_argument("--check-args", action="store_true", help="validate the options and exit")
    p.add_argument("--list-faults", action="store_true")
    p.add_argument("--list-pairing", action="store_true")
    return p


def address_of(index: int) -> str:
    # Static random addresses (two top bits set): BlueZ treats them as stable identities.
    return f"C0:FF:EE:00:{index >> 8:02X}:{index & 0xFF:02X}"


def adv_data(name: str) -> bytes:
    flags = bytes([2, 0x01, 0x06])  # LE General Discoverable, BR/EDR not supported
    uuid_le = uuid.UUID(sp.SYNC_SERVICE_UUID).bytes[::-1]
    uuids = bytes([17, 0x07]) + uuid_le
    return flags + uuids


def scan_response(name: str) -> bytes:
    raw = name.encode()[:29]
    return bytes([len(raw) + 1, 0x09]) + raw


@dataclass
class OutFrame:
    data: bytes
    seq: int | None  # None: injected noise, not an event
    intact: bool
    sent: int = 0


@dataclass
class Session:
    """One gateway connection."""
    connection: object
    subscribed: bool = False
    requested: bool = False
    ack_base: int = 0
    window: int = 0
    next_seq: int = 1
    out: list[OutFrame] = field(default_factory=list)
    frames_sent: int = 0
    stalled: bool = False  # the `stall` fault hit on this connection: nothing new is sent any more
    window_full_since: float | None = None  # events waiting, none sendable: the window is used up
    authenticated: bool = False  # encrypted with a key from passkey (MITM) pairing


class SyncPeripheral:
    def __init__(self, index: int, args, faults: dict[str, float], store_dir: str,
                 pairing: PairingPolicy = PairingPolicy()):
        self.index = index
        self.pairing = pairing
        self.address = address_of(index)
        self.name = f"Ferry-P{index:02d}"
        self.args = args
        self.faults = faults
        self.rng = random.Random(args.seed * 1000003 + index)
        self.store_path = os.path.join(store_dir, f"peripheral-{self.address}.json")
        self.store = sp.EventStore(self.store_path, args.payload_bytes)
        # Bonds live next to the event store, so a `restart` (peripheral reboot) keeps them and
        # reconnects re-encrypt from the stored key; `forget` deletes them (a lost key).
        self.keys_path = os.path.join(store_dir, f"peripheral-{self.address}.keys.json")
        self.keystore = None
        if self.store.head == 0 and args.events:
            self.store.append(args.events)
        self.initial_events = args.events
        self.stats_path = os.path.join(args.stats_dir, f"peripheral-{self.address}.json")
        self.sessions: dict[int, Session] = {}
        self.wake = asyncio.Event()
        self.device = None
        self.data_char = None
        # Seqs delivered intact at least once in the current epoch/generation: the gateway may
        # only acknowledge these (or what this store no longer has).
        self.intact_sent: set[int] = set()
        self.highest_sent = 0
        self.silence_left = int(faults.get("silence", 0))
        self.disconnect_done = False
        self.stall_done = False
        self.reset_done = False
        self.regress_done = False
        self.stats = {
            "address": self.address, "advertising_address": self.address, "privacy": False, "events_generated": self.store.head, "frames_sent": 0,
            "frames_sent_intact": 0, "notifications_sent": 0, "notifications_dropped": 0, "bytes_sent": 0,
            "sync_reqs_received": 0, "acks_received": 0, "highest_ack": 0, "deleted": 0, "stale_answers": 0, "hidden": False,
            "connections": 0, "disconnections": 0, "subscriptions": 0, "mtu": 0,
            "faults_injected": {}, "violations": 0, "violation_list": [],
            # Link security, see Hardware/TESTBED.md "Pairing".
            "encrypted": False, "authenticated": False, "last_link_encrypted": False,
            "last_link_authenticated": False, "encrypted_connections": 0, "pairings_started": 0,
            "pairings_completed": 0, "pairing_failures": 0, "pairing_failure_reasons": [], "last_pairing": None,
            "bonds": 0, "frames_sent_unencrypted": 0, "notifications_blocked_unencrypted": 0,
            "clear_link_refusals": 0, "clear_link_refusal_list": [], "bonds_forgotten": 0,
            # The peripheral's own clock (time.monotonic in the guest), for benchmarks: the first and the last
            # DATA frame put on the air, the first and the latest connection, the last disconnection.
            "first_data_at": None, "last_data_at": None, "connected_at": None, "last_connected_at": None,
            "disconnected_at": None,
            # Seconds the peripheral had events to send but had used up the gateway's window (waiting for an
            # ACK): what a pipelined window is meant to remove.
            "window_wait_seconds": 0.0,
        }
        self.dirty = True

    # ------------------------------------------------------------- bookkeeping

    def violation(self, kind: str, detail: str) -> None:
        self.stats["violations"] += 1
        if len(self.stats["violation_list"]) < MAX_VIOLATIONS_LISTED:
            self.stats["violation_list"].append({"kind": kind, "detail": detail, "t": round(time.time(), 3)})
        log.warning("%s VIOLATION %s: %s", self.address, kind, detail)
        self.dirty = True

    def fault(self, name: str) -> None:
        fi = self.stats["faults_injected"]
        fi[name] = fi.get(name, 0) + 1

    def chance(self, name: str) -> bool:
        p = self.faults.get(name)
        return p is not None and self.rng.random() < p

    def snapshot(self) -> dict:
        s = dict(self.stats)
        s.update({"epoch": str(self.store.epoch), "head": self.store.head, "oldest": self.store.oldest,
                  "generation": self.store.generation, "highest_sent": self.highest_sent,
                  "connected": len(self.sessions), "faults": self.faults, "pairing": self.pairing.describe(),
                  "encrypted": any(x.connection.is_encrypted for x in self.sessions.values()),
                  "updated_at": round(time.time(), 3)})
        return s

    def write_stats(self) -> None:
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(), f, indent=1)
        os.replace(tmp, self.stats_path)
        self.dirty = False

    # ------------------------------------------------------------- GATT

    async def start(self, link):
        from bumble.controller import Controller
        from bumble.device import Device
        from bumble.gatt import Characteristic, CharacteristicValue, Service
        from bumble.hci import Address
        from bumble.host import Host
        from bumble.transport.common import AsyncPipeSink

        from bumble.att import AttributeValueV2
        from bumble.gatt import GATT_CLIENT_CHARACTERISTIC_CONFIGURATION_DESCRIPTOR
        from bumble.keys import JsonKeyStore

        GuardedCharacteristic, GuardedDescriptor = guarded_attribute_classes()
        controller = Controller(f"periph-{self.index}", link=link)
        host = Host(controller, AsyncPipeSink(controller))
        device = Device(name=self.name, address=Address(self.address, Address.RANDOM_DEVICE_ADDRESS), host=host)
        if self.index in self.args.privacy:
            # LE privacy: advertise and connect on an RPA generated from this IRK (fixed per peripheral, no
            # rotation during a run); the static address stays the identity sent in SMP's identity information.
            device.le_privacy_enabled = True
            device.le_rpa_timeout = 0
            device.irk = bytes.fromhex(self.address.replace(":", "")) * 2 + bytes(4)
        self.device = device
        self.keystore = JsonKeyStore(namespace=self.address, filename=self.keys_path)
        device.keystore = self.keystore
        device.pairing_config_factory = lambda _connection: pairing_config(self.pairing)
        device.smp_session_proxy = smp_session_class(self.pairing)

        read = Characteristic.READABLE
        write = Characteristic.WRITEABLE
        if self.pairing.encrypt:
            read |= Characteristic.READ_REQUIRES_ENCRYPTION
            write |= Characteristic.WRITE_REQUIRES_ENCRYPTION
            if self.pairing.mode == "passkey":
                # bumble counts any encrypted LE link as authenticated, so these add nothing on their
                # own: what makes a passkey peripheral's link MITM-protected is that it refuses every
                # pairing that is not passkey entry (smp_session_class).
                read |= Characteristic.READ_REQUIRES_AUTHENTICATION
                write |= Characteristic.WRITE_REQUIRES_AUTHENTICATION
        # DATA gets its own CCCD: bumble's automatic one is always writable, so a clear-link
        # central could subscribe. This one carries the same permissions as the characteristics.
        cccd = GuardedDescriptor(
            GATT_CLIENT_CHARACTERISTIC_CONFIGURATION_DESCRIPTOR, read | write,
            AttributeValueV2(lambda bearer: device.gatt_server.read_cccd(bearer, self.data_char),
                             write=lambda bearer, value: device.gatt_server.write_cccd(bearer, self.data_char, value)))
        cccd.refused = lambda what: self.on_clear_link_refusal("DATA CCCD", what)
        self.data_char = GuardedCharacteristic(sp.DATA_UUID, Characteristic.Properties.NOTIFY, read, b"",
                                               descriptors=[cccd])
        control = GuardedCharacteristic(
            sp.CONTROL_UUID,
            Characteristic.Properties.WRITE | Characteristic.Properties.WRITE_WITHOUT_RESPONSE,
            write, CharacteristicValue(write=self.on_control_write))
        info = GuardedCharacteristic(sp.STREAM_INFO_UUID, Characteristic.Properties.READ, read,
                                     CharacteristicValue(read=lambda _conn: self.stream_info_value()))
        self.data_char.refused = lambda what: self.on_clear_link_refusal("DATA", what)
        control.refused = lambda what: self.on_clear_link_refusal("CONTROL", what)
        info.refused = lambda what: self.on_clear_link_refusal("STREAM_INFO", what)
        device.add_service(Service(sp.SYNC_SERVICE_UUID, [self.data_char, control, info]))
        self.data_char.on("subscription", self.on_subscription)
        device.on("connection", self.on_connection)
        await self.count_bonds()
        await device.power_on()
        self.stats["advertising_address"] = str(device.random_address).split("/")[0]
        self.stats["privacy"] = bool(device.le_privacy_enabled)
        await self.advertise()
        asyncio.get_running_loop().create_task(self.sender())
        if self.args.rate > 0:
            asyncio.get_running_loop().create_task(self.live_events())
        log.info("%s advertising (epoch %d, head %d, oldest %d)", self.address, self.store.epoch,
                 self.store.head, self.store.oldest)

    def stream_info_value(self) -> bytes:
        return self.store.stream_info()

    async def advertise(self) -> None:
        await self.device.start_advertising(
            auto_restart=True, advertising_data=adv_data(self.name), scan_response_data=scan_response(self.name),
            advertising_interval_min=self.args.adv_interval, advertising_interval_max=self.args.adv_interval)

    def on_connection(self, connection):
        self.stats["connections"] += 1
        now = time.monotonic()
        if self.stats["connected_at"] is None:
            self.stats["connected_at"] = now
        self.stats["last_connected_at"] = now
        session = Session(connection)
        self.sessions[connection.handle] = session
        self.stats["last_link_encrypted"] = False
        self.stats["last_link_authenticated"] = False
        log.info("%s connected by %s (handle %d)", self.address, connection.peer_address, connection.handle)
        self.dirty = True

        def on_encryption_change():
            if not connection.is_encrypted:
                return
            self.stats["encrypted_connections"] += 1
            self.stats["last_link_encrypted"] = True
            self.dirty = True
            log.info("%s link encrypted", self.address)
            # A reconnect re-encrypts from the stored key: whether that key came from passkey
            # entry is in the key store (the pairing handler sets it for a fresh pairing).
            asyncio.get_running_loop().create_task(self.note_key_strength(session))
            self.wake.set()

        def on_pairing_start():
            self.stats["pairings_started"] += 1
            self.dirty = True

        def on_pairing(keys):
            self.stats["pairings_completed"] += 1
            session.authenticated = bool(keys.ltk and keys.ltk.authenticated)
            self.stats["last_link_authenticated"] = session.authenticated
            self.stats["last_pairing"] = {"peer": str(connection.peer_address),
                                          "authenticated": session.authenticated, "t": round(time.time(), 3)}
            self.dirty = True
            log.info("%s paired with %s (%s)", self.address, connection.peer_address,
                     "passkey, MITM-protected" if session.authenticated else "Just Works")
            asyncio.get_running_loop().create_task(self.count_bonds())

        def on_pairing_failure(reason):
            self.stats["pairing_failures"] += 1
            name = getattr(reason, "name", str(reason))
            if len(self.stats["pairing_failure_reasons"]) < 50:
                self.stats["pairing_failure_reasons"].append(name)
            self.dirty = True
            log.info("%s pairing failed: %s", self.address, name)

        connection.on("connection_encryption_change", on_encryption_change)
        connection.on("pairing_start", on_pairing_start)
        connection.on("pairing", on_pairing)
        connection.on("pairing_failure", on_pairing_failure)

        def on_disconnection(reason):
            self.sessions.pop(connection.handle, None)
            self.stats["disconnections"] += 1
            self.stats["disconnected_at"] = time.monotonic()
            self.dirty = True
            log.info("%s disconnected (reason 0x%02x)", self.address, reason)

        def on_mtu():
            self.stats["mtu"] = connection.att_mtu

        connection.on("disconnection", on_disconnection)
        connection.on("connection_att_mtu_update", on_mtu)

    async def note_key_strength(self, session: Session) -> None:
        try:
            keys = await self.keystore.get(str(session.connection.peer_address))
        except Exception as e:  # a missing/partial key file: the link is then not known authenticated
            log.info("%s key store read failed: %r", self.address, e)
            keys = None
        if keys is not None and keys.ltk is not None and keys.ltk.authenticated:
            session.authenticated = True
        self.stats["last_link_authenticated"] = session.authenticated
        self.dirty = True

    async def count_bonds(self) -> None:
        try:
            self.stats["bonds"] = len(await self.keystore.get_all())
        except Exception as e:
            log.info("%s key store read failed: %r", self.address, e)
        self.dirty = True

    def on_clear_link_refusal(self, what: str, access: str) -> None:
        self.stats["clear_link_refusals"] += 1
        if len(self.stats["clear_link_refusal_list"]) < 50:
            self.stats["clear_link_refusal_list"].append(f"{access} {what}")
        self.dirty = True
        log.info("%s refused %s of %s on a link without the required security", self.address, access, what)

    def link_allowed(self, session: Session) -> bool:
        """Belt and braces behind the ATT permissions: nothing of the Sync service moves on a clear
        link when this peripheral requires encryption."""
        return not self.pairing.encrypt or session.connection.is_encrypted

    def on_subscription(self, connection, notify_enabled, indicate_enabled):
        session = self.sessions.get(getattr(connection, "handle", None))
        if session is None:
            return
        if (notify_enabled or indicate_enabled) and not self.link_allowed(session):
            log.warning("%s subscription on a clear link ignored", self.address)
            return
        session.subscribed = bool(notify_enabled or indicate_enabled)
        self.stats["subscriptions"] += 1
        log.info("%s DATA notifications %s", self.address, "on" if session.subscribed else "off")
        self.wake.set()

    def on_control_write(self, connection, value: bytes):
        session = self.sessions.get(connection.handle)
        if session is None:
            return
        if not self.link_allowed(session):
            log.warning("%s CONTROL write on a clear link ignored", self.address)
            return
        value = bytes(value)
        try:
            frame = sp.decode_single(value)
        except sp.FrameError as e:
            self.violation("malformed_write", f"{e}: {value.hex()}")
            return
        if frame.type == sp.TYPE_SYNC_REQ:
            self.on_sync_req(session, frame)
        elif frame.type == sp.TYPE_SYNC_ACK:
            self.on_sync_ack(session, frame)
        else:
            self.violation("malformed_write", f"frame type 0x{frame.type:02x} is not SYNC_REQ/SYNC_ACK: {value.hex()}")

    def on_sync_req(self, session: Session, frame: sp.Frame) -> None:
        self.stats["sync_reqs_received"] += 1
        self.dirty = True
        if len(frame.payload) != 2:
            self.violation("malformed_write", f"SYNC_REQ payload is {len(frame.payload)} bytes, expected 2")
            return
        (window,) = struct.unpack(">H", frame.payload)
        if window == 0 or window > self.args.max_window:
            self.violation("window_invalid", f"SYNC_REQ window {window} (allowed 1..{self.args.max_window})")
            return
        if frame.seq > self.store.head:
            self.violation("req_beyond_head", f"SYNC_REQ last={frame.seq} > head {self.store.head}")
        log.info("%s SYNC_REQ last=%d window=%d (oldest %d head %d)", self.address, frame.seq, window,
                 self.store.oldest, self.store.head)
        if session.stalled:
            # The field fault of issue 12: a firmware stuck mid-replay answers with one old frame only.
            seq = frame.seq
            if seq >= 1:
                self.stats["stale_answers"] += 1
                session.out.append(OutFrame(sp.data_frame(seq, self.store.payload(seq)), seq, True))
                session.requested = True
                log.info("%s fault stall: answering SYNC_REQ last=%d with a stale duplicate", self.address, seq)
                self.wake.set()
            return
        if self.silence_left > 0:
            self.silence_left -= 1
            self.fault("silence")
            log.info("%s fault silence: ignoring this SYNC_REQ", self.address)
            return
        session.requested = True
        session.window = window
        # Events the store no longer has cannot be sent: the window counts from what is retained.
        session.ack_base = max(frame.seq, self.store.deleted_through)
        session.next_seq = session.ack_base + 1
        # A new request replaces the old replay: unsent frames go, a frame already started finishes.
        session.out = [f for f in session.out if f.sent > 0]
        self.wake.set()

    def on_sync_ack(self, session: Session, frame: sp.Frame) -> None:
        self.stats["acks_received"] += 1
        self.dirty = True
        if frame.payload:
            self.violation("malformed_write", f"SYNC_ACK with {len(frame.payload)} payload bytes")
            return
        ack = frame.seq
        if ack > self.highest_sent:
            self.violation("ack_beyond_sent", f"SYNC_ACK {ack} > highest seq sent {self.highest_sent}")
        else:
            for s in range(self.store.deleted_through + 1, min(ack, self.store.head) + 1):
                if s not in self.intact_sent:
                    self.violation("ack_of_unreceived",
                                   f"SYNC_ACK {ack} covers seq {s}, which was never delivered intact")
                    break
        self.stats["highest_ack"] = max(self.stats["highest_ack"], ack)
        deleted = self.store.delete_through(ack)
        self.stats["deleted"] += deleted
        session.ack_base = max(session.ack_base, ack)
        self.intact_sent = {s for s in self.intact_sent if s > self.store.deleted_through}
        self.wake.set()
        self.check_store_faults(ack)

    def check_store_faults(self, ack: int) -> None:
        threshold = lambda name: int(self.faults[name]) if self.faults[name] >= 0 else self.initial_events  # noqa: E731
        if "epoch-reset" in self.faults and not self.reset_done and ack >= threshold("epoch-reset"):
            self.reset_done = True
            self.fault("epoch-reset")
            asyncio.get_running_loop().create_task(self.store_change(self.do_epoch_reset))
        elif "regression" in self.faults and not self.regress_done and ack >= threshold("regression"):
            self.regress_done = True
            self.fault("regression")
            asyncio.get_running_loop().create_task(
                self.store_change(lambda: self.do_regress(threshold("regression") // 2)))

    async def store_change(self, change) -> None:
        await self.disconnect_all()
        change()
        self.dirty = True

    def do_epoch_reset(self) -> None:
        self.store.wipe()
        self.store.append(self.initial_events)
        self.stats["events_generated"] += self.initial_events
        self.intact_sent.clear()
        self.highest_sent = 0
        log.info("%s fault epoch-reset: new epoch %d head %d", self.address, self.store.epoch, self.store.head)

    def do_regress(self, new_head: int) -> None:
        self.store.regress(new_head)
        self.intact_sent.clear()
        self.highest_sent = min(self.highest_sent, new_head)
        log.info("%s fault regression: head back to %d", self.address, new_head)

    def do_restart(self) -> None:
        """Reload the store from its file, as a rebooted peripheral would."""
        self.store = sp.EventStore(self.store_path, self.args.payload_bytes)
        log.info("%s restarted from %s (epoch %d head %d oldest %d)", self.address, self.store_path,
                 self.store.epoch, self.store.head, self.store.oldest)

    async def disconnect_all(self) -> None:
        for session in list(self.sessions.values()):
            try:
                await asyncio.wait_for(session.connection.disconnect(), 5)
            except Exception as e:  # the link may already be gone; the fault still happened
                log.info("%s disconnect: %r", self.address, e)
            self.sessions.pop(session.connection.handle, None)

    # ------------------------------------------------------------- sending

    def refill(self, session: Session) -> None:
        if session.stalled:
            return
        limit = min(self.store.head, session.ack_base + session.window)
        # Keep only a little queued so a new SYNC_REQ takes effect quickly.
        while session.next_seq <= limit and len(session.out) < 64:
            seq = session.next_seq
            if not self.store.retained(seq):
                session.next_seq = max(seq + 1, self.store.deleted_through + 1)
                continue
            frame = sp.data_frame(seq, self.store.payload(seq))
            if self.chance("oversize"):
                self.fault("oversize")
                bogus = bytes([sp.MAGIC, sp.TYPE_DATA]) + struct.pack(">QH", seq, 0xFFFF) + bytes(8)
                session.out.append(OutFrame(bogus, None, True))
            if self.chance("unknown-type"):
                self.fault("unknown-type")
                session.out.append(OutFrame(sp.encode_frame(0x7E, seq, b"unknown"), None, True))
            if self.chance("corrupt"):
                self.fault("corrupt")
                damaged = bytearray(frame)
                damaged[self.rng.randrange(1, len(damaged))] ^= 1 << self.rng.randrange(8)
                session.out.append(OutFrame(bytes(damaged), seq, False))
            else:
                session.out.append(OutFrame(frame, seq, True))
            if self.chance("duplicate"):
                self.fault("duplicate")
                session.out.append(OutFrame(frame, seq, True))
            session.next_seq += 1

    def take_chunk(self, session: Session, size: int) -> tuple[bytes, list[OutFrame]]:
        chunk = bytearray()
        touched: list[OutFrame] = []
        for f in session.out:
            if len(chunk) >= size:
                break
            n = min(size - len(chunk), len(f.data) - f.sent)
            chunk += f.data[f.sent:f.sent + n]
            f.sent += n
            touched.append(f)
        return bytes(chunk), touched

    async def sender(self) -> None:
        while True:
            # Cleared before the work, not after: a wake-up set while a notification is
            # awaited must not be lost (it would stall the link for the 0.5 s timeout).
            self.wake.clear()
            busy = False
            for session in list(self.sessions.values()):
                if session.subscribed and session.requested:
                    if not self.link_allowed(session):
                        self.stats["notifications_blocked_unencrypted"] += 1
                        self.dirty = True
                        continue
                    busy |= await self.send_one(session)
            if "slow" in self.faults:
                await asyncio.sleep(1.0 / max(self.faults["slow"], 0.1))
            elif busy:
                await asyncio.sleep(1.0 / self.args.notify_rate if self.args.notify_rate > 0 else 0)
            else:
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass

    async def send_one(self, session: Session) -> bool:
        self.refill(session)
        if not session.out:
            if (session.window_full_since is None and not session.stalled
                    and session.next_seq <= self.store.head and session.next_seq > session.ack_base + session.window):
                session.window_full_since = time.monotonic()
            return False
        if session.window_full_since is not None:
            self.stats["window_wait_seconds"] += time.monotonic() - session.window_full_since
            session.window_full_since = None
        mtu_payload = session.connection.att_mtu - 3
        size = mtu_payload if self.args.chunk <= 0 else min(self.args.chunk, mtu_payload)
        if "slow" in self.faults:
            size = min(size, 20)
        chunk, touched = self.take_chunk(session, size)
        dropped = self.chance("drop")
        if dropped:
            self.fault("drop")
            self.stats["notifications_dropped"] += 1
            for f in touched:
                f.intact = False
        else:
            try:
                await self.device.notify_subscriber(session.connection, self.data_char, chunk)
            except Exception as e:
                log.info("%s notify failed: %r", self.address, e)
                return False
            self.stats["notifications_sent"] += 1
            self.stats["bytes_sent"] += len(chunk)
        clear_link = not session.connection.is_encrypted
        for f in touched:
            if f.sent == len(f.data):
                if f.seq is not None:
                    self.stats["frames_sent"] += 1
                    now = time.monotonic()
                    if self.stats["first_data_at"] is None:
                        self.stats["first_data_at"] = now
                    self.stats["last_data_at"] = now
                    if clear_link:
                        self.stats["frames_sent_unencrypted"] += 1
                    self.highest_sent = max(self.highest_sent, f.seq)
                    session.frames_sent += 1
                    if f.intact:
                        self.stats["frames_sent_intact"] += 1
                        self.intact_sent.add(f.seq)
        session.out = [f for f in session.out if f.sent < len(f.data)]
        self.dirty = True
        if ("stall" in self.faults and not self.stall_done and not session.stalled
                and session.frames_sent >= int(self.faults["stall"])):
            self.stall_done = True
            session.stalled = True
            session.out = [f for f in session.out if f.sent > 0]  # a frame already started is finished
            self.fault("stall")
            log.info("%s fault stall after %d frames: link stays up, nothing new is sent", self.address,
                     session.frames_sent)
        if ("disconnect" in self.faults and not self.disconnect_done
                and session.frames_sent >= int(self.faults["disconnect"])):
            self.disconnect_done = True
            self.fault("disconnect")
            log.info("%s fault disconnect after %d frames", self.address, session.frames_sent)
            await self.disconnect_all()
        return True

    async def live_events(self) -> None:
        # Batches at most every 20 ms: per-event timers would swamp an emulated CPU.
        tick = max(1.0 / self.args.rate, 0.02)
        owed = 0.0
        while True:
            await asyncio.sleep(tick)
            owed += self.args.rate * tick
            n = int(owed)
            if n:
                owed -= n
                self.store.append(n)
                self.stats["events_generated"] += n
                self.dirty = True
                self.wake.set()

    # ------------------------------------------------------------- control

    async def control(self, words: list[str]) -> None:
        cmd = words[0]
        if cmd == "disconnect":
            await self.disconnect_all()
        elif cmd == "restart":
            await self.disconnect_all()
            self.do_restart()
        elif cmd == "add":
            n = int(words[1]) if len(words) > 1 else 1
            self.store.append(n)
            self.stats["events_generated"] += n
            self.wake.set()
        elif cmd == "wipe":
            await self.store_change(self.do_epoch_reset)
        elif cmd == "regress":
            new_head = int(words[1])
            await self.store_change(lambda: self.do_regress(new_head))
        elif cmd == "hide":
            # Out of range: stop advertising, so a central's LE Create Connection stays pending (and a
            # second Device1.Connect meanwhile gets org.bluez.Error.InProgress from bluetoothd).
            await self.disconnect_all()
            await self.device.stop_advertising()
            self.stats["hidden"] = True
            log.info("%s hidden (not advertising)", self.address)
        elif cmd == "show":
            await self.advertise()
            self.stats["hidden"] = False
            log.info("%s advertising again", self.address)
        elif cmd == "forget":
            # A peripheral reset that loses its keys: the central still has its half of the bond.
            await self.disconnect_all()
            await self.keystore.delete_all()
            self.stats["bonds_forgotten"] += 1
            await self.count_bonds()
            log.info("%s forgot every bond", self.address)
        else:
            log.warning("unknown control command %r", words)
        self.dirty = True


def guarded_attribute_classes():
    """Characteristic/Descriptor that report each access refused for want of link security (the ATT
    permission check itself is bumble's), so the stats show what a clear-link central tried."""
    from bumble.att import ATT_Error
    from bumble.gatt import Characteristic, Descriptor

    class Guarded:
        refused = staticmethod(lambda access: None)

        async def read_value(self, bearer):
            try:
                return await super().read_value(bearer)
            except ATT_Error as e:
                self.refused(f"read (ATT error 0x{e.error_code:02x})")
                raise

        async def write_value(self, bearer, value):
            try:
                return await super().write_value(bearer, value)
            except ATT_Error as e:
                self.refused(f"write (ATT error 0x{e.error_code:02x})")
                raise

    class GuardedCharacteristic(Guarded, Characteristic):
        pass

    class GuardedDescriptor(Guarded, Descriptor):
        pass

    return GuardedCharacteristic, GuardedDescriptor


def pairing_config(policy: PairingPolicy):
    """What this peripheral answers to a Pairing Request (a new config per pairing, as bumble asks)."""
    from bumble.pairing import PairingConfig, PairingDelegate

    class Delegate(PairingDelegate):
        async def accept(self) -> bool:
            return policy.mode != "refuse"

        async def generate_passkey(self) -> int:
            # The number a real device would show on its display; the operator types it into the gateway.
            return policy.passkey if policy.passkey is not None else await super().generate_passkey()

    io = (PairingDelegate.DISPLAY_OUTPUT_ONLY if policy.mode == "passkey"
          else PairingDelegate.NO_OUTPUT_NO_INPUT)
    # The static random address stays the identity: with a public identity BlueZ would re-key the
    # device under another address after pairing.
    return PairingConfig(sc=True, mitm=policy.mode == "passkey", bonding=True, delegate=Delegate(io),
                         identity_address_type=PairingConfig.AddressType.RANDOM)


def smp_session_class(policy: PairingPolicy):
    """Two fixes to bumble's SMP responder session (0.0.236):
    - bumble falls back to Just Works whenever the io capabilities allow nothing better, even with MITM
      required. A passkey peripheral must refuse that instead, or any central could bond silently.
    - a failed session stays attached to its connection until the link drops, so a retry on the same
      link (wrong passkey, then the right one) would run into the finished session and never store
      its keys. The session now ends when pairing fails."""
    from bumble import smp

    class FerrySession(smp.Session):
        async def on_smp_pairing_request_command_async(self, command) -> None:
            if policy.mode == "passkey":
                self.decide_pairing_method(command.auth_req, command.io_capability, self.io_capability)
                if self.pairing_method != smp.PairingMethod.PASSKEY:
                    log.info("pairing request refused: io capability %s would give %s, this peripheral "
                             "requires passkey entry", command.io_capability, self.pairing_method.name)
                    self.send_pairing_failed(smp.ErrorCode.AUTHENTICATION_REQUIREMENTS)
                    return
            await super().on_smp_pairing_request_command_async(command)

        def on_pairing_failure(self, reason) -> None:
            super().on_pairing_failure(reason)
            if self.manager.sessions.get(self.connection.handle) is self:
                self.on_disconnection(0)  # detaches the session exactly as a link loss would

    return FerrySession


def make_link_and_controller_classes():
    """The two bumble fixes this bed needs (see Hardware/TESTBED.md, 'bumble pitfalls')."""
    from bumble import core, hci, ll
    from bumble.controller import Controller
    from bumble.link import LocalLink

    class RoutingLink(LocalLink):
        # LocalLink addresses LE ACL data with the sender's *random* address, but the kernel
        # scans with a random address and connects with its public one: route by the
        # connection's own address instead, or every peripheral drops the data.
        def send_acl_data(self, sender_controller, destination_address, transport, data):
            if transport == core.PhysicalTransport.LE:
                conn = sender_controller.le_connections.get(destination_address)
                if conn is not None:
                    dest = self.find_le_controller(destination_address)
                    if dest is not None:
                        src = conn.self_address
                        asyncio.get_running_loop().call_soon(
                            lambda: dest.on_link_acl_data(src, transport, data))
                    return
            super().send_acl_data(sender_controller, destination_address, transport, data)

    class KernelFacingController(Controller):
        # A wedged controller (control `wedge hci0 [forever]`): every HCI packet from the kernel is ignored
        # and nothing is sent to it (commands time out, no advertising reports, no connections), while
        # bluetoothd still calls it powered. `heal-on-reset`: an HCI_Reset (a power-on through bluetoothd, the
        # kernel's HCIDEVRESET) brings it back, as it does many real ones; `forever`: nothing does.
        wedged: str | None = None
        wedge_stats = {"wedged": None, "dropped_from_host": 0, "dropped_to_host": 0, "healed_by_reset": 0}
        wedge_stats_path: str | None = None

        def set_wedged(self, mode: str | None) -> None:
            self.wedged = mode
            self.wedge_stats["wedged"] = mode
            self.write_wedge_stats()

        def write_wedge_stats(self) -> None:
            if self.wedge_stats_path:
                tmp = self.wedge_stats_path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(self.wedge_stats, f)
                os.replace(tmp, self.wedge_stats_path)

        def on_hci_packet(self, packet):
            if isinstance(packet, hci.HCI_Reset_Command):
                # bumble's HCI_Reset leaves its state as it was ("TODO: cleanup"); a real controller stops scanning
                # and forgets a pending LE connect. Without this, a reset during a scan left le_scan_enable set and
                # every later LE Set Scan Parameters failed with Command Disallowed: discovery ended the moment it
                # started, so a healed controller still found nothing.
                self.le_scan_enable = False
                self.pending_le_connection = None
                # A real controller's reset also drops its links, and each peer sees the link end (supervision
                # timeout) and advertises again. bumble's keeps them: a peripheral connected when the controller
                # wedged stayed connected to a link nobody served and never advertised again.
                for connection in list(self.le_connections.values()):
                    connection.send_ll_control_pdu(ll.TerminateInd(hci.HCI_CONNECTION_TIMEOUT_ERROR))
                    del self.le_connections[connection.peer_address]
            if self.wedged is not None:
                if self.wedged == "heal-on-reset" and isinstance(packet, hci.HCI_Reset_Command):
                    log.warning("controller: HCI_Reset while wedged: answering again")
                    self.wedge_stats["healed_by_reset"] += 1
                    self.set_wedged(None)
                else:
                    self.wedge_stats["dropped_from_host"] += 1
                    return
            super().on_hci_packet(packet)

        # Linux 6.1 unmasks LE Enhanced Connection Complete (LE event mask bit 9) and waits
        # for it; bumble only sends the legacy event, which leaves the kernel's connect
        # pending until it times out (then every later Connect fails with EBUSY).
        def send_hci_packet(self, packet):
            if self.wedged is not None:
                self.wedge_stats["dropped_to_host"] += 1
                return
            if isinstance(packet, hci.HCI_LE_Connection_Complete_Event) and (self.le_event_mask >> 9) & 1:
                packet = hci.HCI_LE_Enhanced_Connection_Complete_Event(
                    status=packet.status, connection_handle=packet.connection_handle, role=packet.role,
                    peer_address_type=packet.peer_address_type, peer_address=packet.peer_address,
                    local_resolvable_private_address=hci.Address.ANY_RANDOM,
                    peer_resolvable_private_address=hci.Address.ANY_RANDOM,
                    connection_interval=packet.connection_interval,
                    peripheral_latency=packet.peripheral_latency,
                    supervision_timeout=packet.supervision_timeout,
                    central_clock_accuracy=packet.central_clock_accuracy)
            super().send_hci_packet(packet)

    return RoutingLink, KernelFacingController


class VhciTransport:
    """/dev/vhci as the transport between a kernel-facing controller and the kernel (it becomes hciN).

    The kernel refuses a packet written to /dev/vhci with ENXIO while the hci device is down
    (hci_recv_frame): bluetoothd powering hci0 off with links still up meets a controller that still has
    events and ACL data on their way, and on a real transport those are simply lost. bumble's file
    transport treats the failed write as fatal and closes /dev/vhci, and closing it unregisters hci0 for
    good. Here a refused packet is dropped and counted. One packet per read(2) and per write(2), as
    /dev/vhci requires.
    """

    VENDOR_PACKET = 0xFF  # the kernel's first read: the index of the new hci device
    CONTROLLER_TYPE_PRIMARY = 0x00

    def __init__(self, path: str) -> None:
        from bumble.transport.common import StreamPacketSource
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.source = StreamPacketSource()
        self.sink = self
        self.refused = 0
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.fd, self._readable)
        os.write(self.fd, bytes([self.VENDOR_PACKET, self.CONTROLLER_TYPE_PRIMARY]))

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            return self._stop_reading(str(error))
        if not data:  # would stay readable forever: stop rather than spin
            return self._stop_reading("end of file")
        if data[0] != self.VENDOR_PACKET:
            self.source.data_received(data)

    def _stop_reading(self, reason: str) -> None:
        log.error("controller: reading %s failed (%s): the controller stops", self.path, reason)
        self.loop.remove_reader(self.fd)

    def on_packet(self, packet: bytes) -> None:
        try:
            os.write(self.fd, packet)
        except OSError as error:
            if error.errno != errno.ENXIO:
                log.error("controller: writing to %s failed (%s): packet dropped", self.path, error)
                return
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning("controller: the kernel refused %d packet(s) while its hci device was down: dropped",
                            self.refused)

    async def close(self) -> None:
        self.loop.remove_reader(self.fd)
        os.close(self.fd)


async def open_controller_transport(spec: str):
    """The transport a KernelFacingController talks to the kernel through: `vhci[:PATH]` opens /dev/vhci
    (VhciTransport); anything else (the host layout's `unix:` socket to vhci_relay) is bumble's."""
    kind, _, path = spec.partition(":")
    if kind == "vhci":
        return VhciTransport(path or "/dev/vhci")
    from bumble.transport import open_transport
    return await open_transport(spec)


def control_reader(path: str, loop, peripherals: dict[str, SyncPeripheral], controller=None) -> None:
    """Thread: line commands from a FIFO, e.g. `restart C0:FF:EE:00:00:01` or `add all 100`."""
    fd = os.open(path, os.O_RDWR)  # RDWR: no EOF when the last writer closes
    with os.fdopen(fd, "r") as f:
        for line in f:
            words = line.split()
            if len(words) < 2:
                if words:
                    log.warning("control: expected 'COMMAND ADDR|all [ARG]', got %r", line)
                continue
            cmd, target, rest = words[0], words[1].upper(), words[2:]
            if cmd in ("wedge", "unwedge") and controller is not None:
                mode = None if cmd == "unwedge" else ("forever" if rest[:1] == ["forever"] else "heal-on-reset")
                log.warning("control: controller %s: wedged=%s", target, mode)
                loop.call_soon_threadsafe(controller.set_wedged, mode)
                continue
            targets = list(peripherals.values()) if target == "ALL" else [peripherals.get(target)]
            for p in targets:
                if p is None:
                    log.warning("control: no peripheral %s", target)
                    continue
                asyncio.run_coroutine_threadsafe(p.control([cmd] + rest), loop)


async def run(args, faults, pairings) -> None:
    RoutingLink, KernelFacingController = make_link_and_controller_classes()
    store_dir = args.store_dir or os.path.join(args.stats_dir, "store")
    os.makedirs(store_dir, exist_ok=True)
    os.makedirs(args.stats_dir, exist_ok=True)
    link = RoutingLink()
    peripherals: dict[str, SyncPeripheral] = {}
    cls = SyncPeripheral
    if args.engine == "c":
        import cengine
        cls = cengine.c_peripheral_class(SyncPeripheral)
    for i in range(1, args.peripherals + 1):
        p = cls(i, args, faults_for(faults, i), store_dir, pairing_for(pairings, i))
        await p.start(link)
        peripherals[p.address] = p
    # hci0 appears only now, with every peripheral already advertising: the kernel's first
    # HCI commands then meet an idle event loop (slow imports under TCG would delay them).
    vhci_path = args.vhci.partition(":")[2] or "/dev/vhci"
    for _ in range(600):
        if os.path.exists(vhci_path):
            break
        await asyncio.sleep(0.1)
    transport = await open_controller_transport(args.vhci)
    # A non-zero public address: the adapter's identity on D-Bus.
    kernel_controller = KernelFacingController(
        "hci-vhci", host_source=transport.source, host_sink=transport.sink, link=link,
        public_address="F0:E0:D0:00:00:01")
    for p in peripherals.values():
        p.write_stats()
    loop = asyncio.get_running_loop()
    if args.control:
        kernel_controller.wedge_stats_path = os.path.join(args.stats_dir, "controller.json")
        kernel_controller.write_wedge_stats()
        threading.Thread(
            target=control_reader, args=(args.control, loop, peripherals, kernel_controller), daemon=True).start()
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(" ".join(peripherals) + "\n")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("ready: %d peripheral(s), %d event(s) each, faults %s", len(peripherals), args.events, faults or "none")
    for p in peripherals.values():
        if p.pairing != PairingPolicy():
            log.info("%s pairing %s", p.address, p.pairing.describe())
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
        for p in peripherals.values():
            if p.dirty:
                p.write_stats()
    for p in peripherals.values():
        p.write_stats()
    log.info("stopped; final stats written")
    del kernel_controller
    await transport.close()


def main() -> None:
    args = build_arg_parser().parse_args()
    if args.list_faults:
        for name, (default, meaning) in FAULTS.items():
            print(f"{name:14} default {default:>6}  {meaning}")
        return
    if args.list_pairing:
        for name, meaning in PAIRING_MODES.items():
            print(f"{name:15} {meaning}")
        print("flags: ',open' = SMP offered but nothing required; ',encrypt' = Sync characteristics need encryption")
        return
    faults = parse_faults(args.fault)
    pairings = parse_pairing(args.pairing)
    if not 0 <= args.peripherals <= 250 or args.events < 0 or args.rate < 0 or args.notify_rate < 0:
        raise SystemExit("invalid counts or rates")
    if not 0 <= args.payload_bytes <= 4096:
        raise SystemExit("--payload-bytes must be 0..4096")
    if args.check_args:
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("bumble").setLevel(os.environ.get("TESTBED_BUMBLE_LOG", "WARNING"))
    asyncio.run(run(args, faults, pairings))


if __name__ == "__main__":
    main()
