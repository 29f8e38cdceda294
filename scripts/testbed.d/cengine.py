"""`peripheral.py --engine c`: the Sync protocol answered by the C library (Hardware/peripheral/ferry_sync.c)
through ctypes, with bumble kept for the GATT server and the link layer.

What runs in C: CONTROL parsing, SYNC_REQ/SYNC_ACK handling, the window, framing and CRC, packing frames
into notifications of up to MTU-3 bytes, STREAM_INFO, seq/epoch assignment (the C library's random-source
callback), restart from persisted meta. What Python provides, through the library's callbacks:
 - storage: the emulator's file-backed EventStore (head/epoch/deleted_through persisted with fsync+rename;
   event bytes are event_payload(), recomputable, so append only checks them);
 - transport: notify() queues one notification, can_send() is "the previous one has been handed to
   bumble", mtu() is the connection's ATT MTU.
Faults other than the control FIFO's disconnect/restart/add/wipe are not offered: the point of this
engine is to show the C code's own behaviour.
"""

from __future__ import annotations

import ctypes as C
import logging
import os

import syncproto as sp

log = logging.getLogger("peripheral")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_LIB = os.path.join(ROOT, ".build", "ferry-peripheral", "libferrysync.so")

OK, ERR_STORAGE, ERR_NOT_FOUND = 0, -2, -5

# ferry_control_kind, in header order
KINDS = ["SYNC_REQ", "SYNC_ACK", "SHORT", "BAD_MAGIC", "LENGTH_MISMATCH", "BAD_CRC", "UNEXPECTED_TYPE",
         "BAD_REQ_PAYLOAD", "BAD_ACK_PAYLOAD", "WINDOW_ZERO"]
STATS = ["sync_reqs", "acks", "frames_sent", "notifications", "bytes_sent", "req_beyond_head", "ack_beyond_sent",
         "read_errors", "highest_ack", "deleted"] + [f"control_{k.lower()}" for k in KINDS]


class Meta(C.Structure):
    _fields_ = [("epoch", C.c_uint64), ("head", C.c_uint64), ("deleted_through", C.c_uint64)]


APPEND = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_uint64, C.POINTER(C.c_uint8), C.c_uint16)
READ = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_uint64, C.POINTER(C.c_uint8), C.c_uint16)
DELETE = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_uint64)
PERSIST = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(Meta))
NOTIFY = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.c_uint8), C.c_uint16)
MTU = C.CFUNCTYPE(C.c_uint16, C.c_void_p)
CAN_SEND = C.CFUNCTYPE(C.c_int, C.c_void_p)
RANDOM = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.c_uint8))


class Storage(C.Structure):
    _fields_ = [("ctx", C.c_void_p), ("append", APPEND), ("read", READ), ("delete_through", DELETE),
                ("persist", PERSIST)]


class Transport(C.Structure):
    _fields_ = [("ctx", C.c_void_p), ("notify", NOTIFY), ("mtu", MTU), ("can_send", CAN_SEND)]


def load_library(path: str | None = None):
    path = path or os.environ.get("FERRY_PERIPHERAL_LIB", DEFAULT_LIB)
    if not os.path.exists(path):
        raise SystemExit(f"--engine c: {path} not found (build it: Hardware/peripheral/run-tests)")
    lib = C.CDLL(path)
    lib.ferry_ffi_sizeof_peripheral.restype = C.c_size_t
    lib.ferry_ffi_sizeof_conn.restype = C.c_size_t
    lib.ferry_ffi_stats.argtypes = [C.c_void_p, C.POINTER(C.c_uint64), C.c_uint]
    lib.ferry_ffi_meta.argtypes = [C.c_void_p, C.POINTER(Meta)]
    lib.ferry_init.argtypes = [C.c_void_p, C.POINTER(Storage), RANDOM, C.c_void_p, C.POINTER(Meta)]
    lib.ferry_append.argtypes = [C.c_void_p, C.c_char_p, C.c_uint16, C.POINTER(C.c_uint64)]
    lib.ferry_wipe.argtypes = [C.c_void_p]
    lib.ferry_stream_info.argtypes = [C.c_void_p, C.c_char_p]
    lib.ferry_stream_info.restype = None
    lib.ferry_conn_open.argtypes = [C.c_void_p, C.c_void_p, C.POINTER(Transport)]
    lib.ferry_conn_open.restype = None
    lib.ferry_conn_subscribe.argtypes = [C.c_void_p, C.c_int]
    lib.ferry_conn_subscribe.restype = None
    lib.ferry_conn_close.argtypes = [C.c_void_p]
    lib.ferry_conn_close.restype = None
    lib.ferry_on_control.argtypes = [C.c_void_p, C.c_char_p, C.c_size_t]
    lib.ferry_pump.argtypes = [C.c_void_p, C.c_uint]
    return lib


