"""Unit tests of the test bed's python frame codec against PROTOCOL.md §2's test vectors.

Run: scripts/testbed unit   (or: python3 -m unittest discover -s scripts/testbed.d -p 'test_*.py')
"""

import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import syncproto as sp  # noqa: E402

# Copied from PROTOCOL.md §2 (the bed must not read the spec at run time).
VECTORS = [
    ("SYNC_REQ last=0 window=20", sp.sync_req(0, 20), "a5010000000000000000000200149ca9"),
    ("SYNC_REQ last=41 window=20", sp.sync_req(41, 20), "a5010000000000000029000200143c61"),
    ("DATA seq=1 hello", sp.data_frame(1, b"hello"), "a5030000000000000001000568656c6c6f7771"),
    ("DATA seq=0x0102030405060708 empty", sp.data_frame(0x0102030405060708, b""), "a50301020304050607080000e03a"),
    ("SYNC_ACK seq=20", sp.sync_ack(20), "a502000000000000001400007149"),
]


class CrcTests(unittest.TestCase):
    def test_check_value(self):
        self.assertEqual(sp.crc16_ibm3740(b"123456789"), 0x29B1)

    def test_empty_is_init(self):
        self.assertEqual(sp.crc16_ibm3740(b""), 0xFFFF)


class FrameVectorTests(unittest.TestCase):
    def test_encoder_matches_spec_vectors(self):
        for name, encoded, expected in VECTORS:
            with self.subTest(name):
                self.assertEqual(encoded.hex(), expected)

    def test_decode_single_round_trips_vectors(self):
        f = sp.decode_single(bytes.fromhex("a5010000000000000029000200143c61"))
        self.assertEqual((f.type, f.seq, f.payload), (sp.TYPE_SYNC_REQ, 41, b"\x00\x14"))

    def test_decode_single_rejects_bad_crc_magic_length(self):
        good = bytearray.fromhex("a502000000000000001400007149")
        for mutate in (lambda b: b.__setitem__(13, b[13] ^ 1),  # CRC
                       lambda b: b.__setitem__(0, 0xA4),        # magic
                       lambda b: b.__setitem__(11, 1),          # length vs write size
                       lambda b: b.__setitem__(5, b[5] ^ 0x10)):  # seq bit flip: CRC covers header
            bad = bytearray(good)
            mutate(bad)
            with self.assertRaises(sp.FrameError):
                sp.decode_single(bytes(bad))
        with self.assertRaises(sp.FrameError):
            sp.decode_single(bytes(good) + b"\x00")  # trailing byte: one frame per write


class StreamDecoderTests(unittest.TestCase):
    def frames(self, n):
        return [sp.data_frame(i, sp.event_payload(7, 0, i, 20)) for i in range(1, n + 1)]

    def test_split_across_chunks_byte_by_byte(self):
        d = sp.StreamDecoder()
        got = []
        for b in b"".join(self.frames(5)):
            got += d.feed(bytes([b]))
        self.assertEqual([f.seq for f in got], [1, 2, 3, 4, 5])

    def test_resync_after_garbage_and_corruption(self):
        fs = self.frames(4)
        corrupt = bytearray(fs[1])
        corrupt[15] ^= 0xFF
        # Garbage with a fake magic, an oversize header, a corrupt frame: only intact frames come out.
        oversize = bytes([sp.MAGIC, sp.TYPE_DATA]) + (9).to_bytes(8, "big") + b"\xff\xff"
        stream = b"\x00\xa5\x01" + fs[0] + oversize + bytes(corrupt) + fs[2] + fs[3]
        d = sp.StreamDecoder()
        got = d.feed(stream)
        self.assertEqual([f.seq for f in got], [1, 3, 4])
        self.assertGreaterEqual(d.crc_errors, 1)
        self.assertGreaterEqual(d.oversize, 1)

    def test_frame_starting_inside_garbage_is_found(self):
        d = sp.StreamDecoder()
        # The first 0xA5 announces a 9-byte payload that never comes: a stall, not a frame.
        got = d.feed(b"\xa5\xa5" + sp.data_frame(9, b"x"))
        self.assertEqual(got, [])
        got = d.on_idle()
        self.assertEqual([f.seq for f in got], [9])
        self.assertEqual(d.buf, bytearray())


class StreamInfoAndStoreTests(unittest.TestCase):
    def test_stream_info_layout(self):
        v = sp.encode_stream_info(0x1122334455667788, 5, 9)
        self.assertEqual(len(v), 26)
        self.assertEqual(v.hex(), "0100" + "1122334455667788" + "0000000000000005" + "0000000000000009")
        self.assertEqual(sp.decode_stream_info(v), (1, 0, 0x1122334455667788, 5, 9))

    def test_store_persists_and_deletes(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "p.json")
            s = sp.EventStore(path, payload_bytes=24)
            epoch = s.epoch
            self.assertNotEqual(epoch, 0)
            self.assertEqual((s.oldest, s.head), (0, 0))
            s.append(10)
            self.assertEqual((s.oldest, s.head), (1, 10))
            self.assertEqual(s.delete_through(4), 4)
            self.assertEqual(s.delete_through(2), 0)  # ACK below what is deleted deletes nothing
            s2 = sp.EventStore(path)  # "restart"
            self.assertEqual((s2.epoch, s2.oldest, s2.head, s2.payload_bytes), (epoch, 5, 10, 24))
            self.assertEqual(s2.payload(7), s.payload(7))
            self.assertEqual(len(s2.payload(7)), 24)
            s2.delete_through(99)
            self.assertEqual((s2.oldest, s2.head), (0, 10))  # nothing retained -> oldest 0
            s2.regress(3)
            self.assertEqual((s2.epoch, s2.head), (epoch, 3))
            self.assertNotEqual(s2.payload(2), s.payload(2))  # a new generation of bytes
            s2.wipe()
            self.assertNotEqual(s2.epoch, epoch)
            self.assertEqual((s2.oldest, s2.head), (0, 0))


if __name__ == "__main__":
    unittest.main()
