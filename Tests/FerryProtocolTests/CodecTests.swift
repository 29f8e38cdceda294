import Testing
@testable import FerryProtocol

/// PROTOCOL.md §2, copied byte for byte: the promise made to firmware and backend authors.
let specVectors: [(meaning: String, frame: Frame, hex: String)] = [
    ("SYNC_REQ last=0 window=20", .syncRequest(lastCommitted: 0, window: 20), "a5010000000000000000000200149ca9"),
    ("SYNC_REQ last=41 window=20", .syncRequest(lastCommitted: 41, window: 20), "a5010000000000000029000200143c61"),
    ("DATA seq=1 payload hello", .data(seq: 1, payload: Array("hello".utf8)), "a5030000000000000001000568656c6c6f7771"),
    ("DATA seq=0x0102030405060708 empty", .data(seq: 0x0102_0304_0506_0708, payload: []), "a50301020304050607080000e03a"),
    ("SYNC_ACK seq=20", .syncAck(committed: 20), "a502000000000000001400007149"),
]

@Suite struct CRC16Tests {
    @Test func checkValueOf123456789() {
        #expect(CRC16.checksum(Array("123456789".utf8)) == 0x29B1)
    }

    @Test func emptyInputIsTheInitialValue() {
        #expect(CRC16.checksum([UInt8]()) == 0xFFFF)
    }

    @Test func updateInPiecesEqualsWholeChecksum() {
        var rng = SeededRNG(seed: 1)
        for _ in 0..<200 {
            let bytes = rng.bytes(Int.random(in: 0...300, using: &rng))
            let split = Int.random(in: 0...bytes.count, using: &rng)
            let whole = CRC16.checksum(bytes)
            let first = bytes[..<split].withUnsafeBytes { CRC16.update(CRC16.initial, $0) }
            let both = bytes[split...].withUnsafeBytes { CRC16.update(first, $0) }
            #expect(both == whole)
        }
    }

    /// Bit-at-a-time reference, independent of the table, over random inputs.
    @Test func tableMatchesBitwiseReference() {
        func reference(_ bytes: [UInt8]) -> UInt16 {
            var crc: UInt16 = 0xFFFF
            for b in bytes {
                crc ^= UInt16(b) << 8
                for _ in 0..<8 { crc = crc & 0x8000 != 0 ? (crc << 1) ^ 0x1021 : crc << 1 }
            }
            return crc
        }
        var rng = SeededRNG(seed: 2)
        for _ in 0..<300 {
            let bytes = rng.bytes(Int.random(in: 0...64, using: &rng))
            #expect(CRC16.checksum(bytes) == reference(bytes), "\(hexString(bytes))")
        }
    }

    /// Slices keep their parent's indices and lazy collections have no contiguous storage: both must work.
    @Test func slicesAndNonContiguousCollections() {
        let bytes = Array("xx123456789yy".utf8)
        #expect(CRC16.checksum(bytes[2..<11]) == 0x29B1)
        #expect(CRC16.checksum(bytes[2..<11].lazy.map { $0 }) == 0x29B1)
    }
}

@Suite struct FrameCodecTests {
    @Test(arguments: 0..<specVectors.count) func specVectorEncodes(index: Int) {
        let v = specVectors[index]
        #expect(hexString(v.frame.encoded()) == v.hex, "\(v.meaning)")
    }

    @Test(arguments: 0..<specVectors.count) func specVectorDecodes(index: Int) {
        let v = specVectors[index]
        let run = decode([hexBytes(v.hex)])
        #expect(run.frames == [v.frame], "\(v.meaning)")
        #expect(run.buffered == 0)
        #expect(run.statistics.discardedBytes == 0)
    }

    @Test func allVectorsAsOneStreamByteByByte() {
        let stream = specVectors.flatMap { hexBytes($0.hex) }
        let run = decode(stream.map { [$0] })
        #expect(run.frames == specVectors.map(\.frame))
        #expect(run.statistics.frames == specVectors.count)
    }

    @Test func overheadIsFourteen() {
        #expect(Frame.overhead == 14)
        #expect(Frame.data(seq: 9, payload: []).encoded().count == 14)
        #expect(Frame.data(seq: 9, payload: [1, 2, 3]).encoded().count == 17)
    }

    @Test func syncRequestWindowRoundTrips() {
        #expect(Frame.syncRequest(lastCommitted: 5, window: 300).requestedWindow == 300)
        #expect(Frame.syncRequest(lastCommitted: 5).requestedWindow == 2000, "pipelined: 100 times the ACK cadence")
        #expect(Int(Frame.defaultWindow) == 100 * Frame.defaultAckEvery)
        #expect(Frame.syncAck(committed: 5).requestedWindow == nil)
        #expect(Frame(type: .syncRequest, seq: 1, payload: [1]).requestedWindow == nil)
        #expect(Frame.syncAck(committed: 7).payload.isEmpty)
    }

    @Test func encodeDecodeRoundTripsRandomFrames() {
        var rng = SeededRNG(seed: 3)
        for _ in 0..<500 {
            let frame = randomFrame(using: &rng, maxPayload: 300, types: [.data, .syncAck, .syncRequest])
            let bytes = frame.encoded()
            #expect(bytes.count == Frame.overhead + frame.payload.count)
            #expect(bytes[0] == 0xA5)
            #expect(decode([bytes]).frames == [frame])
        }
    }

