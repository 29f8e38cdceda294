import FerryCLI
import FerryStore
import Foundation
import Testing

/// `ferry ingest` in-process: what it prints, and what it leaves in the store (queried by the contract's
/// table names, the way an operator would).
@Suite struct IngestCommandTests {
    @Test func wireHelperMatchesTheSpecVector() {
        // PROTOCOL §2: DATA seq=1 payload "hello".
        let expected: [UInt8] = [
            0xA5, 0x03, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x00, 0x05, 0x68, 0x65, 0x6C, 0x6C, 0x6F, 0x77, 0x71,
        ]
        #expect(Wire.frame(seq: 1, payload: Array("hello".utf8)) == expected)
        #expect(Wire.crc(Array("123456789".utf8)) == 0x29B1)
    }

    @Test func jsonIsExactlyTheDocumentedObjectAndFramesCommitIn20FrameWindows() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...45), to: "clean.bin")
        let db = dir.file("ferry.sqlite")
        let result = ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", capture)
        #expect(result.status == 0)
        #expect(result.stderr.isEmpty)
        #expect(result.stdout == [#"{"frames":45,"stored":45,"duplicates":0,"gaps":0,"corrupt":0,"cursor":"45"}"#])
        let json = try result.json()
        #expect(Set(json.keys) == ["frames", "stored", "duplicates", "gaps", "corrupt", "cursor"])
        #expect(json["cursor"] is String)

        let store = try StoreProbe(db)
        #expect(try store.seqs() == Array(1...45))
        #expect(try store.payloads() == (1...45).map { Wire.payload(for: $0) })
        #expect(try store.frameCountsOfFramesEvents() == [20, 20, 5])
        #expect(try store.cursor() == 45)
    }

    /// Noise (with stray 0xA5 bytes), a bit flip, repeats, a lost range, non-DATA frames of every kind and a
    /// partial frame at the end, all in one capture.
    @Test func messyCaptureStoresEveryIntactFrameOnceAndRecordsTheGaps() throws {
        let dir = try TemporaryDirectory()
        var bytes: [UInt8] = []
        let noise: [UInt8] = [0x00, 0xA5, 0x03, 0x00, 0x11, 0xA5, 0xFF, 0x42]
        for seq in UInt64(1)...100 {
            if seq == 5 || seq == 20 || seq == 80 { bytes += noise }  // 3 damaged places
            if (61...70).contains(seq) { continue }  // lost before we got them
            var frame = Wire.dataFrame(seq)
            if seq == 30 { frame[14] ^= 0x10 }  // a flipped payload bit: CRC mismatch, frame 30 is lost too
            bytes += frame
            if seq == 10 || seq == 50 { bytes += frame }  // repeated
            if seq == 40 { bytes += Wire.frame(type: Wire.syncAck, seq: 40, payload: []) }
            if seq == 41 { bytes += Wire.frame(type: Wire.syncRequest, seq: 0, payload: [0, 20]) }
            if seq == 42 { bytes += Wire.frame(type: 0x7F, seq: 99, payload: [1, 2, 3]) }  // unknown type
        }
        bytes += Array(Wire.dataFrame(101).prefix(9))  // the dump ends inside a frame
        let capture = try dir.write(bytes, to: "messy.bin")
        let db = dir.file("ferry.sqlite")

        let result = ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", capture)
        #expect(result.status == 0)
        let json = try result.json()
        #expect(json["frames"] as? Int == 91)  // 100 - 10 lost - 1 flipped + 2 repeats; non-DATA not counted
        #expect(json["stored"] as? Int == 89)
        #expect(json["duplicates"] as? Int == 2)
        #expect(json["gaps"] as? Int == 2)
        #expect(json["corrupt"] as? Int == 5)  // 3 noise runs + the flipped frame + the trailing partial frame
        #expect(json["cursor"] as? String == "100")
        #expect(result.stderr.count == 1)
        #expect(result.stderr.first?.contains("9 bytes of an incomplete frame") == true)

        let store = try StoreProbe(db)
        let expected = (UInt64(1)...100).filter { $0 != 30 && !(61...70).contains($0) }
        #expect(try store.seqs() == expected)
        #expect(try store.payloads() == expected.map { Wire.payload(for: $0) })
        #expect(try store.gaps() == [30...30, 61...70])
        // Each GAP event sits in front of the FRAMES event that continues after it.
        let types = try store.outboxTypes()
        #expect(types.filter { $0 == "GAP" }.count == 2)
        #expect(types.first == "FRAMES")
        for (index, type) in types.enumerated() where type == "GAP" {
            #expect(index + 1 < types.count && types[index + 1] == "FRAMES")
        }
        #expect(try store.sumOfFrameCounts() == 89)
        #expect(try store.count("SELECT count(*) FROM staged_frames WHERE seq = 101") == 0)
    }

    /// A flipped bit in a length field near the end makes the frame look longer than the rest of the dump: the
    /// frames behind it must still be recovered when the dump ends (PROTOCOL §2, "Stall").
    @Test func framesSwallowedByACorruptLengthNearTheEndAreRecovered() throws {
        let dir = try TemporaryDirectory()
        var damaged = Wire.dataFrame(8)
        damaged[10] = 0x01  // length 8 -> 264: waits for bytes that never come
        let capture = try dir.write(Wire.capture(1...7) + damaged + Wire.capture(9...10), to: "stall.bin")
        let db = dir.file("ferry.sqlite")
        let result = ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", capture)
        #expect(result.status == 0)
        let json = try result.json()
        #expect(json["stored"] as? Int == 9)
        #expect(json["gaps"] as? Int == 1)
        #expect(json["cursor"] as? String == "10")
        #expect(try StoreProbe(db).seqs() == Array(1...7) + [9, 10])
        #expect(try StoreProbe(db).gaps() == [8...8])
        #expect(result.stderr.count == 1)
        #expect(result.stderr.first?.contains("\(damaged.count) bytes of an incomplete frame") == true)
    }

    @Test func textOutputReportsSkippedNonDataFrames() throws {
        let dir = try TemporaryDirectory()
        let bytes =
            Wire.capture(1...3) + Wire.frame(type: Wire.syncAck, seq: 3, payload: [])
            + Wire.frame(type: 0x44, seq: 1, payload: []) + Wire.capture(4...5)
        let capture = try dir.write(bytes, to: "mixed.bin")
        let result = ferry("ingest", "--db", dir.file("ferry.sqlite"), "--peripheral", "c0:ff:ee:00:00:01", capture)
        #expect(result.status == 0)
        #expect(result.stdout.count == 2)
        #expect(result.stdout.first?.contains("5 frames, 5 stored, 0 duplicates, 0 gaps, 0 corrupt, cursor 5") == true)
        #expect(result.stdout.first?.contains("for C0:FF:EE:00:00:01 epoch 0") == true)  // address normalised
        #expect(result.stdout.last == "skipped 2 non-DATA frames")
    }

    @Test func secondIngestOfTheSameCaptureStoresNothing() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...30) + Wire.capture(36...50), to: "twice.bin")
        let db = dir.file("ferry.sqlite")
        let first = try ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", capture).json()
        #expect(first["stored"] as? Int == 45)
        #expect(first["gaps"] as? Int == 1)
        let eventsAfterFirst = try StoreProbe(db).outboxTypes()

        let second = ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", capture)
        #expect(second.status == 0)
        let json = try second.json()
        #expect(json["frames"] as? Int == 45)
        #expect(json["stored"] as? Int == 0)
        #expect(json["duplicates"] as? Int == 45)
        #expect(json["gaps"] as? Int == 0)
        #expect(json["cursor"] as? String == "50")
        let store = try StoreProbe(db)
        #expect(try store.outboxTypes() == eventsAfterFirst)
        #expect(try store.count("SELECT count(*) FROM staged_frames") == 45)
    }

    @Test func aLongerCaptureContinuesFromTheStoredCursor() throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let short = try dir.write(Wire.capture(1...30), to: "short.bin")
        let long = try dir.write(Wire.capture(1...60), to: "long.bin")
        #expect(ferry("ingest", "--db", db, "--peripheral", peripheral, short).status == 0)
        let json = try ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", long).json()
        #expect(json["stored"] as? Int == 30)
        #expect(json["duplicates"] as? Int == 30)
        #expect(json["cursor"] as? String == "60")
        #expect(try StoreProbe(db).seqs() == Array(1...60))
    }

    @Test func epochSelectsTheStreamAndTakesTheFullUInt64Range() throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let capture = try dir.write(Wire.capture(1...10), to: "epoch.bin")
        let big = ferry("ingest", "--db", db, "--peripheral", peripheral, "--epoch", "18446744073709551615", "--json", capture)
        #expect(big.status == 0)
        #expect(try big.json()["stored"] as? Int == 10)
        // Same capture, another epoch (the peripheral's storage was wiped): a new stream, stored again.
        let other = try ferry("ingest", "--db", db, "--peripheral", peripheral, "--epoch=7", "--json", capture).json()
        #expect(other["stored"] as? Int == 10)
        let store = try StoreProbe(db)
        #expect(try store.streams() == ["18446744073709551615": 10, "7": 10])
        #expect(try store.count("SELECT count(*) FROM staged_frames WHERE epoch = '18446744073709551615'") == 10)

        #expect(ferry("ingest", "--db", db, "--peripheral", peripheral, "--epoch", "18446744073709551616", capture).status == 2)
        #expect(ferry("ingest", "--db", db, "--peripheral", peripheral, "--epoch", "-1", capture).status == 2)
    }

    /// The command reads in 64 KiB chunks: frames straddling the chunk boundaries must be reassembled.
    @Test func framesAcrossReadChunkBoundariesAreReassembled() throws {
        let dir = try TemporaryDirectory()
        let bytes = Wire.capture(1...200, payloadSize: 1001)  // 1015-byte frames: 3 chunk boundaries fall inside frames
        #expect(bytes.count > 3 * 65_536)
        let capture = try dir.write(bytes, to: "large.bin")
        let db = dir.file("ferry.sqlite")
        let json = try ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", capture).json()
        #expect(json["stored"] as? Int == 200)
        #expect(json["corrupt"] as? Int == 0)
        #expect(try StoreProbe(db).payloads() == (1...200).map { Wire.payload(for: $0, size: 1001) })
    }

    @Test func maxPayloadTurnsLargerFramesIntoNoise() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(
            Wire.capture(1...3, payloadSize: 10) + Wire.capture(4...4, payloadSize: 100) + Wire.capture(5...6, payloadSize: 10),
            to: "sizes.bin")
        let db = dir.file("ferry.sqlite")
        let json = try ferry("ingest", "--db", db, "--peripheral", peripheral, "--max-payload", "64", "--json", capture)
            .json()
        #expect(json["stored"] as? Int == 5)
        #expect(json["gaps"] as? Int == 1)  // seq 4 could not be taken: recorded as lost, never silently skipped
        #expect(json["corrupt"] as? Int == 1)
        #expect(try StoreProbe(db).gaps() == [4...4])
    }

    @Test func seqsAbove2To63GoThroughTheCommand() throws {
        let dir = try TemporaryDirectory()
        let top = UInt64.max
        let capture = try dir.write(Wire.capture([top - 2, top - 1, top]), to: "top.bin")
        let db = dir.file("ferry.sqlite")
        let json = try ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", capture).json()
        #expect(json["cursor"] as? String == "18446744073709551615")
        #expect(json["stored"] as? Int == 3)
        #expect(json["gaps"] as? Int == 1)
        let store = try StoreProbe(db)
        #expect(try store.seqs() == [top - 2, top - 1, top])
        #expect(try store.gaps() == [1...(top - 3)])
        let again = try ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", capture).json()
        #expect(again["duplicates"] as? Int == 3)
    }

    /// Seqs start at 1 (PROTOCOL §1): a DATA frame with seq 0 is at or below every cursor, so a duplicate.
    @Test func dataWithSeqZeroIsADuplicate() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture([0, 1, 2]), to: "zero.bin")
        let json = try ferry("ingest", "--db", dir.file("ferry.sqlite"), "--peripheral", peripheral, "--json", capture)
            .json()
        #expect(json["frames"] as? Int == 3)
        #expect(json["duplicates"] as? Int == 1)
        #expect(json["stored"] as? Int == 2)
    }

    @Test func emptyCaptureOpensTheStreamAndStoresNothing() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write([], to: "empty.bin")
        let result = ferry("ingest", "--db", dir.file("ferry.sqlite"), "--peripheral", peripheral, "--json", capture)
        #expect(result.status == 0)
        #expect(result.stdout == [#"{"frames":0,"stored":0,"duplicates":0,"gaps":0,"corrupt":0,"cursor":"0"}"#])
        #expect(result.stderr.isEmpty)
    }
}

