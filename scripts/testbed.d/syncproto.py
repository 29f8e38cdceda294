"""Sync protocol v1 (Hardware/TESTBED.md, PROTOCOL.md §1-3): frames, CRC, STREAM_INFO, event store.

Pure python, standard library only: the peripheral (bumble venv python) and the conformance
probe (Debian's /usr/bin/python3 with python3-dbus) both import it.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from dataclasses import dataclass

SYNC_SERVICE_UUID = "f3a70001-8a96-49d6-9124-d674293fa28b"
DATA_UUID = "f3a70002-8a96-49d6-9124-d674293fa28b"
CONTROL_UUID = "f3a70003-8a96-49d6-9124-d674293fa28b"
STREAM_INFO_UUID = "f3a70004-8a96-49d6-9124-d674293fa28b"

MAGIC = 0xA5
TYPE_SYNC_REQ = 0x01
TYPE_SYNC_ACK = 0x02
TYPE_DATA = 0x03
HEADER_LEN = 12
OVERHEAD = 14
STREAM_INFO_LEN = 26
DEFAULT_MAX_PAYLOAD = 4096


def crc16_ibm3740(data: bytes, crc: int = 0xFFFF) -> int:
    """CRC-16/IBM-3740 (CCITT-FALSE): poly 0x1021, init 0xFFFF, no reflection, xorout 0."""
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def encode_frame(frame_type: int, seq: int, payload: bytes = b"") -> bytes:
    if not 0 <= seq < 1 << 64:
        raise ValueError(f"seq out of range: {seq}")
    if len(payload) > 0xFFFF:
        raise ValueError("payload longer than 65535 bytes")
    head = struct.pack(">BBQH", MAGIC, frame_type, seq, len(payload)) + payload
    return head + struct.pack(">H", crc16_ibm3740(head))


def sync_req(last: int, window: int) -> bytes:
    return encode_frame(TYPE_SYNC_REQ, last, struct.pack(">H", window))


def sync_ack(seq: int) -> bytes:
    return encode_frame(TYPE_SYNC_ACK, seq)


def data_frame(seq: int, payload: bytes) -> bytes:
    return encode_frame(TYPE_DATA, seq, payload)


@dataclass(frozen=True)
class Frame:
    type: int
    seq: int
    payload: bytes


class FrameError(ValueError):
    """A single buffer that should hold exactly one frame does not."""


def decode_single(buf: bytes) -> Frame:
    """Decode a buffer that must hold exactly one frame (a CONTROL write). Raises FrameError."""
    if len(buf) < OVERHEAD:
        raise FrameError(f"short write: {len(buf)} bytes < {OVERHEAD}")
    if buf[0] != MAGIC:
        raise FrameError(f"bad magic 0x{buf[0]:02x}")
    frame_type, seq, length = struct.unpack(">BQH", buf[1:HEADER_LEN])
    if len(buf) != OVERHEAD + length:
        raise FrameError(f"length field {length} does not match write of {len(buf)} bytes")
    (crc,) = struct.unpack(">H", buf[HEADER_LEN + length:])
    if crc != crc16_ibm3740(buf[: HEADER_LEN + length]):
        raise FrameError("CRC mismatch")
    return Frame(frame_type, seq, bytes(buf[HEADER_LEN: HEADER_LEN + length]))


class StreamDecoder:
    """Byte-stream decoder of PROTOCOL.md §2 with one-byte resync. Used by the probe to check DATA."""

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD):
        self.max_payload = max_payload
        self.buf = bytearray()
        self.resync_bytes = 0
        self.crc_errors = 0
        self.oversize = 0
        self.stalls = 0

    def feed(self, chunk: bytes) -> list[Frame]:
        self.buf += chunk
        out: list[Frame] = []
        while True:
            start = self.buf.find(MAGIC)
            if start < 0:
                self.resync_bytes += len(self.buf)
                self.buf.clear()
                return out
            if start:
                self.resync_bytes += start
                del self.buf[:start]
            if len(self.buf) < HEADER_LEN:
                return out
            frame_type, seq, length = struct.unpack(">BQH", self.buf[1:HEADER_LEN])
            if length > self.max_payload:
                self.oversize += 1
                self._drop_one()
                continue
            if len(self.buf) < OVERHEAD + length:
                return out
            body = bytes(self.buf[: HEADER_LEN + length])
            (crc,) = struct.unpack(">H", self.buf[HEADER_LEN + length: OVERHEAD + length])
            if crc != crc16_ibm3740(body):
                self.crc_errors += 1
                self._drop_one()
                continue
            out.append(Frame(frame_type, seq, body[HEADER_LEN:]))
            del self.buf[: OVERHEAD + length]

    def on_idle(self) -> list[Frame]:
        """Stall rule: a partial frame still buffered when the stream goes idle is corrupt.

        Its length field may be the flipped bit, so drop ONE byte and rescan what is buffered.
        """
        out: list[Frame] = []
        while self.buf:
            self.stalls += 1
            self._drop_one()
            out += self.feed(b"")
        return out

    def _drop_one(self) -> None:
        self.resync_bytes += 1
        del self.buf[0]


def encode_stream_info(epoch: int, oldest: int, head: int) -> bytes:
    return struct.pack(">BBQQQ", 1, 0, epoch, oldest, head)


def decode_stream_info(value: bytes) -> tuple[int, int, int, int, int]:
    """Returns (version, flags, epoch, oldest, head)."""
    if len(value) != STREAM_INFO_LEN:
        raise FrameError(f"STREAM_INFO is {len(value)} bytes, expected {STREAM_INFO_LEN}")
    return struct.unpack(">BBQQQ", value)


def event_payload(epoch: int, generation: int, seq: int, size: int) -> bytes:
    """Deterministic event bytes: a test can recompute what seq N of a stream must carry.

    Layout (big-endian): b"EV" | epoch low 32 bits | generation u16 | seq u64 | filler to size.
    The generation changes on a counter regression so re-used seqs carry different bytes.
    """
    core = b"EV" + struct.pack(">IHQ", epoch & 0xFFFFFFFF, generation & 0xFFFF, seq)
    if size <= len(core):
        return core[:size]
    filler = bytes((seq + i) & 0xFF for i in range(size - len(core)))
    return core + filler


class EventStore:
    """The peripheral's persistent event log, one JSON file per peripheral.

    Events are a contiguous range [first_retained, head]; their bytes are event_payload(),
    so only the range, epoch and generation need persisting. Every change is written with
    write-to-temp + fsync + rename, so a killed peripheral restarts with what it had.
    """

    def __init__(self, path: str, payload_bytes: int = 20):
        self.path = path
        self.payload_bytes = payload_bytes
        self.epoch = 0
        self.generation = 0
        self.head = 0
        self.deleted_through = 0  # every seq <= this is deleted
        if os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self.epoch = int(state["epoch"])
            self.generation = int(state["generation"])
            self.head = int(state["head"])
            self.deleted_through = int(state["deleted_through"])
            self.payload_bytes = int(state.get("payload_bytes", payload_bytes))
        else:
            self.wipe()

    @property
    def oldest(self) -> int:
        """Oldest retained seq, 0 if none (PROTOCOL.md §3)."""
        return self.deleted_through + 1 if self.deleted_through < self.head else 0

    def retained(self, seq: int) -> bool:
        return self.deleted_through < seq <= self.head

    def payload(self, seq: int) -> bytes:
        return event_payload(self.epoch, self.generation, seq, self.payload_bytes)

    def append(self, count: int = 1) -> None:
        self.head += count
        self.save()

    def delete_through(self, seq: int) -> int:
        """Deletes events <= seq; returns how many were deleted."""
        new = min(max(seq, self.deleted_through), self.head)
        deleted = new - self.deleted_through
        if deleted:
            self.deleted_through = new
            self.save()
        return deleted

    def wipe(self) -> None:
        """Storage wiped: a fresh epoch, seq restarts at 1."""
        self.epoch = secrets.randbits(64) or 1
        self.generation = 0
        self.head = 0
        self.deleted_through = 0
        self.save()

    def regress(self, new_head: int) -> None:
        """Counter regression (e.g. storage restored from an old snapshot): same epoch, head goes back."""
        self.head = new_head
        self.deleted_through = min(self.deleted_through, new_head)
        self.generation += 1
        self.save()

    def stream_info(self) -> bytes:
        return encode_stream_info(self.epoch, self.oldest, self.head)

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"epoch": self.epoch, "generation": self.generation, "head": self.head,
                       "deleted_through": self.deleted_through, "payload_bytes": self.payload_bytes}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