    @Test func payloadAtTheCapDecodesAndOneMoreIsNoise() {
        let atCap = Frame.data(seq: 77, payload: [UInt8](repeating: 0x5A, count: 4096))
        #expect(decode([atCap.encoded()]).frames == [atCap])
        let over = Frame.data(seq: 78, payload: [UInt8](repeating: 0x5A, count: 4097))
        let run = decode([over.encoded()])
        #expect(run.frames.isEmpty)
        #expect(run.statistics.oversizeLengths == 1)
        #expect(run.buffered == 0)
    }

    @Test func sequenceVerdictAtTheEdges() {
        #expect(SequenceVerdict.classify(seq: 0, cursor: 0) == .duplicate)
        #expect(SequenceVerdict.classify(seq: 1, cursor: 0) == .next)
        #expect(SequenceVerdict.classify(seq: 5, cursor: 5) == .duplicate)
        #expect(SequenceVerdict.classify(seq: 4, cursor: 5) == .duplicate)
        #expect(SequenceVerdict.classify(seq: 9, cursor: 5) == .gap(first: 6, last: 8))
        #expect(SequenceVerdict.classify(seq: .max, cursor: .max - 1) == .next)
        #expect(SequenceVerdict.classify(seq: .max, cursor: .max) == .duplicate)
        #expect(SequenceVerdict.classify(seq: .max, cursor: 0) == .gap(first: 1, last: .max - 1))
    }
}

@Suite struct StreamInfoTests {
    let sample = StreamInfo(epoch: 0x1122_3344_5566_7788, oldest: 5, head: 0x0100)

    @Test func encodesTheDocumentedLayout() {
        #expect(
            hexString(sample.encoded())
                == "0100" + "1122334455667788" + "0000000000000005" + "0000000000000100")
        #expect(sample.encoded().count == StreamInfo.encodedLength)
    }

    @Test func roundTrips() throws {
        var rng = SeededRNG(seed: 4)
        for _ in 0..<200 {
            let a = rng.next(), b = rng.next()
            let info = StreamInfo(epoch: rng.next(), oldest: min(a, b), head: max(a, b))
            #expect(try StreamInfo(bytes: info.encoded()) == info)
        }
        #expect(try StreamInfo(bytes: StreamInfo(epoch: 0, oldest: 0, head: 0).encoded()) == StreamInfo(epoch: 0, oldest: 0, head: 0))
    }

    @Test func rejectsShortInput() {
        for n in [0, 1, 25] {
            #expect(throws: StreamInfo.ParseError.tooShort(n)) { try StreamInfo(bytes: Array(sample.encoded().prefix(n))) }
        }
    }

    @Test func rejectsOtherVersions() {
        for version: UInt8 in [0, 2, 0xFF] {
            var bytes = sample.encoded()
            bytes[0] = version
            #expect(throws: StreamInfo.ParseError.unsupportedVersion(version)) { try StreamInfo(bytes: bytes) }
        }
    }

    @Test func rejectsOldestAfterHead() {
        let bytes = StreamInfo(epoch: 1, oldest: 10, head: 9).encoded()
        #expect(throws: StreamInfo.ParseError.oldestAfterHead(oldest: 10, head: 9)) { try StreamInfo(bytes: bytes) }
    }

    @Test func ignoresFlagsAndTrailingBytes() throws {
        var bytes = sample.encoded()
        bytes[1] = 0xFF
        bytes += [1, 2, 3]
        #expect(try StreamInfo(bytes: bytes) == sample)
    }

    @Test func errorsDescribeThemselves() {
        #expect(StreamInfo.ParseError.tooShort(3).description.contains("3 bytes"))
        #expect(StreamInfo.ParseError.unsupportedVersion(2).description.contains("version 2"))
    }
}

@Suite struct PeripheralAddressTests {
    @Test(arguments: ["C0:FF:EE:00:00:01", "c0:ff:ee:00:00:01", "00:00:00:00:00:00", "Ab:cD:eF:12:34:56"])
    func acceptsAndUppercases(text: String) throws {
        let address = try #require(PeripheralAddress(text))
        #expect(address.string == text.uppercased())
        #expect(address.description == text.uppercased())
    }

    @Test(arguments: [
        "", "C0:FF:EE:00:00", "C0:FF:EE:00:00:01:02", "C0:FF:EE:00:00:0G", "C0:FF:EE:00:00:001",
        "C0:FF:EE:00:00:1", "C0:FF:EE:00::01", "C0:FF:EE:00:00:01:", " C0:FF:EE:00:00:01", "C0-FF-EE-00-00-01",
        "C0FFEE000001", "C0:FF:EE:00:00:０1", "C0:FF:EE:00:00:é",
        // 17 bytes with a separator out of place, a wrong one, a trailing newline, bytes next to the hex ranges.
        "C0:FF:EE:00:0:001", "C0:FF:EE:00:00;01", "C0:FF:EE:00:0001\n", "g0:ff:ee:00:00:01", "C0:FF:EE:00:00:`1",
        "C0:FF:EE:00:00:@1", "C0:FF:EE:00:00:/1", "C0:FF:EE:00:00::1",
    ])
    func rejects(text: String) {
        #expect(PeripheralAddress(text) == nil)
    }

    @Test func equalityIgnoresInputCase() {
        #expect(PeripheralAddress("aa:bb:cc:dd:ee:ff") == PeripheralAddress("AA:BB:CC:DD:EE:FF"))
        #expect(PeripheralAddress("AA:00:00:00:00:00")! < PeripheralAddress("BB:00:00:00:00:00")!)
    }
}