/// Reads a store the way an operator would: plain SQL on the contract's names.
struct StoreProbe {
    let db: Database

    init(_ path: String) throws { db = try Database.open(path: path, readOnly: true) }

    func count(_ sql: String) throws -> Int64 { try db.integer(sql) ?? 0 }

    /// Seqs in unsigned order (they are stored as the UInt64 bit pattern).
    func seqs() throws -> [UInt64] {
        var seqs: [UInt64] = []
        try db.prepare("SELECT seq FROM staged_frames ORDER BY seq < 0, seq").forEach {
            seqs.append(UInt64(bitPattern: $0.int64(0)))
        }
        return seqs
    }

    func payloads() throws -> [[UInt8]] {
        var payloads: [[UInt8]] = []
        try db.prepare("SELECT payload FROM staged_frames ORDER BY seq < 0, seq").forEach { payloads.append($0.blob(0)) }
        return payloads
    }

    func cursor() throws -> UInt64? {
        try db.integer("SELECT cursor FROM stream_cursors").map { UInt64(bitPattern: $0) }
    }

    func outboxTypes() throws -> [String] {
        var types: [String] = []
        try db.prepare("SELECT event_type FROM outbox_events ORDER BY rowid").forEach { types.append($0.text(0)) }
        return types
    }

    func frameCountsOfFramesEvents() throws -> [Int64] {
        var counts: [Int64] = []
        try db.prepare("SELECT frame_count FROM outbox_events WHERE event_type = 'FRAMES' ORDER BY rowid").forEach {
            counts.append($0.int64(0))
        }
        return counts
    }

    func sumOfFrameCounts() throws -> Int64 {
        try count("SELECT coalesce(sum(frame_count), 0) FROM outbox_events WHERE event_type = 'FRAMES'")
    }

    func gaps() throws -> [ClosedRange<UInt64>] {
        var gaps: [ClosedRange<UInt64>] = []
        try db.prepare("SELECT first_seq, last_seq FROM outbox_events WHERE event_type = 'GAP' ORDER BY rowid").forEach {
            gaps.append(UInt64(bitPattern: $0.int64(0))...UInt64(bitPattern: $0.int64(1)))
        }
        return gaps
    }

    /// Epoch → cursor of every stream.
    func streams() throws -> [String: UInt64] {
        var streams: [String: UInt64] = [:]
        try db.prepare("SELECT epoch, cursor FROM stream_cursors").forEach {
            streams[$0.text(0)] = UInt64(bitPattern: $0.int64(1))
        }
        return streams
    }
}