def c_peripheral_class(base):
    """A SyncPeripheral whose protocol side is the C library (base: peripheral.SyncPeripheral)."""
    lib = load_library()

    class CSession:
        """The C connection of one bumble connection, with its transport callbacks kept alive."""

        def __init__(self, owner, connection):
            self.buf = C.create_string_buffer(lib.ferry_ffi_sizeof_conn())
            self.queue: list[bytes] = []
            self.connection = connection
            self.open = True

            def notify(_ctx, data, length):
                self.queue.append(C.string_at(data, length))
                return OK

            self.cbs = (NOTIFY(notify), MTU(lambda _ctx: connection.att_mtu),
                        CAN_SEND(lambda _ctx: 0 if self.queue else 1))
            transport = Transport(None, *self.cbs)
            lib.ferry_conn_open(self.buf, owner.cbuf, C.byref(transport))

        def close(self):
            if self.open:
                lib.ferry_conn_close(self.buf)
                self.open = False

    class CSyncPeripheral(base):
        def __init__(self, index, args, faults, store_dir, pairing):
            if faults:
                raise SystemExit("--engine c: no --fault (use the control FIFO: disconnect, restart, add, wipe)")
            events = args.events
            args_copy = type(args)(**vars(args))
            args_copy.events = 0  # the initial events are appended through the C library below
            super().__init__(index, args_copy, faults, store_dir, pairing)
            self.args = args
            self.initial_events = events
            self.cbuf = C.create_string_buffer(lib.ferry_ffi_sizeof_peripheral())
            self.csessions: dict[int, CSession] = {}
            self.c_prev: dict[str, int] = {}

            def append(_ctx, seq, data, length):
                # Event bytes are event_payload(seq): the record is only checked, the counter is the state.
                if seq != self.store.head + 1 and not (self.store.deleted_through < seq <= self.store.head + 1):
                    log.warning("%s C append of seq %d with head %d", self.address, seq, self.store.head)
                    return ERR_STORAGE
                return OK if C.string_at(data, length) == self.store.payload(seq) else ERR_STORAGE

            def read(_ctx, seq, buf, cap):
                if not self.store.retained(seq):
                    return ERR_NOT_FOUND
                payload = self.store.payload(seq)
                if len(payload) > cap:
                    return ERR_STORAGE
                C.memmove(buf, payload, len(payload))
                return len(payload)

            def persist(_ctx, meta):
                m = meta.contents
                if m.epoch != self.store.epoch:
                    self.store.generation = 0  # a wipe: a new stream
                self.store.epoch, self.store.head, self.store.deleted_through = m.epoch, m.head, m.deleted_through
                try:
                    self.store.save()
                except OSError as e:
                    log.warning("%s persist failed: %r", self.address, e)
                    return ERR_STORAGE
                return OK

            def random(_ctx, out):
                C.memmove(out, os.urandom(8), 8)
                return OK

            self.ccbs = (APPEND(append), READ(read), DELETE(lambda _ctx, _seq: OK), PERSIST(persist),
                         RANDOM(random))
            self.cstorage = Storage(None, *self.ccbs[:4])
            self.c_init()
            if self.store.head == 0 and events:
                self.c_append(events)

        # ------------------------------------------------------------- the C library

        def c_init(self) -> None:
            """ferry_init from what the store persisted, as a rebooted device would."""
            meta = Meta(self.store.epoch, self.store.head, self.store.deleted_through)
            rc = lib.ferry_init(self.cbuf, C.byref(self.cstorage), self.ccbs[4], None, C.byref(meta))
            if rc != OK:
                raise SystemExit(f"ferry_init failed: {rc}")

        def c_append(self, n: int) -> None:
            for _ in range(n):
                seq = self.store.head + 1
                payload = self.store.payload(seq)
                out = C.c_uint64(0)
                rc = lib.ferry_append(self.cbuf, payload, len(payload), C.byref(out))
                if rc != OK or out.value != seq:
                    log.warning("%s ferry_append: %d (seq %d)", self.address, rc, out.value)
                    break
            self.stats["events_generated"] = self.store.head
            self.c_stats()
            self.wake.set()

        def c_stats(self) -> dict:
            arr = (C.c_uint64 * len(STATS))()
            n = lib.ferry_ffi_stats(self.cbuf, arr, len(STATS))
            # Counters since this process started: a restart re-creates the library's state.
            raw = {STATS[i]: int(arr[i]) + self.c_prev.get(STATS[i], 0) for i in range(n)}
            raw["highest_ack"] = max(int(arr[STATS.index("highest_ack")]), self.c_prev.get("highest_ack", 0))
            self.stats["c_library"] = raw
            self.stats["sync_reqs_received"] = raw["sync_reqs"]
            self.stats["acks_received"] = raw["acks"]
            self.stats["highest_ack"] = raw["highest_ack"]
            self.stats["deleted"] = raw["deleted"]
            self.stats["frames_sent"] = raw["frames_sent"]
            # What the emulator calls violations: anything the library refused or clamped.
            self.stats["violations"] = (raw["ack_beyond_sent"] + raw["req_beyond_head"]
                                        + sum(raw[f"control_{k.lower()}"] for k in KINDS[2:]))
            self.dirty = True
            return raw

        def stream_info_value(self) -> bytes:
            out = C.create_string_buffer(sp.STREAM_INFO_LEN)
            lib.ferry_stream_info(self.cbuf, out)
            return out.raw

        # ------------------------------------------------------------- link events into the library

        def on_connection(self, connection):
            super().on_connection(connection)
            cs = CSession(self, connection)
            self.csessions[connection.handle] = cs

            def closed(_reason):
                cs.close()
                if self.csessions.get(connection.handle) is cs:
                    del self.csessions[connection.handle]

            connection.on("disconnection", closed)

        def on_subscription(self, connection, notify_enabled, indicate_enabled):
            super().on_subscription(connection, notify_enabled, indicate_enabled)
            session = self.sessions.get(getattr(connection, "handle", None))
            cs = self.csessions.get(getattr(connection, "handle", None))
            if session is not None and cs is not None:
                lib.ferry_conn_subscribe(cs.buf, 1 if session.subscribed else 0)

        def on_control_write(self, connection, value: bytes):
            session = self.sessions.get(connection.handle)
            cs = self.csessions.get(connection.handle)
            if session is None or cs is None:
                return
            if not self.link_allowed(session):
                log.warning("%s CONTROL write on a clear link ignored", self.address)
                return
            value = bytes(value)
            kind = KINDS[lib.ferry_on_control(cs.buf, value, len(value))]
            before = self.stats.get("violations", 0)
            self.c_stats()
            if kind == "SYNC_REQ":
                session.requested = True
                log.info("%s SYNC_REQ %s (oldest %d head %d)", self.address, value.hex(), self.store.oldest,
                         self.store.head)
            elif kind != "SYNC_ACK" or self.stats["violations"] != before:
                self.violation("c_library", f"CONTROL write {value.hex()}: {kind}")
                self.stats["violations"] -= 1  # counted once, by the library
            self.wake.set()

        async def send_one(self, session) -> bool:
            cs = self.csessions.get(session.connection.handle)
            if cs is None:
                return False
            if not cs.queue:
                rc = lib.ferry_pump(cs.buf, 1)
                if rc < 0:
                    log.info("%s ferry_pump: %d", self.address, rc)
            if not cs.queue:
                return False
            chunk = cs.queue[0]
            try:
                await self.device.notify_subscriber(session.connection, self.data_char, chunk)
            except Exception as e:
                log.info("%s notify failed: %r", self.address, e)
                return False
            cs.queue.pop(0)
            self.stats["notifications_sent"] += 1
            self.stats["bytes_sent"] += len(chunk)
            self.c_stats()
            return True

        # ------------------------------------------------------------- store changes through the library

        async def live_events(self) -> None:
            import asyncio
            tick = max(1.0 / self.args.rate, 0.02)
            owed = 0.0
            while True:
                await asyncio.sleep(tick)
                owed += self.args.rate * tick
                n = int(owed)
                if n:
                    owed -= n
                    self.c_append(n)

        async def control(self, words: list[str]) -> None:
            if words[0] == "add":
                self.c_append(int(words[1]) if len(words) > 1 else 1)
                return
            if words[0] == "regress":
                log.warning("%s --engine c: no regress (a device cannot do that to its own counter)",
                            self.address)
                return
            await super().control(words)

        def do_epoch_reset(self) -> None:
            """Store wiped: the library draws the new epoch (random callback) and restarts seq at 1."""
            self.store.head = self.store.deleted_through = 0
            rc = lib.ferry_wipe(self.cbuf)
            if rc != OK:
                log.warning("%s ferry_wipe: %d", self.address, rc)
            self.c_append(self.initial_events)
            log.info("%s wiped: new epoch %d head %d", self.address, self.store.epoch, self.store.head)

        def do_restart(self) -> None:
            for cs in self.csessions.values():
                cs.close()
            self.csessions.clear()
            super().do_restart()
            self.c_prev = self.c_stats()
            self.cbuf = C.create_string_buffer(lib.ferry_ffi_sizeof_peripheral())
            self.c_init()
            log.info("%s C library restarted from the persisted meta (epoch %d head %d deleted_through %d)",
                     self.address, self.store.epoch, self.store.head, self.store.deleted_through)

    return CSyncPeripheral
